"""Writing updated columns into the weight the model computes with.

Parameters keep PyTorch's layout (``[out, columns]``, row-major, contiguous): transformers'
``save_pretrained``, safetensors and user code view and flatten them. zenflow's buffers hold a
weight's columns as rows (``[n, out]``, each column contiguous), so writing rows back is a
transpose. On the CPU it is csrc's tiled scatter (each cache line written whole while it is in
cache, on every core). On a GPU it is one ``index_copy_`` along the columns: for a window's
unselected columns (most of the weight) from the rows gathered into ``[out, n]`` in ascending
column order, so that neighbouring threads write neighbouring addresses of a row; for the
selected ones (a tenth of the columns, written every step) straight from the transposed rows.
That saves a launch per weight and step on the training thread, and at a tenth of the columns
a row's neighbouring writes fall in separate memory sectors whether the columns are sorted or
not (a 1024 x 4096 bf16 weight's tenth is about 13 MB of sectors either way, by arithmetic).
"""

import torch

from zenflow.columns import as_matrix
from zenflow.runtime.cpu_adam import _load as load_library
from zenflow.runtime.streams import sent_to

# Below this many elements torch's strided copy is done before csrc's threads would wake.
TILED_SCATTER_MIN_ELEMENTS = 1 << 16


def write_columns(
    param: torch.Tensor,
    columns: torch.Tensor,
    rows: torch.Tensor,
    ascending: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Column ``columns[i]`` of ``param`` (seen as ``[out, columns]``) := ``rows[i]``.

    ``columns``: distinct int64 indices; ``rows``: ``[n, out]`` in the parameter's dtype, on its
    device; ``ascending``: ``columns.sort()``, for a GPU's write in ascending column order
    (None: in the order given; the CPU writes in any order)."""
    matrix = as_matrix(param.detach())
    if rows.shape != (columns.numel(), matrix.shape[0]):
        raise ValueError(
            f"{columns.numel()} columns of a [{matrix.shape[0]}, {matrix.shape[1]}] weight take "
            f"rows of shape [{columns.numel()}, {matrix.shape[0]}], got {list(rows.shape)}"
        )
    if matrix.device.type != "cpu" and ascending is not None:
        in_order, position = ascending
        matrix.index_copy_(1, in_order, rows.t().index_select(1, position))
        return
    if matrix.device.type != "cpu" or not _tiled_scatter_fits(matrix, rows):
        matrix.index_copy_(1, sent_to(columns, matrix.device), rows.t())
        return
    rows = rows.contiguous()
    columns = columns.to("cpu", torch.int64).contiguous()
    failed = load_library().zf_scatter_columns(
        matrix.data_ptr(),
        matrix.shape[0],
        matrix.shape[1],
        matrix.stride(0),
        columns.data_ptr(),
        columns.numel(),
        rows.data_ptr(),
        rows.stride(0),
        rows.element_size(),
    )
    if failed:
        raise IndexError(f"column index out of range for {matrix.shape[1]} columns")


def _tiled_scatter_fits(matrix: torch.Tensor, rows: torch.Tensor) -> bool:
    return (
        rows.numel() >= TILED_SCATTER_MIN_ELEMENTS
        and matrix.stride(1) == 1
        and rows.dtype == matrix.dtype
        and rows.element_size() in (2, 4)
    )
