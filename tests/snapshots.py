"""Every tensor of a (nested) state, cloned, and a bitwise comparison of two such snapshots."""

import torch


def snapshot(state) -> list[torch.Tensor]:
    """Every tensor of a (nested) state dict, cloned, in a fixed order."""
    if isinstance(state, torch.Tensor):
        return [state.detach().clone()]
    if isinstance(state, dict):
        state = list(state.values())
    if isinstance(state, (list, tuple)):
        return [t for item in state for t in snapshot(item)]
    return []


def assert_bitwise_equal(before: list[torch.Tensor], after: list[torch.Tensor]) -> None:
    assert len(before) == len(after)
    for i, (a, b) in enumerate(zip(before, after, strict=True)):
        # Bitwise, NaN-safe: compare the raw bytes.
        assert a.dtype == b.dtype and a.shape == b.shape, i
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), i
