"""The custom ops zenflow's passes insert into backward graphs: schemas and fake kernels.

Each op hands one weight's gradient to the runtime that owns it, named by its registry slot (an
int), so graphs stay free of Python objects. The runtime forms the gradient's rows in its own
column order, straight into the buffers that keep them, and takes per-column importance when
the step needs it: the graph itself never forms a full-size gradient it would then copy. The
ops exist for their side effect, so they are registered with ``torch.fx.node.has_side_effect``:
without it FX and Inductor would delete them as dead code.
"""

import torch

from zenflow.runtime import registry


@torch.library.custom_op("zenflow::stage_matmul", mutates_args=())
def stage_matmul(columns_by_batch: torch.Tensor, out_grad: torch.Tensor, slot: int) -> None:
    """Hand the weight's gradient to the runtime as a matmul's factors, ``G.T ==
    columns_by_batch @ out_grad`` (``[columns, batch]`` and ``[batch, out]``): the runtime
    forms the product's rows in its column order, or, for a batch much smaller than the
    weight, keeps the factors and multiplies them once the step's checks are done."""
    registry.owner(slot).stage_matmul(columns_by_batch, out_grad)


@torch.library.custom_op("zenflow::stage_matmul_lookup", mutates_args=())
def stage_matmul_lookup(
    columns_by_batch: torch.Tensor,
    out_grad: torch.Tensor,
    lookup_rows: torch.Tensor,
    lookup_ids: torch.Tensor,
    slot: int,
) -> None:
    """Hand over the gradient of a weight that is both a matmul operand and an embedding table
    (a tied LM head): ``G.T == columns_by_batch @ out_grad`` plus, for each looked-up token
    ``t``, ``lookup_rows[t]`` (``[tokens, columns]``) added into column ``lookup_ids[t]`` of
    ``G.T``."""
    registry.owner(slot).stage_matmul(columns_by_batch, out_grad, (lookup_rows, lookup_ids))


@torch.library.custom_op("zenflow::stage_lookup", mutates_args=())
def stage_lookup(lookup_rows: torch.Tensor, lookup_ids: torch.Tensor, slot: int) -> None:
    """Hand over an embedding table's gradient: zero but for each looked-up token ``t``,
    ``lookup_rows[t]`` (``[tokens, columns]``) added into column ``lookup_ids[t]`` of ``G.T``."""
    registry.owner(slot).stage_lookup(lookup_rows, lookup_ids)


@torch.library.custom_op("zenflow::stage_columns", mutates_args=())
def stage_columns(columns_by_out: torch.Tensor, slot: int) -> None:
    """Hand the weight's gradient to the runtime as ``G.T`` (``[columns, out]``, row ``j`` is
    column ``j``, any strides): the runtime gathers its rows in its column order."""
    registry.owner(slot).stage_columns(columns_by_out)


def _hands_over_only(*args) -> None:
    """The ops' fake kernel: they return nothing; their effect is on the runtime."""
    return None


for _op in (stage_matmul, stage_matmul_lookup, stage_lookup, stage_columns):
    _op.register_fake(_hands_over_only)

torch.fx.node.has_side_effect(torch.ops.zenflow.stage_matmul.default)
torch.fx.node.has_side_effect(torch.ops.zenflow.stage_matmul_lookup.default)
torch.fx.node.has_side_effect(torch.ops.zenflow.stage_lookup.default)
torch.fx.node.has_side_effect(torch.ops.zenflow.stage_columns.default)
