"""Applying a reselection's row moves (``zenflow.runtime.layout.Migration``) to tensors.

Each pair is one quantity kept per column in two places: ``host``, this rank's block in local
order (changed in place), and ``device``, the selected columns' rows (replaced: the result
holds the new device rows). A pair's two tensors may differ in dtype (a 16-bit staged gradient
on the host beside its fp32 rows on the device): rows convert as they cross.
"""

import torch

from zenflow.runtime.comm import DataParallel
from zenflow.runtime.layout import Migration


def move_rows(
    migration: Migration,
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
    comm: DataParallel,
    pin: bool,
) -> tuple[list[torch.Tensor], int, int]:
    """Move every pair's rows; returns the new device tensors and the bytes this rank moved
    (to the host, to the device)."""
    # Gathered before the host rows move: the entering columns' rows in the old local order.
    entering = [_entering_rows(migration, host, device, comm, pin) for host, device in pairs]
    new_devices, to_host, to_device = [], 0, 0
    for (host, device), rows in zip(pairs, entering, strict=True):
        sources, destinations = migration.host_moves
        _put(host, destinations, _take(host, sources))
        leaving = _on_host(_take(device, migration.leaving_device_rows).to(host.dtype), pin)
        _put(host, migration.leaving_host_rows, leaving)
        new_devices.append(_device_rows(migration, device, rows))
        row_bytes = host[0].numel() * host.element_size() if host.shape[0] else 0
        to_host += migration.rows_to_host * row_bytes
        to_device += migration.rows_to_device * row_bytes
    return new_devices, to_host, to_device


def _entering_rows(migration, host, device, comm: DataParallel, pin: bool) -> torch.Tensor:
    """The entering columns' rows, from their owners' host rows, on every rank's device."""
    shape = (migration.entering.numel(), *host.shape[1:])
    # Through pinned memory on a GPU machine: the copy to the device runs at twice a pageable
    # copy's bandwidth, without holding the host thread.
    if comm.world_size == 1 and host.device.type != "cpu":  # a device-side staged sum
        rows = _take(host, migration.entering_host_rows)
    elif comm.world_size == 1:
        rows = torch.empty(shape, dtype=host.dtype, pin_memory=pin)
        torch.index_select(host, 0, migration.entering_host_rows, out=rows)
    else:
        rows = torch.zeros(shape, dtype=host.dtype, pin_memory=pin)
        rows[migration.entering_owned] = _take(host, migration.entering_host_rows)
    rows = comm.all_reduce_sum_(rows.to(device.device, non_blocking=True))
    return rows.to(device.device, device.dtype)


def _device_rows(migration: Migration, device: torch.Tensor, entering: torch.Tensor):
    if migration.device_kept is None:
        _put(device, migration.entering_device_rows, entering)
        return device
    old_rows, new_rows = migration.device_kept
    placed = device.new_empty(migration.layout.k, *device.shape[1:])
    _put(placed, new_rows, _take(device, old_rows))
    _put(placed, migration.entering_device_rows, entering)
    return placed


def _on_host(rows: torch.Tensor, pin: bool) -> torch.Tensor:
    """``rows`` on the host; from a GPU through pinned memory."""
    if rows.device.type == "cpu":
        return rows
    landed = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=pin)
    return landed.copy_(rows)


# Row gathers and scatters as index_select / index_copy_: whole rows copied at once, several
# times faster on CPU than advanced indexing, which goes element by element.


def _take(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return tensor.index_select(0, index.to(tensor.device))


def _put(tensor: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    tensor.index_copy_(0, index.to(tensor.device), rows.to(tensor.device))
