"""Applying a reselection's row moves (``zenflow.runtime.layout.Migration``) to tensors.

Each pair is one quantity kept per column in two places: ``host``, this rank's block in local
order (changed in place), and ``device``, the selected columns' rows (replaced: the result
holds the new device rows). A pair's two tensors may differ in dtype (a 16-bit staged gradient
on the host beside its fp32 rows on the device): rows convert as they cross.
"""

import math

import torch

from zenflow.runtime.comm import DataParallel
from zenflow.runtime.host_sync import HostSync
from zenflow.runtime.layout import Migration
from zenflow.runtime.side_by_side import elements, views
from zenflow.runtime.streams import PendingCopy, copy_stream, sent_to


def move_rows(
    migration: Migration,
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
    comm: DataParallel,
    pin: bool,
) -> tuple[list[torch.Tensor], int, int]:
    """Move every pair's rows; returns the new device tensors and the bytes this rank moved
    (to the host, to the device). Waits for the leaving rows (counted by ``comm.sync``)."""
    # Gathered before the host rows move: the entering columns' rows in the old local order.
    transfer = EnteringRows(pairs[0][1].device, comm, pin)
    for host, device in pairs:
        transfer.add(migration, host, migration.entering_host_rows, device.dtype)
    entering = transfer.send()
    leaving = LeavingRows()
    places = [leaving.add(device, migration.leaving_device_rows, host) for host, device in pairs]
    leaving.send()
    move_host_rows(migration, [host for host, _ in pairs], leaving, places, comm.sync)
    new_devices = [
        place_device_rows(migration, device, rows)
        for (_, device), rows in zip(pairs, entering, strict=True)
    ]
    return new_devices, *moved_bytes(migration, [host for host, _ in pairs])


def moved_bytes(migration: Migration, hosts: list[torch.Tensor]) -> tuple[int, int]:
    """The bytes this rank moves for ``hosts``' rows (to the host, to the device)."""
    row_bytes = sum(host[0].numel() * host.element_size() for host in hosts if host.shape[0])
    return migration.rows_to_host * row_bytes, migration.rows_to_device * row_bytes


class EnteringRows:
    """The entering columns' rows of any number of tensors (every weight's state, and window
    sums, at one reselection), on their way to every rank's ``device``: gathered on the host
    straight into one buffer per dtype (pinned on a GPU machine: the copy runs at twice a
    pageable copy's bandwidth without holding the host thread), sent in one copy per dtype and,
    with several ranks, summed over ranks in one collective per dtype (each rank contributes
    the rows it owns, zeros for the others'). Owns what was queued until ``send``."""

    def __init__(self, device: torch.device, comm: DataParallel, pin: bool):
        self.device = torch.device(device)
        self.comm = comm
        self.pin = pin
        # (migration, host tensor, its rows to take, the dtype wanted on the device)
        self._queued: list[tuple[Migration, torch.Tensor, torch.Tensor, torch.dtype]] = []

    def add(
        self, migration: Migration, host: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
    ) -> int:
        """Queue the entering rows of ``host`` (this rank's are its rows ``positions``), wanted
        in ``dtype``; returns their place in what ``send`` returns. ``host`` is read at
        ``send``."""
        self._queued.append((migration, host, positions, dtype))
        return len(self._queued) - 1

    def send(self) -> list[torch.Tensor]:
        """Every queued tensor's entering rows, on the device, in the order queued."""
        sent: list[torch.Tensor | None] = [None] * len(self._queued)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, (_, host, positions, dtype) in enumerate(self._queued):
            if host.device.type != "cpu":  # a device-side staged sum (one rank): no crossing
                sent[i] = _in_dtype(_take(host, positions), dtype)
            else:
                by_dtype.setdefault(host.dtype, []).append(i)
        for host_dtype, members in by_dtype.items():
            shapes = [self._shape(i) for i in members]
            flat = torch.empty(elements(shapes), dtype=host_dtype, pin_memory=self.pin)
            for i, part in zip(members, views(flat, shapes), strict=True):
                self._gather(i, part)
            on_device = self.comm.all_reduce_sum_(flat.to(self.device, non_blocking=True))
            for i, part in zip(members, views(on_device, shapes), strict=True):
                sent[i] = _in_dtype(part, self._queued[i][3])
        self._queued = []
        return sent

    def _shape(self, i: int) -> tuple[int, ...]:
        migration, host, _, _ = self._queued[i]
        return (migration.entering.numel(), *host.shape[1:])

    def _gather(self, i: int, out: torch.Tensor) -> None:
        migration, host, positions, _ = self._queued[i]
        if out.numel() == 0:
            return
        if self.comm.world_size == 1:
            torch.index_select(host, 0, positions, out=out)
        else:
            out.zero_()
            out[migration.entering_owned] = _take(host, positions)


class LeavingRows:
    """The leaving columns' device rows of any number of tensors (every weight's state at one
    reselection), on their way to the host: taken on the device when queued (before the
    device rows are replaced), then one buffer per device and dtype copied on the copy
    stream, which nothing waits for until the rows are read (``landed``). Rows that are
    where their host tensor is cross nothing: a device-side staged sum's (the host tensor lives
    on the device), and offloaded state's (the device rows live on the host). Owns what was
    queued, then the copies in flight."""

    def __init__(self):
        self._queued: list[tuple[torch.Tensor, bool]] = []  # (rows, whether they cross)
        # Once sent, per place: the copy its rows are in, their offset there and their shape.
        self._landing: list[tuple[PendingCopy, int, torch.Size]] | None = None

    def add(
        self, device: torch.Tensor, index: torch.Tensor, host: torch.Tensor, on_host: bool = False
    ) -> int:
        """Queue rows ``index`` of ``device`` for ``host`` (in its dtype); returns their place
        for ``landed``. ``on_host``: ``device`` is host memory by configuration (offload), not
        a device's (on a CPU-only machine the two look alike, and only the latter is waited
        for, as on a GPU)."""
        crosses = host.device.type == "cpu" and not on_host
        self._queued.append((_in_dtype(_take(device, index), host.dtype), crosses))
        return len(self._queued) - 1

    def send(self) -> None:
        """Start every queued row for the host."""
        landing: list[tuple[PendingCopy, int, torch.Size] | None] = [None] * len(self._queued)
        by_kind: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, (rows, crosses) in enumerate(self._queued):
            if crosses:
                by_kind.setdefault((rows.device, rows.dtype), []).append(i)
            else:
                landing[i] = (PendingCopy(rows), 0, rows.shape)
        for (device, _), members in by_kind.items():
            parts = [self._queued[i][0] for i in members]
            flat = torch.cat([part.reshape(-1) for part in parts])
            if flat.numel() == 0:  # nothing leaves (the first selection): nothing to wait for
                copy = PendingCopy(torch.empty(0, dtype=flat.dtype))
            else:
                copy = copy_stream(device).copy_to_host(flat, owned=True)
            offset = 0
            for i, part in zip(members, parts, strict=True):
                landing[i] = (copy, offset, part.shape)
                offset += part.numel()
        self._landing = landing
        self._queued = []  # the device rows are in the copies now

    def landed(self, place: int, sync: HostSync) -> torch.Tensor:
        """The rows queued at ``place``, on the host once their copy is done (the first wait
        covers every copy issued before it)."""
        assert self._landing is not None, "leaving rows read before they were sent"
        copy, offset, shape = self._landing[place]
        return copy.wait(sync).view(-1)[offset : offset + math.prod(shape)].view(shape)


def move_host_rows(
    migration: Migration,
    hosts: list[torch.Tensor],
    leaving: LeavingRows,
    places: list[int],
    sync: HostSync,
) -> None:
    """The host rows' moves within this rank's block, then the leaving rows (``places`` of
    ``leaving``, sent) in their new host rows, once landed."""
    sources, destinations = migration.host_moves
    for host, place in zip(hosts, places, strict=True):
        if sources.numel():
            _put(host, destinations, _take(host, sources))
        if migration.leaving_host_rows.numel():
            _put(host, migration.leaving_host_rows, leaving.landed(place, sync))


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


# Row gathers and scatters as index_select / index_copy_: whole rows copied at once, several
# times faster on CPU than advanced indexing, which goes element by element. An empty index
# dispatches nothing: most weights' columns stay where they are at a reselection (the host
# rows move only where a block's number of selected columns changes), and each empty gather or
# scatter would still be a trip through the dispatcher, several per weight, on the host's time
# while a GPU waits.


def _take(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    if index.numel() == 0:
        return tensor.new_empty((0, *tensor.shape[1:]))
    return tensor.index_select(0, sent_to(index, tensor.device))


def _put(tensor: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    if index.numel() == 0:
        return
    if rows.device != tensor.device:
        rows = rows.to(tensor.device)
    tensor.index_copy_(0, sent_to(index, tensor.device), rows)


def _in_dtype(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``rows`` in ``dtype``: compared in Python first, since even a conversion to the dtype a
    tensor has is a dispatched call (several per weight at a select boundary, on the host's
    time while a GPU waits)."""
    return rows if rows.dtype == dtype else rows.to(dtype)
