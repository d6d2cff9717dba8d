"""The saved form of a ZenFlowAdamW's state (``zenflow.ZenFlowAdamW/2``), typed.

A state dict holds only tensors and plain values (numbers, strings, lists, dicts), so it loads
with ``torch.load(weights_only=True)``: a checkpoint someone else wrote cannot run code on load.
``WeightRecord`` is one weight's entry, as this rank saved it; ``reshard`` reads and writes the
same records.

Per weight: its layout (``order``, every rank's ``local_orders`` and ``k_locals``, ``k``), this
rank's host rows (fp32 master, moments, int64 steps, in local order) and the device rows (the
selected columns', the same on every rank), the open window's sum of this rank's unselected
rows (``accumulator``; None before the first window) and the steps kept as factors
(``window_factors``: ``(x, dy)`` pairs), whether a step joined the window (``in_window``) and
whether an overlapped update of the weight was in flight (``pending``: it lands at the next
window boundary after a load, as without one).
"""

from dataclasses import dataclass, fields

import torch

FORMAT = "zenflow.ZenFlowAdamW/2"


@dataclass
class WeightRecord:
    order: torch.Tensor
    local_orders: list[torch.Tensor]
    k: int
    k_locals: list[int]
    host: list[torch.Tensor]  # master, exp_avg, exp_avg_sq, steps
    device: list[torch.Tensor]
    accumulator: torch.Tensor | None
    window_factors: list[tuple[torch.Tensor, torch.Tensor]]
    in_window: bool
    pending: bool

    @classmethod
    def from_dict(cls, saved: dict) -> "WeightRecord":
        names = [field.name for field in fields(cls)]
        missing = [name for name in names if name not in saved]
        if missing:
            raise ValueError(f"a saved weight lacks {missing}: not a {FORMAT} state dict")
        return cls(**{name: saved[name] for name in names})

    def to_dict(self) -> dict:
        return {field.name: getattr(self, field.name) for field in fields(self)}

    @property
    def host_shape(self) -> tuple[int, ...]:
        return tuple(self.host[0].shape)


# The top-level keys of a state dict, besides "format" and the weights' and vectors' lists.
TOP_LEVEL = (
    "world_size",
    "rank",
    "settings",
    "param_groups",
    "committed_steps",
    "window_steps",
    "counters",
    "auto_interval",
)


def check_format(state) -> None:
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"not a {FORMAT} state dict (found {found!r})")
    missing = [name for name in (*TOP_LEVEL, "weights", "vectors") if name not in state]
    if missing:
        raise ValueError(f"{FORMAT} state dict lacks {missing}")
