"""A weight's gradient handed over as a matmul's factors or as G.T: the runtime's rows, scores
and norm equal those of the gradient itself, however it was formed."""

import pytest
import torch
from torch.testing import assert_close

from tests.forked import result_in_forked_child
from zenflow.runtime import cpu_adam
from zenflow.runtime import split_weight as split_weight_module
from zenflow.runtime.comm import DataParallel
from zenflow.runtime.gradient_rows import (
    FACTOR_RATIO,
    TILED_GATHER_MIN_ELEMENTS,
    gather_rows,
    lookup_grad_rows,
)
from zenflow.runtime.split_weight import SplitWeight
from zenflow.runtime.streams import CopyStream

OUT, COLUMNS, SELECTED = 24, 40, (3, 7, 11, 30)


def split_weight(accumulate_on_device: bool, selected=SELECTED) -> SplitWeight:
    """``selected`` None: no selection yet, every column in its natural place; "reselected":
    ``SELECTED`` after six selections of random columns, which leave many columns out of their
    natural places."""
    param = torch.nn.Parameter(torch.randn(OUT, COLUMNS, generator=torch.Generator()))
    w = SplitWeight(param, 0, DataParallel(), pin=False, accumulate_on_device=accumulate_on_device)
    if selected == "reselected":
        g = torch.Generator().manual_seed(5)
        for _ in range(6):
            w.reselect(torch.randperm(COLUMNS, generator=g)[: len(SELECTED)].sort().values)
        selected = SELECTED
    if selected is not None:
        w.reselect(torch.tensor(selected))
    return w


SELECTIONS = [SELECTED, None, "reselected"]


def hand_over(w: SplitWeight, form: str, x: torch.Tensor, dy: torch.Tensor) -> None:
    """x: [batch, columns] activation, dy: [batch, out]; the gradient is G = dy.T @ x."""
    if form == "matmul":
        w.stage_matmul(x.t(), dy)
    elif form == "transposed view":
        w.stage_columns((dy.t() @ x).t())
    else:
        w.stage_columns((x.t() @ dy).contiguous())


FORMS = ["matmul", "transposed view", "contiguous"]


def record_row_forming(monkeypatch) -> list[tuple[tuple, torch.Tensor | None]]:
    """``(args, out)`` of every call the weight makes to form a gradient's rows (by product or
    by gather), recorded as they happen; the rows are still formed."""
    calls = []
    for name in ("matmul_rows", "gather_rows"):
        formed = getattr(split_weight_module, name)

        def recording(*args, formed=formed, out=None):
            calls.append((args, out))
            return formed(*args, out=out)

        monkeypatch.setattr(split_weight_module, name, recording)
    return calls


@pytest.mark.parametrize("accumulate_on_device", [False, True])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("batch", [8, 32])  # below and above OUT: either operand is gathered
@pytest.mark.parametrize("micro_batches", [1, 2, 3])
@pytest.mark.parametrize("selected", SELECTIONS)
def test_rows_scores_and_norm_are_the_gradients(
    form, batch, accumulate_on_device, micro_batches, selected, staging
):
    assert FACTOR_RATIO * batch > min(OUT, COLUMNS)  # rows, not factors
    g = torch.Generator().manual_seed(batch)
    w = split_weight(accumulate_on_device, selected)
    grad_t = torch.zeros(COLUMNS, OUT)
    for _ in range(micro_batches):
        x, dy = torch.randn(batch, COLUMNS, generator=g), torch.randn(batch, OUT, generator=g)
        hand_over(w, form, x, dy)
        grad_t += x.t() @ dy
    w.reduce_staged()
    assert not w.factor_parts
    assert_close(w.selected_rows(), grad_t[w.order[: w.k]], rtol=1e-5, atol=1e-5)
    assert_close(w.unselected_rows(), grad_t[w.order[w.k :]], rtol=1e-5, atol=1e-5)
    assert_close(w.column_scores(), grad_t.square().sum(1), rtol=1e-5, atol=1e-4)
    norm_sq = float(grad_t.double().square().sum())
    assert float(w.staged_norm_sq()) == pytest.approx(norm_sq, rel=1e-5)


@pytest.mark.parametrize("form", FORMS)
def test_one_process_on_the_cpu_forms_the_rows_in_the_host_block(form, monkeypatch):
    """Written where they stay: the rows are formed with the reusable host block as their output
    (no tensor of the gradient's size in between, no copy), the staged unselected rows are that
    block's, and the block is the same one from step to step."""
    calls = record_row_forming(monkeypatch)
    g = torch.Generator().manual_seed(0)
    w = split_weight(accumulate_on_device=False)
    blocks = set()
    for _ in range(3):
        x, dy = torch.randn(16, COLUMNS, generator=g), torch.randn(16, OUT, generator=g)
        calls.clear()
        hand_over(w, form, x, dy)
        w.reduce_staged()
        assert [out.data_ptr() for _, out in calls] == [w._stage_block.data_ptr()]
        assert w.host_stage.data_ptr() == w._stage_block[w.k_local :].data_ptr()
        assert w.staged_bytes == (COLUMNS - len(SELECTED)) * OUT * 4
        blocks.add(w._stage_block.data_ptr())
        w.discard_staged()
    assert len(blocks) == 1


@pytest.mark.parametrize("accumulate_on_device", [False, True])
@pytest.mark.parametrize("form", FORMS)
def test_rows_are_gathered_by_the_order_only_where_they_are_staged_as_one_tensor(
    form, accumulate_on_device, monkeypatch
):
    """Before the first selection (and with topk 0, always) the rows' order is the gradient's
    own: they are formed with no index to gather by. After a selection, a host block (one
    process on the CPU) still takes them in natural order, and only the rows out of their
    natural place are moved, where they are asked for in host row order; rows staged as one
    tensor are formed in the order."""
    calls = record_row_forming(monkeypatch)
    w = split_weight(accumulate_on_device, selected=None)
    x, dy = torch.randn(16, COLUMNS), torch.randn(16, OUT)
    hand_over(w, form, x, dy)
    assert [args[-1] for args, _ in calls] == [None]
    w.discard_staged()
    w.reselect(torch.tensor(SELECTED))
    calls.clear()
    hand_over(w, form, x, dy)
    ((args, _),) = calls
    if accumulate_on_device:
        assert torch.equal(args[-1], w.order)
    else:
        assert args[-1] is None
        # SELECTED from the natural order: 3 stays in front, 7, 11 and 30 swap with 0, 1, 2.
        positions, columns = w._host_row_moves()
        assert positions.tolist() == [7, 11, 30] and columns.tolist() == [0, 1, 2]


@pytest.mark.parametrize("selected", [SELECTED, "reselected"])
def test_the_backward_leaves_the_host_rows_where_the_product_put_them(selected):
    """One process on the CPU: after a selection the block keeps the product in natural order
    (nothing moved in backward); the step's scores and norm come from it as it is, the CPU pool
    reads the host rows there, and only asking for them in host row order moves any."""
    g = torch.Generator().manual_seed(1)
    w = split_weight(accumulate_on_device=False, selected=selected)
    x, dy = torch.randn(16, COLUMNS, generator=g), torch.randn(16, OUT, generator=g)
    grad_t = x.t() @ dy
    hand_over(w, "matmul", x, dy)
    w.reduce_staged()
    assert torch.equal(w._stage_block, grad_t)
    assert_close(w.column_scores(), grad_t.square().sum(1), rtol=1e-5, atol=1e-4)
    assert float(w.staged_norm_sq()) == pytest.approx(float(grad_t.double().square().sum()))
    gathered = w.unselected_staged()
    window_sum = torch.zeros(COLUMNS - w.k, OUT)
    cpu_adam.submit_accumulate([window_sum], [gathered]).wait()
    assert torch.equal(window_sum, grad_t[w.order[w.k :]])
    assert torch.equal(w._stage_block, grad_t)  # still nothing moved
    assert torch.equal(w.host_stage, grad_t[w.order[w.k :]])
    assert w.host_stage.data_ptr() == w._stage_block[w.k :].data_ptr()


def test_a_small_batch_is_kept_as_factors_only_where_the_host_stages():
    x, dy = torch.randn(2, COLUMNS), torch.randn(2, OUT)
    on_host, on_device = split_weight(False), split_weight(True)
    for w in (on_host, on_device):
        w.stage_matmul(x.t(), dy)
    assert on_host.factor_parts and not on_device.factor_parts
    # Later micro-batches follow the first one's form, whatever their size.
    on_host.stage_matmul(torch.randn(COLUMNS, 32), torch.randn(32, OUT))
    assert len(on_host.factor_parts) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("picked", ["permutation", "subset"])
def test_tiled_gather_of_a_transposed_matrix_equals_indexing(dtype, picked):
    """Large enough for csrc's tiled kernel; a row stride wider than the row, odd sizes."""
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(700, 130, generator=g).to(dtype)
    matrix = wide[:, :97]  # [out, columns] with row stride 130
    columns_by_out = matrix.t()
    assert columns_by_out.numel() >= TILED_GATHER_MIN_ELEMENTS
    index = torch.randperm(97, generator=g)
    if picked == "subset":
        index = index[:41]
    out = torch.full((index.numel(), 700), float("nan"), dtype=dtype)
    assert gather_rows(columns_by_out, index, out=out) is out
    assert torch.equal(out, columns_by_out[index])
    assert torch.equal(gather_rows(columns_by_out, index), columns_by_out[index])


@pytest.mark.parametrize("strided", ["transposed", "every other column", "contiguous"])
def test_the_natural_order_is_a_contiguous_copy_of_any_strides(strided):
    """Index None (columns in their natural places): the rows as they are, copied (the graph
    may reuse the source's memory once the op returns), by csrc's tiled kernel for a large
    transposed view."""
    wide = torch.randn(700, 130, generator=torch.Generator().manual_seed(4))
    columns_by_out = {
        "transposed": wide[:, :97].t(),
        "every other column": wide.t()[:, ::2],
        "contiguous": wide.t().contiguous(),
    }[strided]
    out = torch.full(columns_by_out.shape, float("nan"))
    assert gather_rows(columns_by_out, None, out=out) is out
    assert torch.equal(out, columns_by_out)
    copy = gather_rows(columns_by_out, None)
    assert copy.is_contiguous() and torch.equal(copy, columns_by_out)
    assert copy.untyped_storage().data_ptr() != columns_by_out.untyped_storage().data_ptr()


def test_tiled_gather_refuses_an_index_out_of_range_and_writes_nothing():
    columns_by_out = torch.randn(1000, 100).t()
    out = torch.zeros(2, 1000)
    with pytest.raises(IndexError, match="out of range for 100 columns"):
        gather_rows(columns_by_out, torch.tensor([3, 100]), out=out)
    assert not out.any()


@pytest.mark.parametrize("accumulate_on_device", [False, True])
@pytest.mark.parametrize("batch", [2, 32])  # a small batch is not kept as factors with a lookup
@pytest.mark.parametrize("selected", SELECTIONS)
def test_a_tied_tables_lookup_gradient_is_added_into_its_columns(
    batch, accumulate_on_device, selected
):
    g = torch.Generator().manual_seed(1)
    w = split_weight(accumulate_on_device, selected)
    x, dy = torch.randn(batch, COLUMNS, generator=g), torch.randn(batch, OUT, generator=g)
    ids = torch.randint(0, OUT, (9,), generator=g)  # repeats: their gradients add up
    rows = torch.randn(9, COLUMNS, generator=g)
    w.stage_matmul(x.t(), dy, (rows, ids))
    w.reduce_staged()
    grad_t = (x.t() @ dy).index_add(1, ids, rows.t())
    assert not w.factor_parts
    assert_close(w.selected_rows(), grad_t[w.order[: w.k]], rtol=1e-5, atol=1e-5)
    assert_close(w.unselected_rows(), grad_t[w.order[w.k :]], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("accumulate_on_device", [False, True])
@pytest.mark.parametrize("selected", SELECTIONS)
# Fewer tokens than twice the table's OUT entries are added column by column; more are summed
# as G and gathered transposed (a position embedding over a batch).
@pytest.mark.parametrize("tokens", [9, 3 * OUT + 5])
def test_a_tables_lookup_gradient_alone_is_its_rows_in_their_columns(
    accumulate_on_device, selected, tokens
):
    g = torch.Generator().manual_seed(2)
    w = split_weight(accumulate_on_device, selected)
    for _ in range(2):  # the second step reuses the first one's host block: it must start at 0
        ids = torch.randint(0, OUT, (tokens,), generator=g)
        rows = torch.randn(tokens, COLUMNS, generator=g)
        w.stage_lookup(rows, ids)
        w.reduce_staged()
        # Either way each element's tokens are added in token order from zero.
        grad_t = torch.zeros(COLUMNS, OUT).index_add(1, ids, rows.t())
        assert torch.equal(w.selected_rows(), grad_t[w.order[: w.k]])
        assert torch.equal(w.unselected_rows(), grad_t[w.order[w.k :]])
        w.discard_staged()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(24, 40), (300, 256)])  # the second takes the tiled gather
def test_a_position_tables_gradient_is_summed_as_g_and_gathered_in_any_column_order(dtype, shape):
    entries, columns = shape
    g = torch.Generator().manual_seed(3)
    ids = torch.arange(entries).repeat(3)[torch.randperm(3 * entries, generator=g)]
    rows = torch.randn(ids.numel(), columns, generator=g).to(dtype)
    grad_t = torch.zeros(columns, entries, dtype=dtype).index_add(1, ids, rows.t())
    index = torch.randperm(columns, generator=g)
    assert torch.equal(lookup_grad_rows(rows, ids, entries, index), grad_t[index])
    out = torch.full((columns, entries), float("nan"), dtype=dtype)
    assert lookup_grad_rows(rows, ids, entries, None, out=out) is out
    assert torch.equal(out, grad_t)


def _gather_in_child(queue):
    torch.set_num_threads(1)  # libgomp, which torch's own ops use, is not fork-safe
    columns_by_out = torch.arange(600.0 * 200).reshape(600, 200).t()
    out = gather_rows(columns_by_out, torch.tensor([5, 3, 199]))
    queue.put(torch.equal(out, columns_by_out[[5, 3, 199]]))


def test_a_forked_child_gathers_with_its_own_helper_threads():
    columns_by_out = torch.randn(600, 200).t()
    assert columns_by_out.numel() >= TILED_GATHER_MIN_ELEMENTS
    gather_rows(columns_by_out, torch.arange(200))  # the parent's helper threads exist now
    assert result_in_forked_child(_gather_in_child, "the column gather")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_reselection_mid_step_moves_16_bit_rows_exactly_and_keeps_their_block(dtype, staging):
    """The staged 16-bit rows stay in their block (not widened to fp32 whole); a leaving
    column's selected rows (fp32 on the device) go into it, an entering column's come out of
    it, without a change of value; the bytes moved count the staged rows at 2 bytes."""
    g = torch.Generator().manual_seed(6)
    param = torch.nn.Parameter(torch.randn(OUT, COLUMNS, generator=g).to(dtype))
    w = SplitWeight(param, 0, DataParallel(), pin=False)
    w.reselect(torch.tensor(SELECTED))
    x, dy = torch.randn(16, COLUMNS, generator=g), torch.randn(16, OUT, generator=g)
    w.stage_matmul(x.t().to(dtype), dy.to(dtype))
    w.reduce_staged()
    by_column = torch.empty(COLUMNS, OUT)
    by_column[w.order[: w.k]] = w.selected_rows()
    by_column[w.order[w.k :]] = w.unselected_rows().float()
    block = w._stage_block
    assert block.dtype == dtype
    new_selection = torch.tensor([3, 8, 11, 25])  # 7 and 30 leave, 8 and 25 enter
    moved = w.reselect(new_selection)
    assert w._stage_block is block and w.unselected_rows().dtype == dtype
    assert torch.equal(w.selected_rows(), by_column[w.order[: w.k]])
    assert torch.equal(w.unselected_rows().float(), by_column[w.order[w.k :]])
    row_bytes = OUT * (3 * 4 + 2) + 8
    assert moved == (2 * row_bytes, 2 * row_bytes)


def test_every_micro_batch_takes_the_copy_stream_to_the_host(copy_stream_staging, monkeypatch):
    """A weight on a GPU (the copy stream's path, here on its CPU twin): a later micro-batch's
    unselected rows start for the host as the first one's do and are added into the staged sum
    once landed, rather than fetched synchronously in the middle of backward."""
    sent = []
    copy_to_host = CopyStream.copy_to_host

    def recording(self, source, out=None, owned=False):
        sent.append(source.shape)
        return copy_to_host(self, source, out=out, owned=owned)

    monkeypatch.setattr(CopyStream, "copy_to_host", recording)
    g = torch.Generator().manual_seed(7)
    w = split_weight(accumulate_on_device=False)
    grad_t = torch.zeros(COLUMNS, OUT)
    for _ in range(3):
        x, dy = torch.randn(16, COLUMNS, generator=g), torch.randn(16, OUT, generator=g)
        w.stage_matmul(x.t(), dy)
        grad_t += x.t() @ dy
    assert sent == [(COLUMNS - len(SELECTED), OUT)] * 3
    w.reduce_staged()
    assert_close(w.unselected_rows(), grad_t[w.order[w.k :]], rtol=1e-5, atol=1e-5)
