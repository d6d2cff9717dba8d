"""Where one weight's columns are kept: which are selected, and in which row of which buffer
every column's state lives. Pure: a reselection returns the new layout and the moves it takes.

Per-column quantities are *rows* (a weight's column ``j`` is row ``j`` of ``G.T``). Every rank
holds the device rows of all selected columns, ``device_columns`` (in device row order; every
rank updates them identically). The host state of the natural block of columns ``[lo, hi)`` of
rank ``r`` lives on that rank only, in its *local order*: the block's selected columns first
(``k_locals[r]`` rows, stale while on the device), then its unselected ones. Every rank keeps
every block's local order (they change identically everywhere), since the global ``order`` is
built from them: the selected columns, then each rank's unselected ones in rank order. Blocks
are fixed, so a reselection moves state between device and host, never between ranks::

    4 columns, 2 ranks, columns 1 and 2 selected:
    device_columns [1 2]   local_orders [[1 0] [2 3]]   k_locals [1 1]   order [1 2 0 3]

A reselection swaps each of a block's front positions whose column leaves the selection with a
back position whose column enters it (every other column keeps its row), and replaces leaving
device rows with entering ones in place: the rows that move are proportional to the change.
"""

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from zenflow.runtime.streams import sent_to


@dataclass(frozen=True, eq=False)
class ColumnLayout:
    """One weight's column placement; immutable (``reselect`` returns a new one)."""

    columns: int
    rank: int
    blocks: tuple[tuple[int, int], ...]  # every rank's natural block [lo, hi)
    device_columns: torch.Tensor  # [k] int64 (CPU): the selected columns, in device row order
    local_orders: tuple[torch.Tensor, ...]  # per rank: its block's columns, selected first
    k_locals: tuple[int, ...]  # per rank: how many of its block's columns are selected
    # Index tensors asked for on a device every step, made once per layout: device -> name ->.
    _on_device: dict = field(default_factory=dict, repr=False)

    @classmethod
    def natural(cls, columns: int, rank: int, blocks: list[tuple[int, int]]) -> "ColumnLayout":
        """Nothing selected, every column in its natural place."""
        return cls(
            columns=columns,
            rank=rank,
            blocks=tuple(blocks),
            device_columns=torch.empty(0, dtype=torch.int64),
            local_orders=tuple(torch.arange(lo, hi) for lo, hi in blocks),
            k_locals=(0,) * len(blocks),
        )

    @property
    def k(self) -> int:
        return self.device_columns.numel()

    @property
    def lo(self) -> int:
        return self.blocks[self.rank][0]

    @property
    def hi(self) -> int:
        return self.blocks[self.rank][1]

    @property
    def block_rows(self) -> int:
        """Host rows this rank keeps: its whole block, selected columns' rows included."""
        return self.hi - self.lo

    @property
    def local_order(self) -> torch.Tensor:
        return self.local_orders[self.rank]

    @property
    def k_local(self) -> int:
        return self.k_locals[self.rank]

    @property
    def host_columns(self) -> torch.Tensor:
        """This rank's unselected columns, in host row order (contiguous int64, CPU)."""
        return self.local_order[self.k_local :]

    @property
    def unselected_counts(self) -> list[int]:
        """Every rank's number of unselected columns, in rank order."""
        return [
            order.numel() - k for order, k in zip(self.local_orders, self.k_locals, strict=True)
        ]

    @functools.cached_property
    def natural_order(self) -> bool:
        """Nothing selected: a gradient's rows are in this layout's order as formed (asked by
        every backward: found once per layout)."""
        return self.k == 0 and all(
            torch.equal(order, torch.arange(lo, hi))
            for order, (lo, hi) in zip(self.local_orders, self.blocks, strict=True)
        )

    def order(self) -> torch.Tensor:
        """Every column in row order: the selected ones, then each rank's unselected ones."""
        parts = [self.device_columns]
        for order, k_local in zip(self.local_orders, self.k_locals, strict=True):
            parts.append(order[k_local:])
        return torch.cat(parts)

    def selected_columns(self) -> torch.Tensor:
        """The selected columns in ascending order."""
        return self.device_columns.sort().values

    def in_column_order(self, in_order: torch.Tensor) -> torch.Tensor:
        """Values of this layout's rows (``in_order``: one per column, in the layout's row order)
        put in natural column order, fp32, on their device."""
        values = torch.empty_like(in_order, dtype=torch.float32)
        values[self.on(in_order.device, "order")] = in_order.to(torch.float32)
        return values

    def on(self, device: torch.device, name: str) -> torch.Tensor:
        """``order()`` ("order"), ``device_columns`` ("selected") or every rank's unselected
        columns in row order ("unselected") on ``device``, made once per layout and device."""
        device = torch.device(device)
        cached = self._on_device.setdefault(device, {})
        if name not in cached:
            # One crossing for the three: the selected and unselected columns are views of
            # the order on the device.
            order = sent_to(self.order(), device)
            cached |= {"order": order, "selected": order[: self.k], "unselected": order[self.k :]}
        return cached[name]

    def ascending_on(
        self, device: torch.device, name: str
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``on(device, name)`` sorted, and the row of each (``sort()``'s values and indices):
        what a write in column order takes on a GPU (a window's "unselected" columns; the
        selected ones are written in device row order), made once per layout and device; None
        on the CPU, whose writes take any order."""
        if torch.device(device).type == "cpu":
            return None
        cached = self._on_device.setdefault(torch.device(device), {})
        key = f"{name} ascending"
        if key not in cached:
            cached[key] = tuple(self.on(device, name).sort())
        return cached[key]

    def reselect(self, selected: torch.Tensor) -> "Migration":
        """The layout for a new selection (ascending column indices) and the moves from this
        one to it, for this rank.

        Index arithmetic on the host over a few thousand columns, for every weight at a select
        boundary while the device waits: done in numpy, whose operations on arrays this small
        cost a fraction of torch's dispatch (a 1024-column weight's reselection took 0.41 ms
        in torch operations on the development CPU); the results are torch tensors sharing
        the arrays' memory."""
        selected = selected.to("cpu", torch.int64).numpy()
        device_columns_was = self.device_columns.numpy()
        local_orders = [order.numpy() for order in self.local_orders]
        local_order = local_orders[self.rank]
        was = _mask(self.columns, device_columns_was)
        now = _mask(self.columns, selected)
        entering = selected[~was[selected]]
        leaving = device_columns_was[~now[device_columns_was]]
        device_row = np.full(self.columns, -1, dtype=np.int64)
        device_row[device_columns_was] = np.arange(self.k, dtype=np.int64)
        host_row = _positions(self.columns, local_order)

        partitions = [_partition(order, now) for order in local_orders]
        new_local_order, _, (front, back) = partitions[self.rank]
        # Of the swapped pairs, the front column that was not selected has a host row to move;
        # a selected one's host row is stale and its state comes from the device.
        moved = ~was[local_order[front]]
        new_host_row = _positions(self.columns, new_local_order)
        mine = (leaving >= self.lo) & (leaving < self.hi)
        leaving_mine = leaving[mine]
        owned = (entering >= self.lo) & (entering < self.hi)

        if entering.size == 0 and leaving.size == 0:
            # The same columns chosen again: this layout stays, and with it the index tensors
            # it has already made on each device.
            return _unchanged(self)
        if entering.size == leaving.size:
            entering_device_rows = device_row[leaving]
            device_columns = device_columns_was.copy()
            device_columns[entering_device_rows] = entering
            kept = None
        else:  # the selection changed size (the first one): device rows in column order
            device_columns = selected
            new_row = _positions(self.columns, selected)
            staying = selected[was[selected]]
            entering_device_rows = new_row[entering]
            kept = (_tensor(device_row[staying]), _tensor(new_row[staying]))
        layout = ColumnLayout(
            columns=self.columns,
            rank=self.rank,
            blocks=self.blocks,
            device_columns=_tensor(device_columns),
            local_orders=tuple(_tensor(order) for order, _, _ in partitions),
            k_locals=tuple(k_local for _, k_local, _ in partitions),
        )
        return Migration(
            layout=layout,
            entering=_tensor(entering),
            entering_owned=_tensor(owned),
            entering_host_rows=_tensor(host_row[entering[owned]]),
            entering_device_rows=_tensor(entering_device_rows),
            leaving_device_rows=_tensor(device_row[leaving_mine]),
            leaving_host_rows=_tensor(new_host_row[leaving_mine]),
            host_moves=(_tensor(front[moved]), _tensor(back[moved])),
            device_kept=kept,
        )


@dataclass(frozen=True, eq=False)
class Migration:
    """The row moves from one layout to the next, for this rank (index tensors, CPU, int64).

    Host rows are this rank's block in local order, device rows the selected columns' rows.
    In order: every rank receives the entering columns' rows (owners contribute
    ``entering_host_rows`` of theirs, marked by ``entering_owned``); host rows move within the
    block (``host_moves``: from, to); each leaving column this rank owns takes its device row
    ``leaving_device_rows`` to its new host row ``leaving_host_rows``; the device rows are the
    old ones with the entering rows written at ``entering_device_rows`` in place of the leaving
    ones, or, when the selection changes size, rebuilt: ``device_kept`` (old rows, new rows) of
    the columns that stay, and the entering rows at theirs."""

    layout: ColumnLayout
    entering: torch.Tensor
    entering_owned: torch.Tensor
    entering_host_rows: torch.Tensor
    entering_device_rows: torch.Tensor
    leaving_device_rows: torch.Tensor
    leaving_host_rows: torch.Tensor
    host_moves: tuple[torch.Tensor, torch.Tensor]
    device_kept: tuple[torch.Tensor, torch.Tensor] | None

    @property
    def rows_to_host(self) -> int:
        return self.leaving_device_rows.numel()

    @property
    def rows_to_device(self) -> int:
        return self.entering.numel()


def _unchanged(layout: ColumnLayout) -> Migration:
    """The moves from ``layout`` to itself: none."""
    none = torch.empty(0, dtype=torch.int64)
    return Migration(
        layout=layout,
        entering=none,
        entering_owned=torch.empty(0, dtype=torch.bool),
        entering_host_rows=none,
        entering_device_rows=none,
        leaving_device_rows=none,
        leaving_host_rows=none,
        host_moves=(none, none),
        device_kept=None,
    )


def _tensor(array: np.ndarray) -> torch.Tensor:
    """``array`` as a torch tensor sharing its memory (nothing writes either afterwards)."""
    return torch.from_numpy(np.ascontiguousarray(array))


def _mask(columns: int, index: np.ndarray) -> np.ndarray:
    mask = np.zeros(columns, dtype=bool)
    mask[index] = True
    return mask


def _positions(columns: int, order: np.ndarray) -> np.ndarray:
    """``positions[order[i]] == i`` (entries of columns not in ``order`` unset)."""
    positions = np.empty(columns, dtype=np.int64)
    positions[order] = np.arange(order.size, dtype=np.int64)
    return positions


def _partition(local_order: np.ndarray, selected: np.ndarray):
    """A block's new local order for a new selection (mask ``selected``): selected columns in
    front, the rest behind, by swapping each misplaced front position with a misplaced back one
    (every other column keeps its place). Returns the new order, the front's size, and the
    swapped positions ``(front, back)``: the column at ``front[i]`` goes to ``back[i]`` and the
    other way round."""
    in_front = selected[local_order]
    size = int(np.count_nonzero(in_front))
    position = np.arange(local_order.size)
    front = np.flatnonzero((position < size) & ~in_front)
    back = np.flatnonzero((position >= size) & in_front)
    order = local_order.copy()
    order[front], order[back] = local_order[back], local_order[front]
    return order, size, (front, back)
