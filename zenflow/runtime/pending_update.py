"""A CPU update of unselected columns, submitted to the pool, and what applying it writes.

Each entry carries what its write needs. The job copies a 16-bit parameter's rows (rounded) and
a GPU's fp32 parameter's rows into a buffer of their own, which the entry keeps with the
columns they belong to (every rank's, in row order) and how many rows each rank has, fixed when
the update was submitted; if columns entered the selection since (the update was submitted at
a select boundary), they are written again from their device state after it. An fp32
parameter on the CPU is written from the host master rows the job updates, read where they are
when the entry is written: after a select boundary, the host rows move once the job is done
(``ColumnState.settle``), and the columns that left the selection then hold, in their host
rows, the values their parameter columns already have.
"""

from dataclasses import dataclass

import torch

from zenflow.runtime import cpu_adam
from zenflow.runtime.layout import ColumnLayout
from zenflow.runtime.owned_weight import OwnedWeight
from zenflow.runtime.staging.contributions import HostRows


@dataclass
class UpdateEntry:
    """One weight's part of a CPU update."""

    weight: OwnedWeight
    layout: ColumnLayout  # the weight's layout when the update was submitted
    copied: torch.Tensor | None  # the job's copy of this rank's rows, in the param's dtype
    window_sum: torch.Tensor | None  # the sum the job zeroes, back to the window after it
    last: HostRows | None  # the last step's rows the job folds in, released after it

    @classmethod
    def of(
        cls,
        weight: OwnedWeight,
        copied: torch.Tensor | None,
        window_sum: torch.Tensor | None,
        last: HostRows | None,
    ) -> "UpdateEntry":
        return cls(weight, weight.layout, copied, window_sum, last)

    def release(self) -> None:
        """The job is done with the window's buffers."""
        if self.window_sum is not None:
            self.weight.window.give_back(self.window_sum)
        if self.last is not None and self.last.release is not None:
            self.last.release()

    def write(self) -> int:
        """Write the rows into the parameter (the job is done); returns the bytes sent to the
        device."""
        w = self.weight
        w.state.settle()
        if self.copied is None:
            layout = w.layout
            rows = w.state.host_master[layout.k_local :]
            columns = layout.on(w.param.device, "unselected")
            return w.write_rows(rows, False, columns, layout.unselected_counts)
        columns = self.layout.on(w.param.device, "unselected")
        sent = w.write_rows(self.copied, True, columns, self.layout.unselected_counts)
        if w.layout is not self.layout:
            sent += w.write_selected()
        return sent


@dataclass
class PendingUpdate:
    """A submitted CPU update (``handle``; None: finished before a checkpoint was loaded) and
    its entries, one per weight."""

    handle: cpu_adam.CPUAdamHandle | None
    entries: list[UpdateEntry]

    @property
    def weights(self) -> list[OwnedWeight]:
        return [entry.weight for entry in self.entries]
