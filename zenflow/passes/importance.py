"""Pass 3: per-column importance, computed from the rows each weight stages.

ZenFlow ranks columns by ``s_j = sum_i G[i, j]^2``. The rows a weight stages are its columns, so
the score is a row-wise sum of squares of the same tensor; Inductor fuses it into the kernel
that gathers the rows, so the gradient is read once for both. The scores also give the runtime
the global gradient norm (clipping) and a finite check (overflow) without another pass::

    # before                                # after
    rows = aten.index(g_t, [order])     rows = aten.index(g_t, [order])
    zenflow.stage_columns(rows, slot)       zenflow.stage_columns(rows, slot)
                                            rows_f32 = prims.convert_element_type(rows, f32)
                                            square = aten.mul(rows_f32, rows_f32)
                                            scores = aten.sum(square, [1])
                                            zenflow.record_importance(scores, slot)
"""

import torch

import zenflow.ops  # noqa: F401  (registers torch.ops.zenflow)
from zenflow.passes.graph_edit import call

aten = torch.ops.aten


def insert_importance(graph: torch.fx.Graph) -> None:
    stages = [n for n in graph.nodes if n.target is torch.ops.zenflow.stage_columns.default]
    for stage in stages:
        rows, slot = stage.args
        with graph.inserting_before(stage.next):
            if rows.meta["val"].dtype != torch.float32:
                rows = call(
                    graph, torch.ops.prims.convert_element_type.default, rows, torch.float32
                )
            square = call(graph, aten.mul.Tensor, rows, rows)
            scores = call(graph, aten.sum.dim_IntList, square, [1])
            call(graph, torch.ops.zenflow.record_importance.default, scores, slot)
