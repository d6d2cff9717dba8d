"""The saved form of a ZenFlowAdamW's state (``zenflow.ZenFlowAdamW/4``), typed.

A state dict holds only tensors, plain values (numbers, strings, lists, dicts) and one class of
this module allowlisted for ``torch.load(weights_only=True)`` (``HostResident``): a checkpoint
someone else wrote cannot run code on load.

The weights' entries sit in a ``HostResident``: Accelerate (and so Hugging Face Trainer) moves
an optimizer's state dict to the accelerator and loads it back when it wraps the optimizer, a
recursive ``.to(device)`` over dicts, lists and tensors that leaves other objects alone. The
host state is what offloading keeps off the device (fp32 masters and moments, three times the
model): moved there, it would not fit.

Format 4 is format 3 under the select-boundary rule of docs/algorithm.md: a selection is made
after a select boundary's step is committed, and an overlapped update submitted there may
still be pending. Formats 3 and 2 (3 with the weights' list bare) load under that rule too:
they were written when a select boundary applied everything, so their pending update never
spans a reselection, and the selection they hold stays in effect until the next select
boundary (where format 3's runs chose again at the first step of the next interval).
``WeightRecord`` is one weight's entry, as this rank saved it; ``reshard`` reads and writes the
same records.

Per weight: its layout (``order``, every rank's ``local_orders`` and ``k_locals``, ``k``), this
rank's host rows (fp32 master, moments, int64 steps, in local order) and the device rows (the
selected columns', the same on every rank), the open window's sum of this rank's unselected
rows (``accumulator``; None before the first window) and the steps kept as factors
(``window_factors``: ``(x, dy)`` pairs), whether a step joined the window (``in_window``) and
whether an overlapped update of the weight was in flight (``pending``: it lands at the next
window boundary after a load, as without one). The pending update's column set is the saved
layout's unselected columns: the host rows are saved after the update is done with them and
moved to that layout, and the columns that left the selection at the boundary it was
submitted at hold there the values their parameter columns already have.
"""

from dataclasses import dataclass, fields

import torch

FORMAT = "zenflow.ZenFlowAdamW/4"
_READABLE = (FORMAT, "zenflow.ZenFlowAdamW/3", "zenflow.ZenFlowAdamW/2")


class HostResident:
    """A part of a state dict that stays where it is when the dict is moved to a device;
    owns nothing but ``value``."""

    def __init__(self, value):
        self.value = value

    def __repr__(self) -> str:
        return f"HostResident({self.value!r})"


torch.serialization.add_safe_globals([HostResident])


def saved_weights(state: dict) -> list[dict]:
    """The weights' entries of a state dict (held in a ``HostResident``, or bare)."""
    weights = state["weights"]
    return weights.value if isinstance(weights, HostResident) else weights


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
    if not isinstance(state, dict) or state.get("format") not in _READABLE:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"not a {FORMAT} state dict (found {found!r})")
    missing = [name for name in (*TOP_LEVEL, "weights", "vectors") if name not in state]
    if missing:
        raise ValueError(f"{FORMAT} state dict lacks {missing}")
