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

An embedding table's gradient goes over as its looked-up rows (``stage_lookup``), and a tied
table's (an LM head that is also the embedding) as its matmul's factors plus those rows
(``stage_matmul_lookup``): the runtime adds each row into its column of G.T instead of
transposing a dense ``[vocab, width]`` gradient. The lookup is recognized as traced
(``embedding_dense_backward``) or as Inductor's decompositions leave it (a masked accumulate
into zeros; a masked-out token gets a zero row)::

    t_7 = aten.permute(mm_3, [1, 0])        x_t = aten.permute(view_12, [1, 0])
    lookup = aten.embedding_dense_backward( rows = aten.reshape(dx, [-1, width])
        dx, tokens, vocab, -1, False)       ids = aten.reshape(tokens, [-1])
    add_1 = aten.add(t_7, lookup)           zenflow.stage_matmul_lookup(x_t, dlogits, rows,
                                                                        ids, slot)
    return (add_1, ...)                     return (None, ...)

Any other gradient (a conv's) goes over as ``G.T`` (``stage_columns``) for the runtime to gather
its rows from: a view, or for a sum the sum of its terms' transposes.

Each op goes right after the gradient it replaces, where the original computed it: its inputs
can be freed as early as before, and on a GPU the copy to the host starts while the rest of
backward runs.
"""

import torch

import zenflow.compile.ops  # noqa: F401  (registers torch.ops.zenflow)
from zenflow.compile.passes.graph_edit import call, output_values, set_output_values
from zenflow.compile.passes.locate_grads import GradSite

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
    """G.T: the graph's own transpose where G is one; for a sum nothing else reads, the sum of
    its terms' transposes (a term that is a transposed matmul is then used as computed, and the
    compiler writes the sum in G.T's layout); else a view."""
    if _is_transpose(grad):
        return grad.args[0]
    if _is_plain_sum(grad):
        return call(graph, aten.add.Tensor, *(_transposed(graph, term) for term in grad.args))
    return call(graph, aten.permute.default, grad, [1, 0])


def _is_lookup(node: torch.fx.Node) -> bool:
    """An embedding table's gradient: ``aten.embedding_dense_backward`` as traced (without
    frequency scaling), or the masked accumulate into zeros Inductor's decompositions make of
    it."""
    if node.target is aten.embedding_dense_backward.default:
        return not node.args[4]  # scale_grad_by_freq
    if node.target is not aten._unsafe_masked_index_put_accumulate.default:
        return False
    base, mask, indices, values = node.args
    return (
        isinstance(base, torch.fx.Node)
        and base.target is aten.full.default
        and base.args[1] == 0
        and len(indices) == 1
        and node.meta["val"].dim() == 2
        and values.meta["val"].dim() == indices[0].meta["val"].dim() + 1
        and mask.meta["val"].numel() == indices[0].meta["val"].numel()
    )


def _lookup_rows(graph: torch.fx.Graph, lookup: torch.fx.Node) -> tuple[torch.fx.Node, ...]:
    """An embedding gradient (``_is_lookup``) as ``(rows, ids)``: row ``t`` is the gradient of
    table row ``ids[t]``; a masked-out token (the padding index) has a zero row and id 0."""
    width = lookup.meta["val"].shape[1]
    if lookup.target is aten.embedding_dense_backward.default:
        values, ids, _, padding_idx, _ = lookup.args
        mask = None if padding_idx == -1 else call(graph, aten.ne.Scalar, ids, padding_idx)
    else:
        _, mask, (ids,), values = lookup.args
    rows = call(graph, aten.reshape.default, values, [-1, width])
    ids = call(graph, aten.reshape.default, ids, [-1])
    if mask is None:
        return rows, ids
    keep = call(graph, aten.reshape.default, mask, [-1])
    keep_rows = call(graph, aten.unsqueeze.default, keep, 1)
    return (
        call(graph, aten.mul.Tensor, rows, keep_rows),
        call(graph, aten.mul.Tensor, ids, keep),
    )


def _matmul_plus_lookup(graph: torch.fx.Graph, grad: torch.fx.Node):
    """For a weight that is both a matmul operand and an embedding table (a tied LM head), G =
    matmul + lookup: ``(a, b, rows, ids)`` with ``G.T == a @ b`` plus each looked-up row's
    gradient ``rows[t]`` in column ``ids[t]``; else None."""
    if not (_is_plain_sum(grad) and len(grad.args) == 2):
        return None
    matmul, lookup = grad.args if _is_lookup(grad.args[1]) else grad.args[::-1]
    if not _is_lookup(lookup):
        return None
    operands = _transposed_operands(graph, matmul)
    if operands is None:
        return None
    return (*operands, *_lookup_rows(graph, lookup))


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
        with graph.inserting_before(grad.next):
            if value.dim() > 2:
                if not value.is_contiguous():
                    grad = call(graph, aten.clone.default, grad)
                out = value.shape[0]
                if isinstance(out, torch.SymInt):
                    out = call(graph, aten.sym_size.int, grad, 0)
                grad = call(graph, aten.view.default, grad, [out, -1])
            operands = _transposed_operands(graph, grad)
            lookup = operands is None and _is_lookup(grad)
            tied = None if operands or lookup else _matmul_plus_lookup(graph, grad)
            if operands is not None:
                call(graph, torch.ops.zenflow.stage_matmul.default, *operands, site.slot)
            elif lookup:
                rows = _lookup_rows(graph, grad)
                call(graph, torch.ops.zenflow.stage_lookup.default, *rows, site.slot)
            elif tied is not None:
                call(graph, torch.ops.zenflow.stage_matmul_lookup.default, *tied, site.slot)
            else:
                call(
                    graph,
                    torch.ops.zenflow.stage_columns.default,
                    _transposed(graph, grad),
                    site.slot,
                )
        outputs[site.output_index] = None
    set_output_values(graph, outputs)
