"""One weight's window: the sum of its unselected columns' committed gradients since the last
CPU update, and what that update reads.

Rows are this rank's unselected columns in host row order, in fp32, on the host (on the
weight's device with device-side sums). A step's rows (``zenflow.runtime.staging.
contributions``) join the window in one of four ways:

* ``add_on_pool``: host rows added by the CPU pool, queued behind the update that may still be
  running there (the conductor batches every weight's into one job);
* ``add_now``: on the training thread (update_interval "auto" reads the sum every step;
  device-side sums, every weight's rows in one multi-tensor add: ``add_device_rows``);
* ``defer``: a small batch's factors kept, the window's share of their product formed in one
  matmul when it closes (the sum is then written once per window);
* ``keep_last``: the window's last step's host rows, which the update folds in itself.

``take`` hands the window to its CPU update; with an overlapped update the next window fills a
second buffer meanwhile (``give_back`` returns the first once the update is done with it).
Device-side sums cross to the host instead, every weight's of a param group together
(``SumShipment``).
"""

import torch

from zenflow.runtime.cpu_adam import GatheredRows
from zenflow.runtime.layout import Migration
from zenflow.runtime.migration import EnteringRows
from zenflow.runtime.side_by_side import elements, indices_by, views
from zenflow.runtime.staging.contributions import Contribution, Factors, HostRows, as_tensor
from zenflow.runtime.streams import PendingCopy, copy_stream


class WindowSum:
    """Owns the window's sum and its spare buffer, the last step's rows (``last``, with their
    block's release), the deferred factors, and whether any step joined since the last close
    (``open``)."""

    def __init__(self, device: torch.device):
        self.device = device  # where the sum is kept
        self.sum: torch.Tensor | None = None
        self._spare: torch.Tensor | None = None
        self.last: HostRows | None = None
        self.deferred: list[Factors] = []
        self.open = False

    def _ready(self, rows: int, out: int) -> torch.Tensor:
        if self.sum is None or self.sum.shape != (rows, out):
            self.sum = torch.zeros(rows, out, device=self.device)
            self._spare = None
        return self.sum

    def add_on_pool(
        self, contribution: HostRows, rows: int, out: int
    ) -> tuple[torch.Tensor, torch.Tensor | GatheredRows]:
        """The (sum, rows) pair for the pool to add; the caller gives the rows' block back
        once the job is done."""
        self.open = True
        return self._ready(rows, out), contribution.rows

    def add_now(self, contribution: Contribution, coefficient: float, out: int) -> None:
        if isinstance(contribution, Factors):
            x, dy, host_columns = contribution
            total = self._ready(host_columns.numel(), out)
            total.addmm_(x.index_select(1, host_columns).t(), dy, alpha=coefficient)
        else:
            rows = as_tensor(contribution)
            self._ready(rows.shape[0], out).add_(rows, alpha=coefficient)
            if isinstance(contribution, HostRows) and contribution.release is not None:
                contribution.release()
        self.open = True

    def defer(self, factors: Factors, coefficient: float) -> None:
        dy = factors.dy * coefficient if coefficient != 1.0 else factors.dy
        self.deferred.append(factors._replace(dy=dy))
        self._ready(factors.host_columns.numel(), factors.dy.shape[1])
        self.open = True

    def keep_last(self, contribution: HostRows, rows: int, out: int) -> None:
        self._ready(rows, out)
        self.last = contribution
        self.open = True

    def energy(self) -> torch.Tensor:
        """The sum's squared norm, fp64 (without an fp64 copy of the sum)."""
        return torch.linalg.vector_norm(self.sum, dtype=torch.float64).square()

    def energy_terms(self, rows: torch.Tensor) -> torch.Tensor:
        """For ``rows`` about to join the sum with a coefficient ``c`` not known yet (in host
        row order, where the sum is): ``||sum||^2``, ``<sum, rows>`` and ``||rows||^2`` (fp64),
        from which ``||sum + c rows||^2`` is formed once ``c`` is known."""
        rows_sq = torch.linalg.vector_norm(rows, dtype=torch.float64).square()
        if self.sum is None or self.sum.shape != rows.shape:
            zero = torch.zeros((), dtype=torch.float64, device=rows.device)
            return torch.stack([zero, zero, rows_sq])
        cross = torch.sum(self.sum * rows, dtype=torch.float64)
        return torch.stack([self.energy(), cross, rows_sq])

    def _sum_deferred(self) -> None:
        if self.deferred:
            xs, dys, columns = zip(*self.deferred, strict=True)
            x = torch.cat(xs).index_select(1, columns[-1])
            self.sum.addmm_(x.t(), torch.cat(dys))
            self.deferred = []

    def entering(self, migration: Migration, k_local: int, transfer: EnteringRows) -> int:
        """Queue the window's sum of the columns entering the selection (fp32) for the
        device on ``transfer``, for their update there; returns its place in what it sends.
        ``k_local``: the selected rows in front of this rank's block before the reselection.
        Every step's rows must have been added."""
        assert self.last is None, "the last step's rows are folded in by the CPU update only"
        self._sum_deferred()
        positions = migration.entering_host_rows - k_local
        return transfer.add(migration, self.sum, positions, torch.float32)

    def take(self, background: bool) -> tuple[torch.Tensor, HostRows | None]:
        """The window for its CPU update: (the sum, the last step's rows or None). The update
        zeroes the sum as it reads it; with ``background`` the next window fills the spare."""
        self._sum_deferred()
        taken, last = self.sum, self.last
        self.last = None
        self.open = False
        if background:
            self.sum = self._spare if self._spare is not None else torch.zeros_like(taken)
            self._spare = None
        return taken, last

    def give_back(self, taken: torch.Tensor) -> None:
        """An overlapped update is done with ``taken`` (zeroed): it is the next spare."""
        if taken is not self.sum and self.sum is not None and taken.shape == self.sum.shape:
            self._spare = taken

    def state_dict(self) -> dict:
        return {
            "accumulator": self.sum,
            "window_factors": [(f.x, f.dy) for f in self.deferred],
            "in_window": self.open,
        }

    def load_state_dict(self, state: dict, host_columns: torch.Tensor) -> None:
        saved = state["accumulator"]
        self.sum = None if saved is None else saved.to(self.device, copy=True)
        self._spare = None
        self.last = None
        self.deferred = [
            Factors(x.to(self.device, copy=True), dy.to(self.device, copy=True), host_columns)
            for x, dy in state["window_factors"]
        ]
        self.open = state["in_window"]


def add_device_rows(windows: list[WindowSum], rows: list[torch.Tensor], coefficient: float) -> None:
    """Device-side sums: ``add_now`` of every weight's rows at once, one multi-tensor add (on
    a GPU a kernel per device for all the weights rather than one per weight)."""
    sums = [w._ready(r.shape[0], r.shape[1]) for w, r in zip(windows, rows, strict=True)]
    torch._foreach_add_(sums, rows, alpha=coefficient)
    for w in windows:
        w.open = True


class SumShipment:
    """Device-side sums of one param group's windows on their way to the host at a close, one
    copy per device and dtype: converted side by side into one device buffer, sent through the
    copy stream into one host buffer (pinned on a GPU). Owns the host buffers, written again at
    the group's next close, after the update that read them was applied."""

    def __init__(self):
        self._host: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def ship(
        self, windows: list[WindowSum], dtypes: list[torch.dtype]
    ) -> tuple[list[PendingCopy], list[torch.Tensor]]:
        """Every window's sum in its dtype (``dtypes[i]``) on its way to the host: the copies
        (the host reads the sums once they have landed) and each sum's host rows. The device
        sums start the next window at zero."""
        keys = [(window.device, dtype) for window, dtype in zip(windows, dtypes, strict=True)]
        copies, shipped = [], [None] * len(windows)
        for (device, dtype), members in indices_by(keys).items():
            sums = [windows[i].sum for i in members]
            shapes = [total.shape for total in sums]
            side_by_side = torch.empty(elements(shapes), dtype=dtype, device=device)
            torch._foreach_copy_(views(side_by_side, shapes), sums)
            host = self._host.get((device, dtype))
            if host is None or host.numel() != side_by_side.numel():
                pin = device.type == "cuda"
                host = torch.empty(side_by_side.numel(), dtype=dtype, pin_memory=pin)
                self._host[(device, dtype)] = host
            stream = copy_stream(device)
            copies.append(stream.copy_to_host(side_by_side, out=host, owned=True))
            for i, part in zip(members, views(host, shapes), strict=True):
                shipped[i] = part
            torch._foreach_zero_(sums)
            for i in members:
                windows[i].open = False
        return copies, shipped
