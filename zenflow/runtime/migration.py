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
    entering = [
        entering_rows(
            migration, host, migration.entering_host_rows, device.device, device.dtype, comm, pin
        )
        for host, device in pairs
    ]
    leaving = leaving_rows(migration, pairs, pin)
    move_host_rows(migration, [host for host, _ in pairs], leaving)
    new_devices = [
        place_device_rows(migration, device, rows)
        for (_, device), rows in zip(pairs, entering, strict=True)
    ]
    return new_devices, *moved_bytes(migration, [host for host, _ in pairs])


def moved_bytes(migration: Migration, hosts: list[torch.Tensor]) -> tuple[int, int]:
    """The bytes this rank moves for ``hosts``' rows (to the host, to the device)."""
    row_bytes = sum(host[0].numel() * host.element_size() for host in hosts if host.shape[0])
    return migration.rows_to_host * row_bytes, migration.rows_to_device * row_bytes


def entering_rows(
    migration: Migration,
    host: torch.Tensor,
    positions: torch.Tensor,
    device: torch.device,
    dtype: torch.dtype,
    comm: DataParallel,
    pin: bool,
) -> torch.Tensor:
    """The entering columns' rows, from their owners' rows ``positions`` of ``host``, on every
    rank's ``device``, in ``dtype``."""
    shape = (migration.entering.numel(), *host.shape[1:])
    # Through pinned memory on a GPU machine: the copy to the device runs at twice a pageable
    # copy's bandwidth, without holding the host thread.
    if comm.world_size == 1 and host.device.type != "cpu":  # a device-side staged sum
        rows = _take(host, positions)
    elif comm.world_size == 1:
        rows = torch.empty(shape, dtype=host.dtype, pin_memory=pin)
        torch.index_select(host, 0, positions, out=rows)
    else:
        rows = torch.zeros(shape, dtype=host.dtype, pin_memory=pin)
        rows[migration.entering_owned] = _take(host, positions)
    rows = comm.all_reduce_sum_(rows.to(device, non_blocking=True))
    return rows.to(device, dtype)


def leaving_rows(
    migration: Migration, pairs: list[tuple[torch.Tensor, torch.Tensor]], pin: bool
) -> list[torch.Tensor]:
    """The leaving columns' device rows this rank owns, on the host in each host dtype."""
    return [
        _on_host(_take(device, migration.leaving_device_rows).to(host.dtype), pin)
        for host, device in pairs
    ]


def move_host_rows(
    migration: Migration, hosts: list[torch.Tensor], leaving: list[torch.Tensor]
) -> None:
    """The host rows' moves within this rank's block, then the leaving rows in their new
    host rows."""
    sources, destinations = migration.host_moves
    for host, rows in zip(hosts, leaving, strict=True):
        _put(host, destinations, _take(host, sources))
        _put(host, migration.leaving_host_rows, rows)


def place_device_rows(migration: Migration, device: torch.Tensor, entering: torch.Tensor):
    """The new selection's device rows: ``device``'s, with the ``entering`` rows in place of
    the leaving ones."""
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
