"""A weight's gradient staged by each strategy, whatever form backward hands it over in: the
selected rows, the unselected rows, the scores and the norm are those of the gradient itself."""

import pytest
import torch
from torch.testing import assert_close

from zenflow.runtime import cpu_adam
from zenflow.runtime.comm import DataParallel
from zenflow.runtime.gradient_rows import FACTOR_RATIO
from zenflow.runtime.host_sync import HostSync
from zenflow.runtime.owned_weight import OwnedWeight
from zenflow.runtime.staging import ProductBlocks
from zenflow.runtime.staging import base as staging_base
from zenflow.runtime.staging.contributions import Factors, HostRows, as_tensor
from zenflow.runtime.streams import CopyStream
from zenflow.runtime.window_sum import WindowSum

OUT, COLUMNS, SELECTED = 24, 40, (3, 7, 11, 30)


def owned_weight(device_sums: bool = False, selected=SELECTED, dtype=torch.float32):
    """``selected`` None: no selection yet, every column in its natural place; "reselected":
    ``SELECTED`` after six selections of random columns, which leave many columns out of their
    natural places."""
    param = torch.nn.Parameter(torch.randn(OUT, COLUMNS).to(dtype))
    w = OwnedWeight(
        param, 0, DataParallel(), offload=False, device_sums=device_sums, sync=HostSync()
    )
    if selected == "reselected":
        g = torch.Generator().manual_seed(5)
        for _ in range(6):
            w.reselect(torch.randperm(COLUMNS, generator=g)[: len(SELECTED)].sort().values)
        selected = SELECTED
    if selected is not None:
        w.reselect(torch.tensor(selected))
    return w


SELECTIONS = [SELECTED, None, "reselected"]


def hand_over(w: OwnedWeight, form: str, x: torch.Tensor, dy: torch.Tensor) -> None:
    """x: [batch, columns] activation, dy: [batch, out]; the gradient is G = dy.T @ x."""
    if form == "matmul":
        w.stage_matmul(x.t(), dy)
    elif form == "transposed view":
        w.stage_columns((dy.t() @ x).t())
    else:
        w.stage_columns((x.t() @ dy).contiguous())


FORMS = ["matmul", "transposed view", "contiguous"]


def selected_and_unselected(w: OwnedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """The staged rows as the step reads them, in device and host row order."""
    selected = w.staging.selected_rows()
    w.staging.land()
    return selected, as_tensor(w.staging.hand_over())


def record_row_forming(monkeypatch) -> list[tuple[tuple, torch.Tensor | None]]:
    """``(args, out)`` of every call the staging makes to form a gradient's rows (by product or
    by gather), recorded as they happen; the rows are still formed."""
    calls = []
    for name in ("matmul_rows", "gather_rows"):
        formed = getattr(staging_base, name)

        def recording(*args, formed=formed, out=None):
            calls.append((args, out))
            return formed(*args, out=out)

        monkeypatch.setattr(staging_base, name, recording)
    return calls


@pytest.mark.parametrize("device_sums", [False, True])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("batch", [8, 32])  # below and above OUT: either operand is gathered
@pytest.mark.parametrize("micro_batches", [1, 2, 3])
@pytest.mark.parametrize("selected", SELECTIONS)
def test_rows_scores_and_norm_are_the_gradients(
    form, batch, device_sums, micro_batches, selected, staging
):
    assert FACTOR_RATIO * batch > min(OUT, COLUMNS)  # rows, not factors
    g = torch.Generator().manual_seed(batch)
    w = owned_weight(device_sums, selected)
    grad_t = torch.zeros(COLUMNS, OUT)
    for _ in range(micro_batches):
        x, dy = torch.randn(batch, COLUMNS, generator=g), torch.randn(batch, OUT, generator=g)
        hand_over(w, form, x, dy)
        grad_t += x.t() @ dy
    w.staging.finish()
    assert_close(w.staging.scores(), grad_t.square().sum(1), rtol=1e-5, atol=1e-4)
    norm_sq = float(grad_t.double().square().sum())
    assert float(w.staging.norm_sq()) == pytest.approx(norm_sq, rel=1e-5)
    selected_rows, unselected_rows = selected_and_unselected(w)
    assert_close(selected_rows, grad_t[w.layout.device_columns], rtol=1e-5, atol=1e-5)
    assert_close(unselected_rows.float(), grad_t[w.layout.host_columns], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", FORMS)
def test_one_process_on_the_cpu_forms_the_rows_in_the_host_block(form, monkeypatch):
    """Written where they stay: the rows are formed with a reusable host block as their output
    (no tensor of the gradient's size in between, no copy), in natural column order; the pool
    reads the unselected rows from that block in place, and the block is the same one from step
    to step."""
    calls = record_row_forming(monkeypatch)
    g = torch.Generator().manual_seed(0)
    w = owned_weight()
    blocks = set()
    for _ in range(3):
        x, dy = torch.randn(16, COLUMNS, generator=g), torch.randn(16, OUT, generator=g)
        calls.clear()
        hand_over(w, form, x, dy)
        w.staging.finish()
        ((args, out),) = calls
        assert args[-1] is None  # natural order: nothing gathered
        assert w.staging.staged_bytes == (COLUMNS - len(SELECTED)) * OUT * 4
        handed = w.staging.hand_over()
        assert isinstance(handed, HostRows) and handed.rows.source is out
        assert_close(handed.rows.source, x.t() @ dy, rtol=1e-5, atol=1e-5)  # natural order
        assert torch.equal(handed.rows.index, w.layout.host_columns)
        blocks.add(out.data_ptr())
        handed.release()
        w.staging.discard()
    assert len(blocks) == 1


@pytest.mark.parametrize(
    "form, device_sums",
    [(form, False) for form in FORMS] + [(form, True) for form in FORMS if form != "matmul"],
)
def test_rows_are_gathered_by_the_order_only_where_they_are_staged_as_one_tensor(
    form, device_sums, monkeypatch
):
    """Before the first selection (and with topk 0, always) the rows' order is the gradient's
    own: they are formed with no index to gather by. After a selection a host block (one
    process on the CPU) still takes them in natural order; rows staged as one tensor are formed
    in the layout's order (a product with device-side sums is put in order at the step:
    ``test_products_with_device_side_sums_are_put_in_order_together``)."""
    calls = record_row_forming(monkeypatch)
    w = owned_weight(device_sums, selected=None)
    x, dy = torch.randn(16, COLUMNS), torch.randn(16, OUT)
    hand_over(w, form, x, dy)
    assert [args[-1] for args, _ in calls] == [None]
    w.staging.discard()
    w.reselect(torch.tensor(SELECTED))
    calls.clear()
    hand_over(w, form, x, dy)
    ((args, _),) = calls
    if device_sums:
        assert torch.equal(args[-1], w.layout.order())
    else:
        assert args[-1] is None


@pytest.mark.parametrize("weights_per_block", [1, 2, None], ids=["1", "2", "all"])
def test_products_with_device_side_sums_are_put_in_order_together(weights_per_block, monkeypatch):
    """Weights of one width share blocks (as many as fit): the backward writes each one's
    product there in natural column order (no row is gathered at the hand-over), and the first
    read of any of them puts every pending weight's rows in its layout's order. A weight whose
    gradient is dropped meanwhile is left out; one that joins later gets a region of its own;
    a second micro-batch adds into the rows of the first."""
    weight_bytes = COLUMNS * OUT * 4
    max_bytes = 2**40 if weights_per_block is None else weights_per_block * weight_bytes
    products = ProductBlocks(max_block_bytes=max_bytes)
    g = torch.Generator().manual_seed(3)

    def weight(selected):
        param = torch.nn.Parameter(torch.randn(OUT, COLUMNS, generator=g))
        sync = HostSync()
        w = OwnedWeight(
            param, 0, DataParallel(), offload=False, device_sums=True, sync=sync, products=products
        )
        w.reselect(torch.tensor(selected))
        return w

    def stage(w):
        x, dy = torch.randn(8, COLUMNS, generator=g), torch.randn(8, OUT, generator=g)
        w.stage_matmul(x.t(), dy)
        return (x.t() @ dy)[w.layout.order()]

    calls = record_row_forming(monkeypatch)
    first, dropped, late = weight(SELECTED), weight((0, 1, 2, 39)), None
    for _ in range(2):
        expected = stage(first)
        stage(dropped)
        dropped.discard_gradient()
        if late is None:
            late = weight((5, 6, 7, 8))
        expected_late = stage(late)
        assert calls == []
        late.staging.finish()  # the step's first call, before any read
        assert_close(torch.cat(selected_and_unselected(late)), expected_late)
        assert_close(torch.cat(selected_and_unselected(first)), expected)
        first.discard_gradient()
        late.discard_gradient()
    total = stage(first)
    total += stage(first)  # the second micro-batch
    first.staging.finish()
    assert_close(torch.cat(selected_and_unselected(first)), total)


@pytest.mark.parametrize("selected", [SELECTED, "reselected"])
def test_the_backward_leaves_the_host_rows_where_the_product_put_them(selected):
    """One process on the CPU: after a selection the block keeps the product in natural order
    (nothing moved); the step's scores and norm come from it as it is, and the CPU pool reads
    the host rows there."""
    g = torch.Generator().manual_seed(1)
    w = owned_weight(selected=selected)
    x, dy = torch.randn(16, COLUMNS, generator=g), torch.randn(16, OUT, generator=g)
    grad_t = x.t() @ dy
    hand_over(w, "matmul", x, dy)
    w.staging.finish()
    assert_close(w.staging.scores(), grad_t.square().sum(1), rtol=1e-5, atol=1e-4)
    assert float(w.staging.norm_sq()) == pytest.approx(float(grad_t.double().square().sum()))
    handed = w.staging.hand_over()
    assert torch.equal(handed.rows.source, grad_t)  # in natural order, nothing moved
    window_sum = torch.zeros(COLUMNS - len(SELECTED), OUT)
    cpu_adam.submit_accumulate([window_sum], [handed.rows]).wait()
    assert torch.equal(window_sum, grad_t[w.layout.host_columns])


def test_a_small_batch_is_kept_as_factors_only_where_the_host_stages():
    x, dy = torch.randn(2, COLUMNS), torch.randn(2, OUT)
    on_host, on_device = owned_weight(), owned_weight(device_sums=True)
    for w in (on_host, on_device):
        w.stage_matmul(x.t(), dy)
    # Later micro-batches follow the first one's form, whatever their size.
    on_host.stage_matmul(torch.randn(COLUMNS, 32), torch.randn(32, OUT))
    handed = on_host.staging.hand_over()
    assert isinstance(handed, Factors) and handed.x.shape == (34, COLUMNS)
    assert not isinstance(on_device.staging.hand_over(), Factors)


def test_factors_give_the_norm_scores_and_rows_of_their_product():
    g = torch.Generator().manual_seed(0)
    as_rows, as_factors = owned_weight(), owned_weight()
    parts = [(torch.randn(3, COLUMNS, generator=g), torch.randn(3, OUT, generator=g))] * 2
    grad_t = sum(x.t() @ dy for x, dy in parts)  # two micro-batches: [columns, out]
    for x, dy in parts:
        as_factors.stage_matmul(x.t(), dy)
        as_rows.stage_columns(x.t() @ dy)
    for w in (as_rows, as_factors):
        w.staging.finish()
    norm_sq = torch.tensor(float(grad_t.double().square().sum()))
    for w in (as_rows, as_factors):
        assert_close(w.staging.norm_sq().float(), norm_sq, rtol=1e-5, atol=0)
        assert_close(w.staging.scores(), grad_t.square().sum(1), rtol=1e-5, atol=1e-5)
    assert_close(
        as_factors.staging.selected_rows(), as_rows.staging.selected_rows(), rtol=1e-5, atol=1e-5
    )
    assert as_factors.staging.staged_bytes == 2 * (3 * COLUMNS + 3 * OUT) * 4
    rows, factors = as_rows.staging.hand_over(), as_factors.staging.hand_over()
    assert isinstance(factors, Factors)
    sums = [WindowSum(torch.device("cpu")), WindowSum(torch.device("cpu"))]
    sums[0].add_now(rows, 0.5, OUT)
    sums[1].add_now(factors, 0.5, OUT)
    assert_close(sums[1].sum, sums[0].sum, rtol=1e-5, atol=1e-5)


def test_factors_then_rows_in_one_step_are_refused():
    w = owned_weight()
    w.stage_matmul(torch.zeros(COLUMNS, 2), torch.zeros(2, OUT))
    with pytest.raises(RuntimeError, match="as rows and as factors"):
        w.stage_columns(torch.zeros(COLUMNS, OUT))
    w.staging.discard()
    w.stage_columns(torch.zeros(COLUMNS, OUT))
    w.stage_matmul(torch.zeros(COLUMNS, 2), torch.zeros(2, OUT))  # rows first: rows it stays
    assert isinstance(w.staging.hand_over(), HostRows)


def test_deferred_steps_sum_into_the_window_as_their_rows_would():
    g = torch.Generator().manual_seed(1)
    deferred, added = WindowSum(torch.device("cpu")), WindowSum(torch.device("cpu"))
    host_columns = torch.tensor([c for c in range(COLUMNS) if c not in SELECTED])
    for alpha in (1.0, 0.5, 2.0):  # clip coefficients differ from step to step
        x, dy = torch.randn(3, COLUMNS, generator=g), torch.randn(3, OUT, generator=g)
        deferred.defer(Factors(x, dy, host_columns), alpha)
        added.add_now(Factors(x, dy, host_columns), alpha, OUT)
    window, last = deferred.take(background=False)
    assert last is None and not deferred.deferred
    assert_close(window, added.sum, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device_sums", [False, True])
@pytest.mark.parametrize("batch", [2, 32])  # a small batch is not kept as factors with a lookup
@pytest.mark.parametrize("selected", SELECTIONS)
def test_a_tied_tables_lookup_gradient_is_added_into_its_columns(batch, device_sums, selected):
    g = torch.Generator().manual_seed(1)
    w = owned_weight(device_sums, selected)
    x, dy = torch.randn(batch, COLUMNS, generator=g), torch.randn(batch, OUT, generator=g)
    ids = torch.randint(0, OUT, (9,), generator=g)  # repeats: their gradients add up
    rows = torch.randn(9, COLUMNS, generator=g)
    w.stage_matmul(x.t(), dy, (rows, ids))
    w.staging.finish()
    grad_t = (x.t() @ dy).index_add(1, ids, rows.t())
    selected_rows, unselected_rows = selected_and_unselected(w)
    assert_close(selected_rows, grad_t[w.layout.device_columns], rtol=1e-5, atol=1e-5)
    assert_close(unselected_rows, grad_t[w.layout.host_columns], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device_sums", [False, True])
@pytest.mark.parametrize("selected", SELECTIONS)
# Fewer tokens than twice the table's OUT entries are added column by column; more are summed
# as G and gathered transposed (a position embedding over a batch).
@pytest.mark.parametrize("tokens", [9, 3 * OUT + 5])
def test_a_tables_lookup_gradient_alone_is_its_rows_in_their_columns(device_sums, selected, tokens):
    g = torch.Generator().manual_seed(2)
    w = owned_weight(device_sums, selected)
    for _ in range(2):  # the second step reuses the first one's host block: it must start at 0
        ids = torch.randint(0, OUT, (tokens,), generator=g)
        rows = torch.randn(tokens, COLUMNS, generator=g)
        w.stage_lookup(rows, ids)
        w.staging.finish()
        # Either way each element's tokens are added in token order from zero.
        grad_t = torch.zeros(COLUMNS, OUT).index_add(1, ids, rows.t())
        selected_rows, unselected_rows = selected_and_unselected(w)
        assert torch.equal(selected_rows, grad_t[w.layout.device_columns])
        assert torch.equal(unselected_rows, grad_t[w.layout.host_columns])
        w.staging.discard()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_reselection_mid_step_moves_16_bit_rows_exactly(dtype, staging):
    """A leaving column's selected rows (fp32 on the device) go to the host rows, an entering
    column's come from them, without a change of value. Through the copy stream the staged rows
    stay in their 16-bit block (not widened to fp32 whole) and move at 2 bytes a row element;
    in a host block nothing staged moves at all (every row is in its natural place)."""
    g = torch.Generator().manual_seed(6)
    x, dy = torch.randn(16, COLUMNS, generator=g), torch.randn(16, OUT, generator=g)
    staged = []
    for _ in range(2):  # the same gradient staged twice: one is read as is, one reselected
        w = owned_weight(dtype=dtype)
        w.stage_matmul(x.t().to(dtype), dy.to(dtype))
        w.staging.finish()
        staged.append(w)
    as_staged, w = staged
    by_column = torch.empty(COLUMNS, OUT)
    selected_rows, unselected_rows = selected_and_unselected(as_staged)
    by_column[as_staged.layout.device_columns] = selected_rows
    by_column[as_staged.layout.host_columns] = unselected_rows.float()
    new_selection = torch.tensor([3, 8, 11, 25])  # 7 and 30 leave, 8 and 25 enter
    moved = w.reselect(new_selection)
    selected_rows, unselected_rows = selected_and_unselected(w)
    assert torch.equal(selected_rows, by_column[w.layout.device_columns])
    assert torch.equal(unselected_rows.float(), by_column[w.layout.host_columns])
    state_row_bytes = OUT * 3 * 4 + 8
    if staging == "copy stream":
        assert unselected_rows.dtype == dtype
        row_bytes = state_row_bytes + OUT * 2
    else:
        row_bytes = state_row_bytes
    assert moved == (2 * row_bytes, 2 * row_bytes)


def test_every_micro_batch_takes_the_copy_stream_to_the_host(copy_stream_staging, monkeypatch):
    """A weight on a GPU (the copy stream's path, here on its CPU twin): a later micro-batch's
    unselected rows start for the host as the first one's do and are added into the staged sum
    once landed, rather than fetched synchronously in the middle of backward."""
    w = owned_weight()
    sent = []
    copy_to_host = CopyStream.copy_to_host

    def recording(self, source, out=None, owned=False):
        sent.append(source.shape)
        return copy_to_host(self, source, out=out, owned=owned)

    monkeypatch.setattr(CopyStream, "copy_to_host", recording)
    g = torch.Generator().manual_seed(7)
    grad_t = torch.zeros(COLUMNS, OUT)
    for _ in range(3):
        x, dy = torch.randn(16, COLUMNS, generator=g), torch.randn(16, OUT, generator=g)
        w.stage_matmul(x.t(), dy)
        grad_t += x.t() @ dy
    assert sent == [(COLUMNS - len(SELECTED), OUT)] * 3
    w.staging.finish()
    _, unselected_rows = selected_and_unselected(w)
    assert_close(unselected_rows, grad_t[w.layout.host_columns], rtol=1e-5, atol=1e-5)
