"""Writing updated columns into the weight the model computes with.

Parameters keep PyTorch's layout (``[out, columns]``, row-major, contiguous): transformers'
``save_pretrained``, safetensors and user code view and flatten them. zenflow's buffers hold a
weight's columns as rows (``[n, out]``, each column contiguous), so writing rows back is a
transpose. On the CPU it is csrc's scatter, on every core: most of a weight's columns (a
window's write-back) in strips a cache line wide, whose source rows are read as streams and
whose lines are written whole; fewer in tiles that keep each line in cache while it is used. On
a GPU it is one ``index_copy_`` along the columns: for a window's unselected columns (most of
the weight) from the rows gathered into ``[out, n]`` in ascending column order, so that
neighbouring threads write neighbouring addresses of a row; for the selected ones (a tenth of
the columns, written every step) straight from the transposed rows. That saves a launch per
weight and step on the training thread, and at a tenth of the columns a row's neighbouring
writes fall in separate memory sectors whether the columns are sorted or not (a 1024 x 4096
bf16 weight's tenth is about 13 MB of sectors either way, by arithmetic).
"""

import ctypes
from dataclasses import dataclass, field

import torch

from zenflow.columns import as_matrix
from zenflow.runtime.cpu_adam import _load as load_library
from zenflow.runtime.streams import sent_to

# Below this many elements torch's strided copy is done before csrc's threads would wake.
TILED_SCATTER_MIN_ELEMENTS = 1 << 16


@dataclass(frozen=True)
class ColumnValues:
    """New values of some columns of a weight: column ``columns[i]`` (distinct int64 indices)
    takes ``rows[i]`` (``[n, out]``, the parameter's dtype, on its device); ``ascending``:
    ``columns.sort()``, for a GPU's write in ascending column order (None: in the order given;
    the CPU writes in any order). ``by_column`` is ``rows.t()``, the form a write along the
    parameter's columns takes, made once: a weight's selected columns are written from the
    same values step after step (``OwnedWeight.selected_values``)."""

    columns: torch.Tensor
    rows: torch.Tensor
    ascending: tuple[torch.Tensor, torch.Tensor] | None = None
    by_column: torch.Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        # Rows of any other shape are refused by the write, with the shape it takes.
        by_column = self.rows.t() if self.rows.dim() == 2 else self.rows
        object.__setattr__(self, "by_column", by_column)


def write_columns(param: torch.Tensor, *writes: ColumnValues) -> None:
    """Each of ``writes`` into ``param`` (seen as ``[out, columns]``), in the order given: a
    column that several name takes the last one's values. On the CPU they go in one pass over
    the parameter, each cache line of it read and written once: a window's write-back and the
    step's selected columns together write every line once, where one after the other they
    would write most lines twice (a tenth of the columns touches four lines in five). At an
    overlapped select boundary the columns entering the selection ride in the same pass."""
    # The step writes every weight's selected columns every step: no view is made that the
    # write does not need (under no_grad, as in a step, the parameter takes the write itself).
    matrix = param.detach() if torch.is_grad_enabled() else param
    if matrix.dim() != 2:
        matrix = as_matrix(matrix)
    for write in writes:
        if write.rows.shape != (write.columns.numel(), matrix.shape[0]):
            raise ValueError(
                f"{write.columns.numel()} columns of a [{matrix.shape[0]}, {matrix.shape[1]}] "
                f"weight take rows of shape [{write.columns.numel()}, {matrix.shape[0]}], got "
                f"{list(write.rows.shape)}"
            )
    on_cpu = matrix.device.type == "cpu"
    if on_cpu and _tiled_scatter_fits(matrix, writes):
        _tiled_scatter(matrix, writes)
        return
    for write in writes:
        if not on_cpu and write.ascending is not None:
            in_order, position = write.ascending
            matrix.index_copy_(1, in_order, write.by_column.index_select(1, position))
        else:
            matrix.index_copy_(1, sent_to(write.columns, matrix.device), write.by_column)


def _tiled_scatter(matrix: torch.Tensor, writes: tuple[ColumnValues, ...]) -> None:
    """csrc's tiled scatter of every write at once."""
    rows = [w.rows.contiguous() for w in writes]
    columns = [w.columns.to("cpu", torch.int64).contiguous() for w in writes]
    sets = len(writes)
    failed = load_library().zf_scatter_column_sets(
        matrix.data_ptr(),
        matrix.shape[0],
        matrix.shape[1],
        matrix.stride(0),
        sets,
        (ctypes.c_void_p * sets)(*(c.data_ptr() for c in columns)),
        (ctypes.c_int64 * sets)(*(c.numel() for c in columns)),
        (ctypes.c_void_p * sets)(*(r.data_ptr() for r in rows)),
        (ctypes.c_int64 * sets)(*(r.stride(0) for r in rows)),
        matrix.element_size(),
    )
    if failed:
        raise IndexError(f"column index out of range for {matrix.shape[1]} columns")


def _tiled_scatter_fits(matrix: torch.Tensor, writes: tuple[ColumnValues, ...]) -> bool:
    return (
        sum(w.rows.numel() for w in writes) >= TILED_SCATTER_MIN_ELEMENTS
        and matrix.stride(1) == 1
        and matrix.element_size() in (2, 4)
        and all(w.rows.dtype == matrix.dtype for w in writes)
    )
