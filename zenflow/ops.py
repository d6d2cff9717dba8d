"""The custom ops zenflow's passes insert into backward graphs: schemas and fake kernels.

Each op names a weight by its registry slot (an int), so graphs stay free of Python objects.
``stage_columns``, ``stage_factors`` and ``record_importance`` exist for their side effect (handing data to the
runtime), so they are registered with ``torch.fx.node.has_side_effect``: without it FX and
Inductor would delete them as dead code.
"""

import torch

from zenflow.runtime import registry


@torch.library.custom_op("zenflow::column_order", mutates_args=())
def column_order(columns_by_out: torch.Tensor, slot: int) -> torch.Tensor:
    """The weight's column order: selected columns first, then the unselected ones.

    ``columns_by_out`` is a tensor whose first dimension runs over the weight's columns (the
    transposed gradient, or the activation it is computed from); only that size and its device
    are used, so that the number of columns may be symbolic. The order is returned as a copy because a
    compiled graph may reuse the storage of an op's output once it is dead, and this tensor
    belongs to the runtime.
    """
    return registry.owner(slot).column_order().to(device=columns_by_out.device, copy=True)


@column_order.register_fake
def _(columns_by_out: torch.Tensor, slot: int) -> torch.Tensor:
    return columns_by_out.new_empty(columns_by_out.shape[0], dtype=torch.int64)


@torch.library.custom_op("zenflow::stage_columns", mutates_args=())
def stage_columns(rows: torch.Tensor, slot: int) -> None:
    """Hand the weight's gradient, as ``[columns, out]`` rows in column order, to the runtime."""
    registry.owner(slot).stage(rows)


@stage_columns.register_fake
def _(rows: torch.Tensor, slot: int) -> None:
    return None


@torch.library.custom_op("zenflow::stage_factors", mutates_args=())
def stage_factors(columns_by_batch: torch.Tensor, out_grad: torch.Tensor, slot: int) -> None:
    """Hand the weight's gradient to the runtime as its two factors, ``G.T == columns_by_batch
    @ out_grad`` (``[columns, batch]`` and ``[batch, out]``), for a batch much smaller than the
    weight: the runtime multiplies them when it commits the step."""
    registry.owner(slot).stage_factors(columns_by_batch, out_grad)


@stage_factors.register_fake
def _(columns_by_batch: torch.Tensor, out_grad: torch.Tensor, slot: int) -> None:
    return None


@torch.library.custom_op("zenflow::record_importance", mutates_args=())
def record_importance(scores: torch.Tensor, slot: int) -> None:
    """Hand the per-column squared L2 norms (in column order) to the runtime."""
    registry.owner(slot).record_importance(scores)


@record_importance.register_fake
def _(scores: torch.Tensor, slot: int) -> None:
    return None


torch.fx.node.has_side_effect(torch.ops.zenflow.stage_columns.default)
torch.fx.node.has_side_effect(torch.ops.zenflow.stage_factors.default)
torch.fx.node.has_side_effect(torch.ops.zenflow.record_importance.default)
