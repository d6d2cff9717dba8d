"""Updated rows written into the columns of a row-major weight equal indexed assignment."""

import pytest
import torch

from tests.forked import result_in_forked_child
from zenflow.runtime.param_writes import (
    TILED_SCATTER_MIN_ELEMENTS,
    ColumnValues,
    write_columns,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("picked", ["permutation", "most", "lines", "subset", "few"])
# A few columns per row, up to half of them (tiles of transposes in registers), most (strips a
# cache line wide: whole, with gaps, nearly empty; sizes that leave edges to every block, strip
# and tile), and a weight small enough for torch's copy.
@pytest.mark.parametrize("shape", [(700, 97), (203, 701), (3, 5, 4, 2)])
def test_rows_land_in_their_columns_and_nothing_else_changes(dtype, picked, shape):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(shape, generator=g).to(dtype)
    columns = weight[0].numel()
    index = torch.randperm(columns, generator=g)
    if picked == "most":  # as the unselected columns: runs of neighbours, with gaps
        index = index[: columns * 9 // 10]
    elif picked == "lines":  # two of three runs of 32 columns whole, the third nearly empty
        index = index[((index // 32) % 3 != 2) | (index % 32 < 2)]
    elif picked == "subset":
        index = index[: columns // 2]
    elif picked == "few":
        index = index[:2]
    rows = torch.randn(index.numel(), shape[0], generator=g).to(dtype)
    expected = weight.clone().reshape(shape[0], -1)
    expected[:, index] = rows.t()
    storage = weight.data_ptr()
    write_columns(weight, ColumnValues(index, rows))
    assert torch.equal(weight.reshape(shape[0], -1), expected)
    assert weight.is_contiguous() and weight.data_ptr() == storage
    if shape[0] > 100 and picked == "permutation":
        assert rows.numel() >= TILED_SCATTER_MIN_ELEMENTS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# csrc's one pass over the weight, and torch's copies one after another for a small one.
@pytest.mark.parametrize("shape", [(700, 97), (9, 31)])
def test_several_writes_at_once_equal_them_one_after_another(dtype, shape):
    """A window's write-back and the step's selected columns in one call: every column takes
    the values of the last write that names it (the selected columns entering at a select
    boundary are named by both: their device values win)."""
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(shape, generator=g).to(dtype)
    order = torch.randperm(shape[1], generator=g)
    k = shape[1] // 10
    selected, unselected = order[:k], order[k:]
    entering = unselected[: max(1, k // 2)]  # named again by the selected write, last
    selected = torch.cat([selected[: k - entering.numel()], entering])
    writes = [
        ColumnValues(unselected, torch.randn(unselected.numel(), shape[0], generator=g).to(dtype)),
        ColumnValues(selected, torch.randn(selected.numel(), shape[0], generator=g).to(dtype)),
    ]
    expected = weight.clone()
    for write in writes:
        expected[:, write.columns] = write.rows.t()
    write_columns(weight, *writes)
    assert torch.equal(weight, expected)
    assert weight[:, entering].eq(writes[1].rows[-entering.numel() :].t()).all()


def test_an_index_out_of_range_in_any_write_is_refused_and_nothing_is_written():
    weight = torch.zeros(1000, 100)
    good = ColumnValues(torch.arange(90), torch.ones(90, 1000))
    with pytest.raises(IndexError, match="out of range for 100 columns"):
        write_columns(weight, good, ColumnValues(torch.tensor([3, 100]), torch.ones(2, 1000)))
    assert not weight.any()


def test_an_index_out_of_range_is_refused_and_writes_nothing():
    weight = torch.zeros(1000, 100)
    with pytest.raises(IndexError, match="out of range for 100 columns"):
        write_columns(weight, ColumnValues(torch.tensor([3, 100] * 40), torch.ones(80, 1000)))
    assert not weight.any()


@pytest.mark.parametrize("shape", [(2, 7), (2, 8, 1), (16,)])
def test_rows_of_the_wrong_shape_are_refused(shape):
    got = ", ".join(str(n) for n in shape)
    with pytest.raises(ValueError, match=rf"take rows of shape \[2, 8\], got \[{got}\]"):
        write_columns(torch.zeros(8, 5), ColumnValues(torch.tensor([0, 1]), torch.zeros(shape)))


def _scatter_in_child(queue):
    torch.set_num_threads(1)  # libgomp, which torch's own ops use, is not fork-safe
    weight = torch.zeros(600, 200)
    rows = torch.arange(3 * 600.0).reshape(3, 600)
    write_columns(weight, ColumnValues(torch.tensor([5, 3, 199]), rows))
    queue.put(torch.equal(weight[:, [5, 3, 199]], rows.t()))


def test_a_forked_child_scatters_with_its_own_helper_threads():
    write_columns(torch.zeros(600, 200), ColumnValues(torch.arange(200), torch.ones(200, 600)))
    assert result_in_forked_child(_scatter_in_child, "the column scatter")
