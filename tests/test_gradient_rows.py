"""A gradient's rows formed from the forms backward hands over: a product's rows, a transposed
matrix gathered by csrc's tiled kernel, a lookup's gradient summed into its columns."""

import pytest
import torch

from tests.forked import result_in_forked_child
from zenflow.runtime.gradient_rows import TILED_GATHER_MIN_ELEMENTS, gather_rows, lookup_grad_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("picked", ["permutation", "most", "lines", "repeated", "subset"])
def test_tiled_gather_of_a_transposed_matrix_equals_indexing(dtype, picked):
    """Large enough for csrc's kernel; a row stride wider than the row, odd sizes. Most of the
    columns, each once, go in strips a cache line wide (whole, with gaps, nearly empty); fewer,
    or a column named twice, in tiles."""
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(700, 130, generator=g).to(dtype)
    matrix = wide[:, :97]  # [out, columns] with row stride 130
    columns_by_out = matrix.t()
    assert columns_by_out.numel() >= TILED_GATHER_MIN_ELEMENTS
    index = torch.randperm(97, generator=g)
    if picked == "most":
        index = index[: 97 * 9 // 10]
    elif picked == "lines":  # two of three runs of 32 columns whole, the third nearly empty
        index = index[((index // 32) % 3 != 2) | (index % 32 < 2)]
    elif picked == "repeated":
        index[7] = index[3]
    elif picked == "subset":
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
