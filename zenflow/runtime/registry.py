"""Which runtime object owns which parameter, by integer slot.

Compiled graphs cannot hold Python objects, so the custom ops in ``zenflow.compile.ops`` carry a slot
number; the optimizer registers each weight it owns here and the backend looks parameters up
by identity when it compiles.
"""

import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

# Keyed by identity: tensors compare elementwise, so a plain WeakKeyDictionary cannot hold them.
_slot_of = WeakIdKeyDictionary()
_owner_of_slot: "dict[int, weakref.ref]" = {}
_next_slot = 0


def register(param: torch.Tensor, owner) -> int:
    """Give ``owner`` (an object with ``stage_matmul()`` and ``stage_columns()``) a slot for
    ``param``."""
    global _next_slot
    if param in _slot_of and _owner_of_slot[_slot_of[param]]() is not None:
        raise ValueError(
            f"parameter of shape {tuple(param.shape)} is already owned by another zenflow "
            "optimizer; give each parameter to one ZenFlowAdamW"
        )
    slot = _next_slot
    _next_slot += 1
    _slot_of[param] = slot
    _owner_of_slot[slot] = weakref.ref(owner)
    return slot


def slot_of(param: torch.Tensor) -> int | None:
    slot = _slot_of.get(param)
    if slot is None or _owner_of_slot[slot]() is None:
        return None
    return slot


def owner(slot: int):
    found = _owner_of_slot.get(slot)
    found = found() if found is not None else None
    if found is None:
        raise RuntimeError(
            f"zenflow slot {slot} has no live optimizer: the ZenFlowAdamW that owned this "
            "parameter was deleted; create a new one and recompile (torch._dynamo.reset())"
        )
    return found
