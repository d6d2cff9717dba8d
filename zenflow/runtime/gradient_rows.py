"""A weight's gradient rows (its columns: ``G.T``, ``[columns, out]``) at chosen columns, formed
straight into the buffer that keeps them.

Backward graphs hand a weight's gradient to the runtime in one of two forms: a matmul's two
factors, ``G.T == a @ b`` (``a``: ``[columns, batch]``, ``b``: ``[batch, out]``), or ``G.T``
itself, with whatever strides the graph produced it in. Each function here forms the rows at the
columns ``index`` (the runtime's order), or, for an index of None, every column in its natural
place, with no gather: no selection yet, ``topk_ratio`` 0, or a host block, which keeps every
row in its natural place (``zenflow.runtime.staging.host_block``).
"""

import functools

import torch

from zenflow.runtime.cpu_adam import _load as load_library
from zenflow.runtime.streams import sent_to

# Factors are kept (and multiplied in the step) when the batch is at most this fraction of the
# weight's smaller side: then they hold a small part of the gradient's bytes, and the importance
# computed from them (batch squared per column) costs less than a pass over the gradient.
FACTOR_RATIO = 4

# Gathering a matmul's left operand (a batch's worth per column) beats gathering the product's
# rows from a batch of a quarter of the product's width down (measured on CPU, 2 threads).
OPERAND_GATHER_RATIO = 4

# Below this many elements torch's strided copy is done before csrc's threads would wake.
TILED_GATHER_MIN_ELEMENTS = 1 << 16


def factors_pay(a: torch.Tensor, b: torch.Tensor) -> bool:
    columns, batch = a.shape
    return FACTOR_RATIO * batch <= min(columns, b.shape[1])


def gather_rows(rows: torch.Tensor, index: torch.Tensor | None, out: torch.Tensor | None = None):
    """``rows[index]`` for a 2-D tensor of any strides, into ``out`` when given; a new tensor
    otherwise, even for index None (the graph may reuse the memory of ``rows``).

    A transposed view of a row-major matrix on the CPU (a gradient the graph produced as
    ``[out, columns]``) is gathered by csrc's tiled kernel: torch's strided copy would read it
    one element per cache line, several times slower."""
    host_transpose = _is_host_transpose(rows)
    if index is None:
        if not host_transpose:
            return (
                rows.clone(memory_format=torch.contiguous_format)
                if out is None
                else out.copy_(rows)
            )
        index = torch.arange(rows.shape[0])
    index = sent_to(index, rows.device)
    if not host_transpose:
        # One call on a GPU's path, which runs once per weight and backward on the host.
        return torch.index_select(rows, 0, index, out=out)
    if out is None:
        out = rows.new_empty(index.numel(), rows.shape[1])
    fits = (
        out.is_contiguous()
        and out.dtype == rows.dtype
        and out.shape == (index.numel(), rows.shape[1])
    )
    if fits:
        src = rows.t()
        index = index.contiguous()
        failed = load_library().zf_gather_columns(
            src.data_ptr(),
            src.shape[0],
            src.shape[1],
            src.stride(0),
            index.data_ptr(),
            index.numel(),
            out.data_ptr(),
            out.shape[1],
            out.element_size(),
        )
        if failed:
            raise IndexError(f"column index out of range for {src.shape[1]} columns")
        return out
    return torch.index_select(rows, 0, index, out=out)


def _is_host_transpose(rows: torch.Tensor) -> bool:
    """A 2-D CPU tensor whose columns are contiguous (the transpose of a row-major matrix),
    large enough for csrc's tiled gather to pay."""
    return (
        rows.device.type == "cpu"
        and rows.numel() >= TILED_GATHER_MIN_ELEMENTS
        and rows.dim() == 2
        and rows.shape[0] > 1
        and rows.stride(0) == 1
        and rows.stride(1) >= rows.shape[0]
        and rows.element_size() in (2, 4)
    )


def matmul_rows(
    a: torch.Tensor, b: torch.Tensor, index: torch.Tensor | None, out: torch.Tensor | None = None
):
    """``(a @ b)[index]``, into ``out`` when given. The product is formed and its rows
    gathered (contiguous rows, the cheapest gather), unless the batch is small against the
    product's width (``OPERAND_GATHER_RATIO``): then the rows of ``a`` are gathered before the
    product, which moves far fewer bytes (``a`` is usually a transposed activation, gathered
    along its contiguous dimension)."""
    if index is None:
        return torch.mm(a, b, out=out)
    index = sent_to(index, a.device)
    if OPERAND_GATHER_RATIO * a.shape[1] > b.shape[1]:
        return gather_rows(torch.mm(a, b), index, out=out)
    if a.t().is_contiguous():
        gathered = a.t().index_select(1, index).t()
    else:
        gathered = a.index_select(0, index)
    return torch.mm(gathered, b, out=out)


def with_lookup_added(rows_at, lookup_rows, lookup_ids, index, out=None):
    """``rows_at(index, out)`` (G.T's rows at the columns ``index``) plus a lookup's gradient:
    ``lookup_rows[t]`` (``[tokens, columns]``) added into column ``lookup_ids[t]``."""
    rows = rows_at(index, out=out)
    if index is None:
        by_column = lookup_rows.t()
    else:
        by_column = lookup_rows.index_select(1, sent_to(index, lookup_rows.device)).t()
    return rows.index_add_(1, sent_to(lookup_ids, rows.device), by_column.to(rows.dtype))


def lookup_grad_rows(lookup_rows, lookup_ids, entries: int, index, out=None) -> torch.Tensor:
    """The rows at the columns ``index`` of an embedding table's gradient, ``G.T``
    (``[columns, entries]``): zero but for ``lookup_rows[t]`` (``[tokens, columns]``) added into
    column ``lookup_ids[t]``; into ``out`` when given.

    A table with at most half as many entries as tokens looked up (a position embedding over a
    batch) is summed as ``G`` (each token's row added into a contiguous row) and its rows
    gathered transposed: adding into ``G.T``'s columns is a strided walk per token, which once
    the tokens' rows outgrow the cache costs several times more (1024 entries of 768 on this
    CPU: 2.3 against 1.2 ms for 2048 tokens, 9.8 against 1.2 ms for 4096). A larger table is
    zeroed and added into column by column, which never passes over it twice (at 1024 tokens
    into 1024 entries, 0.7 against 1.0 ms). Both add each element's tokens in token order from
    zero: the same numbers."""
    if 2 * entries <= lookup_ids.numel():
        summed = lookup_rows.new_zeros(entries, lookup_rows.shape[1])
        summed.index_add_(0, sent_to(lookup_ids, lookup_rows.device), lookup_rows)
        return gather_rows(summed.t(), index, out=out)
    zeros_at = functools.partial(zero_rows, lookup_rows, lookup_rows.shape[1], entries)
    return with_lookup_added(zeros_at, lookup_rows, lookup_ids, index, out=out)


def zero_rows(like: torch.Tensor, columns: int, width: int, index, out=None) -> torch.Tensor:
    """Zero rows of a ``[columns, width]`` matrix at the columns ``index`` (``like``'s dtype and
    device), into ``out`` when given."""
    if out is not None:
        return out.zero_()
    return like.new_zeros(columns if index is None else index.numel(), width)
