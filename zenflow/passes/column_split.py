"""Pass 2: hand each owned weight's gradient to the runtime instead of returning it.

The weight's gradient output becomes None (no full-size ``.grad`` is ever stored) and one op
per weight hands the gradient over. For a matmul gradient ``G = dY.T @ X`` (the usual case) the
op takes the two factors of ``G.T == X.T @ dY``: the runtime forms the product itself, its rows
(G's columns) in the runtime's column order, straight into the buffers that keep them, or keeps
the factors when the batch is much smaller than the weight. The order is runtime data, so a
reselection needs no recompile::

    # before                                # after
    mm_2 = aten.mm(t_6, primals_3)          x_t = aten.permute(primals_3, [1, 0])
                                            dy = aten.permute(t_6, [1, 0])
                                            zenflow.stage_matmul(x_t, dy, slot)
    return (mm_2, ...)                      return (None, ...)

Any other gradient (an embedding's, a sum of a matmul and a lookup for a tied weight) is handed
over as ``G.T`` for the runtime to gather its rows from, written in G.T's layout where that is
cheap (an embedding's lookup gradient is added into G.T's columns) and a view otherwise::

    t_7 = aten.permute(mm_3, [1, 0])        rows = aten.reshape(dx, [-1, width])
    lookup = aten.embedding_dense_backward( ids = aten.reshape(tokens, [-1])
        dx, tokens, vocab, -1, False)       rows_t = aten.permute(rows, [1, 0])
    add_1 = aten.add(t_7, lookup)           g_t = aten.index_add(mm_3, 1, ids, rows_t)
                                            zenflow.stage_columns(g_t, slot)
    return (add_1, ...)                     return (None, ...)
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


def _transposed(graph: torch.fx.Graph, grad: torch.fx.Node) -> torch.fx.Node:
    """G.T, written in its own layout where that is cheap: the graph's own transpose where G is
    one; an embedding lookup's gradient as the looked-up rows' gradients added into G.T's
    columns (``index_add``) rather than a dense ``[num, width]`` gradient transposed; a sum
    nothing else reads as the sum of its terms' transposes (a term that is a transposed matmul
    is then used as computed); else a view."""
    if _is_transpose(grad):
        return grad.args[0]
    if _is_lookup(grad):
        rows, width = grad.args[0], grad.meta["val"].shape[1]
        zeros = call(graph, aten.new_zeros.default, rows, [width, grad.args[2]])
        return _add_lookup_transposed(graph, zeros, grad)
    if not _is_plain_sum(grad):
        return call(graph, aten.permute.default, grad, [1, 0])
    lookups = [term for term in grad.args if _is_lookup(term)]
    others = [_transposed(graph, term) for term in grad.args if not _is_lookup(term)]
    if not others:
        return call(graph, aten.add.Tensor, *(_transposed(graph, term) for term in lookups))
    total = others[0] if len(others) == 1 else call(graph, aten.add.Tensor, *others)
    for lookup in lookups:
        total = _add_lookup_transposed(graph, total, lookup)
    return total


def _is_lookup(node: torch.fx.Node) -> bool:
    """An embedding's gradient without padding index or frequency scaling."""
    if node.target is not aten.embedding_dense_backward.default:
        return False
    _, _, _, padding_idx, scale_grad_by_freq = node.args
    return padding_idx == -1 and not scale_grad_by_freq


def _add_lookup_transposed(
    graph: torch.fx.Graph, columns_by_out: torch.fx.Node, lookup: torch.fx.Node
) -> torch.fx.Node:
    """``columns_by_out + lookup.T``: each looked-up row's gradient added into its column."""
    rows, indices = lookup.args[0], lookup.args[1]
    width = lookup.meta["val"].shape[1]
    flat_rows = call(graph, aten.reshape.default, rows, [-1, width])
    flat_indices = call(graph, aten.reshape.default, indices, [-1])
    by_width = call(graph, aten.permute.default, flat_rows, [1, 0])
    return call(graph, aten.index_add.default, columns_by_out, 1, flat_indices, by_width)


def _is_plain_sum(node: torch.fx.Node) -> bool:
    shape = node.meta["val"].shape
    return (
        node.target is aten.add.Tensor
        and not node.kwargs
        and len(node.users) == 1
        and all(
            isinstance(term, torch.fx.Node) and term.meta["val"].shape == shape
            for term in node.args
        )
    )


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
            operands = _transposed_operands(graph, grad)
            if operands is not None:
                call(graph, torch.ops.zenflow.stage_matmul.default, *operands, site.slot)
            else:
                call(
                    graph,
                    torch.ops.zenflow.stage_columns.default,
                    _transposed(graph, grad),
                    site.slot,
                )
        outputs[site.output_index] = None
    set_output_values(graph, outputs)
