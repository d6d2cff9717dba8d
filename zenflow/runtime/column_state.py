"""One weight's AdamW state, per column: fp32 master value, first and second moments, and the
column's own step count (bias correction is per column).

Host rows: every column of this rank's block, in its local order (``zenflow.runtime.layout``;
the selected columns' rows are stale while their state is on the device), pinned on a GPU
machine. Device rows: the selected columns, in device row order, on the weight's device (on the
host with ``offload``: already where a leaving column's rows go, so they cross no stream and
nothing waits for them). A reselection moves the rows of the columns that change side and never
resets them.

At a select boundary with an overlapped CPU update, that update still runs over the host rows
in the old layout while the new selection is already in effect on the device: the host rows'
moves wait (``unsettled``) until the update is done with them (``settle``).
"""

import torch

from zenflow.columns import column_rows
from zenflow.runtime.host_sync import HostSync
from zenflow.runtime.layout import ColumnLayout, Migration
from zenflow.runtime.migration import (
    EnteringRows,
    LeavingRows,
    move_host_rows,
    moved_bytes,
    place_device_rows,
)


class ColumnState:
    """Owns the host rows (``host_master``, ``host_exp_avg``, ``host_exp_avg_sq``: ``[block
    rows, out]`` fp32; ``host_steps``: ``[block rows]`` int64) and the device rows
    (``device_*``: ``[k, out]`` fp32 and ``[k]`` int64 on ``device``: the parameter's, or the
    host's with ``offload``; views of the device update's blocks once it packed them), the host
    rows' moves a reselection left for later (``unsettled``: the migration and the leaving
    columns' rows on their way to the host, and their places there), and the views of the
    unselected host rows it hands a CPU update (``unselected()``); waits for the moves through
    the optimizer's ``sync``."""

    def __init__(
        self,
        param: torch.Tensor,
        layout: ColumnLayout,
        offload: bool,
        pin: bool,
        sync: HostSync,
    ):
        self.offload = offload
        self.device = torch.device("cpu") if offload else param.device
        self.pin = pin
        self.sync = sync
        out = param.shape[0]
        rows = layout.block_rows
        self.host_master = torch.empty(rows, out, pin_memory=pin)
        self.host_master.copy_(column_rows(param.detach())[layout.lo : layout.hi])
        self.host_exp_avg = torch.zeros(rows, out, pin_memory=pin)
        self.host_exp_avg_sq = torch.zeros(rows, out, pin_memory=pin)
        self.host_steps = torch.zeros(rows, dtype=torch.int64)
        self.device_master = torch.empty(0, out, device=self.device)
        self.device_exp_avg = torch.empty(0, out, device=self.device)
        self.device_exp_avg_sq = torch.empty(0, out, device=self.device)
        self.device_steps = torch.empty(0, dtype=torch.int64, device=self.device)
        self.unsettled: tuple[Migration, LeavingRows, list[int]] | None = None
        # unselected(): its k_local and its views (of the host rows: dropped where ``load``
        # replaces them).
        self._unselected: tuple[int, list[torch.Tensor]] | None = None

    def host(self) -> list[torch.Tensor]:
        return [self.host_master, self.host_exp_avg, self.host_exp_avg_sq, self.host_steps]

    def device_rows(self) -> list[torch.Tensor]:
        return [self.device_master, self.device_exp_avg, self.device_exp_avg_sq, self.device_steps]

    def gradient_shape(self) -> torch.Size:
        """The shape of the gradient rows the device update takes: the selected rows'."""
        return self.device_master.shape

    def bind_device_rows(self, rows: list[torch.Tensor]) -> None:
        """Take ``rows`` (the device rows' values, kept elsewhere: views of the device update's
        packed blocks, ``zenflow.runtime.packed_rows``) as the device rows."""
        self.device_master, self.device_exp_avg, self.device_exp_avg_sq, self.device_steps = rows

    def unselected(self, layout: ColumnLayout) -> list[torch.Tensor]:
        """Views of the host rows of this rank's unselected columns (what a CPU update steps:
        master, moments, steps), kept while the host rows and the layout's ``k_local`` are
        (four new views per weight at every window close would be Python objects that live
        through the window, each young pass of the collector moving them on)."""
        kept = self._unselected
        if kept is None or kept[0] != layout.k_local:
            views = [t[layout.k_local :] for t in self.host()]
            kept = self._unselected = (layout.k_local, views)
        return kept[1]

    def entering(self, migration: Migration, transfer: EnteringRows) -> list[int]:
        """Queue the entering columns' rows (master, moments, steps) for the device on
        ``transfer``; returns their places in what it sends. They are read from the host rows
        when it sends: before a CPU update that rewrites them is submitted."""
        positions = migration.entering_host_rows
        return [
            transfer.add(migration, host, positions, rows.dtype)
            for host, rows in zip(self.host(), self.device_rows(), strict=True)
        ]

    def migrate_later(
        self, migration: Migration, entering: list[torch.Tensor], leaving: LeavingRows
    ) -> tuple[int, int]:
        """The new selection on the device now (``entering``: its new columns' rows; the
        leaving ones' rows queued on ``leaving``, which the caller sends); the host rows move
        once ``settle`` is called. Returns the bytes this rank moves (to the host, to the
        device)."""
        assert self.unsettled is None, "a reselection before the last one settled"
        places = [
            leaving.add(rows, migration.leaving_device_rows, host, on_host=self.offload)
            for host, rows in zip(self.host(), self.device_rows(), strict=True)
        ]
        device = [
            place_device_rows(migration, rows, new)
            for rows, new in zip(self.device_rows(), entering, strict=True)
        ]
        self.device_master, self.device_exp_avg, self.device_exp_avg_sq, self.device_steps = device
        self.unsettled = (migration, leaving, places)
        return moved_bytes(migration, self.host())

    def settle(self) -> None:
        """The host rows' moves of the last reselection, once no CPU update reads them."""
        if self.unsettled is not None:
            migration, leaving, places = self.unsettled
            move_host_rows(migration, self.host(), leaving, places, self.sync)
            self.unsettled = None

    def load(self, host: list[torch.Tensor], device: list[torch.Tensor]) -> None:
        """Adopt saved rows (copies: the saved tensors stay the caller's)."""
        master, exp_avg, exp_avg_sq, steps = host
        self.host_master = _on_host(master, self.pin)
        self.host_exp_avg = _on_host(exp_avg, self.pin)
        self.host_exp_avg_sq = _on_host(exp_avg_sq, self.pin)
        self.host_steps = steps.to("cpu", copy=True)
        self._unselected = None
        moved = [t.to(self.device, copy=True) for t in device]
        self.unsettled = None
        self.device_master, self.device_exp_avg, self.device_exp_avg_sq, self.device_steps = moved


def _on_host(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    copy = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
    return copy.copy_(tensor)
