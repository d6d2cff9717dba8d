"""zenflow's side-effect ops must survive Inductor (dead-code elimination, reordering)."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing import assert_close

import zenflow.ops  # noqa: F401
from zenflow.runtime import registry


class RecordingOwner:
    def __init__(self, columns: int):
        self.order = torch.arange(columns).flip(0)
        self.calls = []

    def column_order(self):
        self.calls.append(("column_order", None))
        return self.order

    def stage(self, rows):
        self.calls.append(("stage", rows.clone()))

    def record_importance(self, scores):
        self.calls.append(("record_importance", scores.clone()))


def hand_off(grad: torch.Tensor, slot: int) -> torch.Tensor:
    """What the passes insert for one weight; only an unrelated value is returned, so nothing
    but the ops' side effects keeps them alive."""
    columns_by_out = grad.permute(1, 0)
    order = torch.ops.zenflow.column_order(columns_by_out, slot)
    rows = columns_by_out[order]
    torch.ops.zenflow.stage_columns(rows, slot)
    torch.ops.zenflow.record_importance((rows * rows).sum(1), slot)
    return grad.sum()


def test_side_effect_ops_run_in_order_under_inductor():
    grad = torch.randn(5, 4)
    owner = RecordingOwner(4)
    param = torch.nn.Parameter(torch.empty(5, 4))
    slot = registry.register(param, owner)
    gm = make_fx(lambda g: hand_off(g, slot), tracing_mode="fake")(grad)
    compiled = torch._inductor.compile(gm, [grad])
    assert owner.calls == []
    out = compiled(grad)
    assert_close(out[0] if isinstance(out, (tuple, list)) else out, grad.sum())
    names = [name for name, _ in owner.calls]
    assert sorted(names) == ["column_order", "record_importance", "stage"]
    assert names.index("column_order") < names.index("stage")
    rows = dict(owner.calls)["stage"]
    assert_close(rows, grad.t()[owner.order])
    assert_close(dict(owner.calls)["record_importance"], (grad * grad).sum(0).flip(0))


def test_a_dead_optimizer_slot_is_a_clear_error():
    param = torch.nn.Parameter(torch.empty(2, 2))
    slot = registry.register(param, RecordingOwner(2))  # the owner is dropped at once
    with pytest.raises(RuntimeError, match="no live optimizer"):
        torch.ops.zenflow.column_order(torch.empty(2, 2), slot)


def test_one_parameter_cannot_have_two_owners():
    param = torch.nn.Parameter(torch.empty(2, 2))
    owner = RecordingOwner(2)
    registry.register(param, owner)
    with pytest.raises(ValueError, match="already owned"):
        registry.register(param, RecordingOwner(2))
