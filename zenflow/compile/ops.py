"""The custom ops zenflow's passes insert into backward graphs: schemas, kernels, fake kernels.

Each op hands one weight's gradient to the runtime that owns it, named by its registry slot (an
int), so graphs stay free of Python objects. The runtime forms the gradient's rows in its own
column order, straight into the buffers that keep them, and takes per-column importance when
the step needs it: the graph itself never forms a full-size gradient it would then copy. The
ops exist for their side effect, so they are registered with ``torch.fx.node.has_side_effect``:
without it FX and Inductor would delete them as dead code.

They are defined with ``torch.library.Library`` rather than ``torch.library.custom_op``: they
return nothing and never need autograd, and the higher-level wrapper (an autograd function,
alias checks, a dynamo-disabled frame) cost more host time per call than the rest of a small
weight's hand-over; a backward calls one per weight.
"""

import torch

from zenflow.runtime import registry

_LIBRARY = torch.library.Library("zenflow", "DEF")


def _define(schema: str, kernel) -> None:
    name = schema.split("(", 1)[0]
    _LIBRARY.define(schema)
    _LIBRARY.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"zenflow::{name}", _hands_over_only, lib=_LIBRARY)
    torch.fx.node.has_side_effect(getattr(torch.ops.zenflow, name).default)


def _hands_over_only(*args) -> None:
    """The ops' fake kernel: they return nothing; their effect is on the runtime."""
    return None


def stage_matmul(columns_by_batch: torch.Tensor, out_grad: torch.Tensor, slot: int) -> None:
    """Hand the weight's gradient to the runtime as a matmul's factors, ``G.T ==
    columns_by_batch @ out_grad`` (``[columns, batch]`` and ``[batch, out]``): the runtime
    forms the product's rows in its column order, or, for a batch much smaller than the
    weight, keeps the factors and multiplies them once the step's checks are done."""
    registry.owner(slot).stage_matmul(columns_by_batch, out_grad)


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


def stage_lookup(lookup_rows: torch.Tensor, lookup_ids: torch.Tensor, slot: int) -> None:
    """Hand over an embedding table's gradient: zero but for each looked-up token ``t``,
    ``lookup_rows[t]`` (``[tokens, columns]``) added into column ``lookup_ids[t]`` of ``G.T``."""
    registry.owner(slot).stage_lookup(lookup_rows, lookup_ids)


def stage_columns(columns_by_out: torch.Tensor, slot: int) -> None:
    """Hand the weight's gradient to the runtime as ``G.T`` (``[columns, out]``, row ``j`` is
    column ``j``, any strides): the runtime gathers its rows in its column order."""
    registry.owner(slot).stage_columns(columns_by_out)


_define("stage_matmul(Tensor columns_by_batch, Tensor out_grad, int slot) -> ()", stage_matmul)
_define(
    "stage_matmul_lookup(Tensor columns_by_batch, Tensor out_grad, Tensor lookup_rows, "
    "Tensor lookup_ids, int slot) -> ()",
    stage_matmul_lookup,
)
_define("stage_lookup(Tensor lookup_rows, Tensor lookup_ids, int slot) -> ()", stage_lookup)
_define("stage_columns(Tensor columns_by_out, int slot) -> ()", stage_columns)
