"""Whether an optimizer keeps its windows' sums on the device: ``accumulate_on_device``.

With device-side sums only each window's sum crosses to the host (once per window) instead of
every step's unselected rows, and the CPU does one fused pass per window instead of adding
every step's rows. They cost device memory: an fp32 sum of every weight's unselected columns.
"auto" (the default) turns them on where that is cheap and possible, decided once, when the
optimizer takes its parameters:

* one rank (with several, the sums would need their own reduction);
* no ``offload`` (which asks to keep even the selected columns' state off the device);
* the weights on a GPU (on the CPU, host and device memory are the same: nothing to save);
* the sums take at most ``DEVICE_SUMS_SHARE`` of the device memory not yet allocated.
"""

from typing import NamedTuple

import torch

DEVICE_SUMS_SHARE = 0.25


class DeviceSums(NamedTuple):
    """The decision (``on``) and, for "auto", why (``reason``)."""

    on: bool
    reason: str


def sums_bytes(shapes: list[tuple[int, int]], k_of) -> int:
    """Bytes of the fp32 sums of every weight's unselected columns; ``shapes``: (out, columns)
    per weight, ``k_of(columns)``: its selected columns."""
    return sum(4 * out * (columns - k_of(columns)) for out, columns in shapes)


def device_sums_for(
    requested: bool | str,
    device: torch.device,
    world_size: int,
    needed_bytes: int,
    free_bytes: int | None = None,
    offload: bool = False,
) -> DeviceSums:
    """``requested`` True or False as given; "auto" by the rule above (the settings checked
    the value). ``free_bytes``: the device memory not yet allocated (asked of the device when
    None)."""
    if requested != "auto":
        return DeviceSums(requested is True, "set")
    if world_size > 1:
        return DeviceSums(False, f"auto: off with {world_size} ranks")
    if offload:
        return DeviceSums(False, "auto: off with offload")
    if device.type != "cuda":
        return DeviceSums(False, f"auto: off, the weights are on the {device.type}")
    if free_bytes is None:
        free_bytes, _ = torch.cuda.mem_get_info(device)
    fits = needed_bytes <= DEVICE_SUMS_SHARE * free_bytes
    return DeviceSums(
        fits,
        f"auto: {'on' if fits else 'off'}, the sums take {needed_bytes / 2**20:.0f} MiB of "
        f"{free_bytes / 2**20:.0f} MiB free on {device} (at most {DEVICE_SUMS_SHARE:.0%})",
    )
