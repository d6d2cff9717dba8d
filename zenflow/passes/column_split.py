"""Pass 2: hand each owned weight's gradient to the runtime as rows in column order.

For a weight gradient G of shape [out, *rest] (viewed as [out, columns]), the runtime's column
order puts the selected columns first. The pass produces G's columns in that order as rows of a
``[columns, out]`` matrix (each column contiguous, the layout of the host buffers) and stages
them; the order is data fetched at run time, so a reselection needs no recompile. For a matmul
gradient ``G = dY.T @ X`` it gathers the columns of the activation X (batch x columns) rather
than of G (out x columns). The weight's gradient output becomes None: no full-size ``.grad`` is
ever stored::

    # before                                # after
    mm_2 = aten.mm(t_6, primals_3)          x_t = aten.permute(primals_3, [1, 0])
                                            dy = aten.permute(t_6, [1, 0])
                                            order = zenflow.column_order(x_t, slot)
                                            x_rows = aten.index(x_t, [order])
                                            rows = aten.mm(x_rows, dy)   # G.T[order]
                                            zenflow.stage_columns(rows, slot)
    return (mm_2, ...)                      return (None, ...)

When the batch is small against the weight (``FACTOR_RATIO * batch <= min(columns, out)``) and
the runtime takes factors (one process, weight on the CPU, where the product costs the same in
backward or in the step), the product is not formed at all: the two factors are staged and the
runtime multiplies them straight into its buffers once the step's checks are done::

    mm_2 = aten.mm(t_6, primals_3)          x_t = aten.permute(primals_3, [1, 0])
                                            dy = aten.permute(t_6, [1, 0])
                                            zenflow.stage_factors(x_t, dy, slot)
    return (mm_2, ...)                      return (None, ...)
"""

import torch

import zenflow.ops  # noqa: F401  (registers torch.ops.zenflow)
from zenflow.passes.graph_edit import call, output_values, set_output_values
from zenflow.passes.locate_grads import GradSite

aten = torch.ops.aten

# Factors are staged when the batch is at most this fraction of the weight's smaller side: then
# they hold a small part of the gradient's bytes, and the importance computed from them (batch
# squared per column) costs less than a pass over the gradient.
FACTOR_RATIO = 4


def _is_transpose(node: torch.fx.Node) -> bool:
    return node.target is aten.t.default or (
        node.target is aten.permute.default and list(node.args[1]) == [1, 0]
    )


def _single_use_matmul(node: torch.fx.Node) -> bool:
    return node.target is aten.mm.default and len(node.users) == 1


def _transposed_operands(graph: torch.fx.Graph, grad: torch.fx.Node):
    """``(lhs, rhs)`` with ``G.T == lhs @ rhs`` when G (or G.T) is a matmul nothing else reads,
    else None."""
    if _is_transpose(grad):
        inner = grad.args[0]
        if _single_use_matmul(inner):
            return inner.args
        if _is_transpose(inner) and _single_use_matmul(inner.args[0]):
            grad = inner.args[0]
        else:
            return None
    if not _single_use_matmul(grad):
        return None
    a, b = grad.args
    return (
        call(graph, aten.permute.default, b, [1, 0]),
        call(graph, aten.permute.default, a, [1, 0]),
    )


def _cheaper_to_gather_operand(lhs: torch.fx.Node, rhs: torch.fx.Node) -> bool:
    """Gathering the rows of ``lhs`` ([columns, n]) instead of the product's ([columns, out])
    moves n / out as much; n is the batch (tokens), often far below out."""
    n, out = lhs.meta["val"].shape[1], rhs.meta["val"].shape[1]
    if isinstance(n, int) and isinstance(out, int):
        return n <= out
    return True


def _factors_pay(lhs: torch.fx.Node, rhs: torch.fx.Node) -> bool:
    columns, batch = lhs.meta["val"].shape
    out = rhs.meta["val"].shape[1]
    if not all(isinstance(size, int) for size in (columns, batch, out)):
        return False
    return FACTOR_RATIO * batch <= min(columns, out)


def _rows_in_column_order(
    graph: torch.fx.Graph, grad: torch.fx.Node, operands, slot: int
) -> torch.fx.Node:
    """G.T's rows (G's columns) in the runtime's column order, contiguous.

    When G is a matmul only G reads, the rows of its left operand are gathered before the
    product (``G.T[order] == lhs[order] @ rhs``), which for a small batch is a fraction of
    gathering the product. Otherwise G.T is gathered: the graph's own transpose where there is
    one, or a view. ``operands``: ``_transposed_operands(graph, grad)``."""
    if operands is None:
        transposed = grad.args[0] if _is_transpose(grad) else None
        if transposed is None:
            transposed = call(graph, aten.permute.default, grad, [1, 0])
        order = call(graph, torch.ops.zenflow.column_order.default, transposed, slot)
        return call(graph, aten.index.Tensor, transposed, [order])
    lhs, rhs = operands
    order = call(graph, torch.ops.zenflow.column_order.default, lhs, slot)
    if _cheaper_to_gather_operand(lhs, rhs):
        gathered = call(graph, aten.index.Tensor, lhs, [order])
        return call(graph, aten.mm.default, gathered, rhs)
    product = call(graph, aten.mm.default, lhs, rhs)
    return call(graph, aten.index.Tensor, product, [order])


def split_columns(
    graph: torch.fx.Graph, sites: list[GradSite], factor_slots: frozenset[int] = frozenset()
) -> None:
    """``factor_slots``: the weights whose runtime takes gradient factors (``stage_factors``)."""
    outputs = output_values(graph)
    for site in sites:
        grad = site.grad
        value = grad.meta["val"]
        with graph.inserting_before(graph.output_node()):
            if value.dim() > 2:
                if not value.is_contiguous():
                    grad = call(graph, aten.clone.default, grad)
                out = value.shape[0]
                if isinstance(out, torch.SymInt):
                    out = call(graph, aten.sym_size.int, grad, 0)
                grad = call(graph, aten.view.default, grad, [out, -1])
            operands = _transposed_operands(graph, grad)
            if site.slot in factor_slots and operands is not None and _factors_pay(*operands):
                call(graph, torch.ops.zenflow.stage_factors.default, *operands, site.slot)
            else:
                rows = _rows_in_column_order(graph, grad, operands, site.slot)
                call(graph, torch.ops.zenflow.stage_columns.default, rows, site.slot)
        outputs[site.output_index] = None
    set_output_values(graph, outputs)
