"""Pass 2: hand each owned weight's gradient to the runtime as rows in column order.

For a weight gradient G of shape [out, *rest] (viewed as [out, columns]), the runtime's column
order puts the selected columns first. The pass gathers G's columns in that order as rows of a
``[columns, out]`` matrix (each column contiguous, the layout of the host buffers) and stages
them; the order is data fetched at run time, so a reselection needs no recompile. The weight's
gradient output becomes None: no full-size ``.grad`` is ever stored::

    # before                                # after
    mm_2 = aten.mm(t_6, primals_3)          x_t = aten.permute(primals_3, [1, 0])
                                            dy = aten.permute(t_6, [1, 0])
                                            g_t = aten.mm(x_t, dy)   # G.T, row-major
                                            order = zenflow.column_order(g_t, slot)
                                            rows = aten.index(g_t, [order])
                                            zenflow.stage_columns(rows, slot)
    return (mm_2, ...)                      return (None, ...)
"""

import torch

import zenflow.ops  # noqa: F401  (registers torch.ops.zenflow)
from zenflow.passes.graph_edit import call, output_values, set_output_values
from zenflow.passes.locate_grads import GradSite

aten = torch.ops.aten


def _is_transpose(node: torch.fx.Node) -> bool:
    return node.target is aten.t.default or (
        node.target is aten.permute.default and list(node.args[1]) == [1, 0]
    )


def _single_use_matmul(node: torch.fx.Node) -> bool:
    return node.target is aten.mm.default and len(node.users) == 1


def _transposed_matmul(graph: torch.fx.Graph, product: torch.fx.Node) -> torch.fx.Node:
    """``(A @ B).T`` as ``B.T @ A.T``: the same values, laid out row by row."""
    a, b = product.args
    b_t = call(graph, aten.permute.default, b, [1, 0])
    a_t = call(graph, aten.permute.default, a, [1, 0])
    return call(graph, aten.mm.default, b_t, a_t)


def _transposed(graph: torch.fx.Graph, matrix: torch.fx.Node) -> torch.fx.Node:
    """``matrix.T`` with contiguous rows where that costs nothing: when the gradient is a
    matmul nothing else reads, the transposed product is computed instead of the product, so
    gathering columns reads rows, not a strided view. Otherwise the graph's own transpose is
    reused, or a view is taken."""
    if _is_transpose(matrix):
        transposed = matrix.args[0]
        if _is_transpose(transposed) and _single_use_matmul(transposed.args[0]):
            return _transposed_matmul(graph, transposed.args[0])
        return transposed
    if _single_use_matmul(matrix):
        return _transposed_matmul(graph, matrix)
    return call(graph, aten.permute.default, matrix, [1, 0])


def split_columns(graph: torch.fx.Graph, sites: list[GradSite]) -> None:
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
            transposed = _transposed(graph, grad)
            order = call(graph, torch.ops.zenflow.column_order.default, transposed, site.slot)
            rows = call(graph, aten.index.Tensor, transposed, [order])
            call(graph, torch.ops.zenflow.stage_columns.default, rows, site.slot)
        outputs[site.output_index] = None
    set_output_values(graph, outputs)
