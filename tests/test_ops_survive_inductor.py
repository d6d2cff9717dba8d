"""zenflow's side-effect ops must survive Inductor (dead-code elimination, reordering)."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing import assert_close

import zenflow.compile.ops  # noqa: F401
from zenflow.runtime import registry


class RecordingOwner:
    def __init__(self):
        self.calls = []

    def stage_matmul(self, columns_by_batch, out_grad):
        self.calls.append(("stage_matmul", columns_by_batch @ out_grad))

    def stage_columns(self, columns_by_out):
        self.calls.append(("stage_columns", columns_by_out.clone()))


def hand_off(x: torch.Tensor, dy: torch.Tensor, slot: int) -> torch.Tensor:
    """What the pass inserts for two weights; only an unrelated value is returned, so nothing
    but the ops' side effects keeps them alive."""
    torch.ops.zenflow.stage_matmul(x.t(), dy, slot)
    torch.ops.zenflow.stage_columns((dy.t() @ x).t(), slot)
    return x.sum()


def test_side_effect_ops_run_in_order_under_inductor():
    x, dy = torch.randn(3, 4), torch.randn(3, 5)
    owner = RecordingOwner()
    param = torch.nn.Parameter(torch.empty(5, 4))
    slot = registry.register(param, owner)
    gm = make_fx(lambda a, b: hand_off(a, b, slot), tracing_mode="fake")(x, dy)
    compiled = torch._inductor.compile(gm, [x, dy])
    assert owner.calls == []
    out = compiled(x, dy)
    assert_close(out[0] if isinstance(out, (tuple, list)) else out, x.sum())
    assert [name for name, _ in owner.calls] == ["stage_matmul", "stage_columns"]
    for _, grad_t in owner.calls:
        assert_close(grad_t, x.t() @ dy)


def test_a_dead_optimizer_slot_is_a_clear_error():
    param = torch.nn.Parameter(torch.empty(2, 2))
    slot = registry.register(param, RecordingOwner())  # the owner is dropped at once
    with pytest.raises(RuntimeError, match="no live optimizer"):
        torch.ops.zenflow.stage_columns(torch.empty(2, 2), slot)


def test_one_parameter_cannot_have_two_owners():
    param = torch.nn.Parameter(torch.empty(2, 2))
    owner = RecordingOwner()
    registry.register(param, owner)
    with pytest.raises(ValueError, match="already owned"):
        registry.register(param, RecordingOwner())
