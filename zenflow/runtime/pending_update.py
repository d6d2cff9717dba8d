"""A CPU update of unselected columns, submitted to the pool, and what applying it writes.

Each entry carries what its write needs, fixed when the update was submitted: the rows the job
writes (rounded into a buffer of the parameter's dtype, or the fp32 host master rows it
updates), every rank's columns those rows belong to, and how many rows each rank has. Applying
never reads the weight's current layout. (The conductor applies an update before any
reselection of its weights, since the fp32 master rows it reads stay where the update wrote
them only until then.)
"""

from dataclasses import dataclass

import torch

from zenflow.runtime import cpu_adam
from zenflow.runtime.owned_weight import OwnedWeight
from zenflow.runtime.staging.contributions import HostRows


@dataclass
class UpdateEntry:
    """One weight's part of a CPU update."""

    weight: OwnedWeight
    rows: torch.Tensor  # this rank's updated rows, in host row order
    rounded: bool  # rows are in the parameter's dtype (else fp32 master rows)
    columns: torch.Tensor  # every rank's updated columns, in row order, on the weight's device
    counts: list[int]  # rows per rank
    window_sum: torch.Tensor | None  # the sum the job zeroes, back to the window after it
    last: HostRows | None  # the last step's rows the job folds in, released after it

    @classmethod
    def of(
        cls,
        weight: OwnedWeight,
        rounded: torch.Tensor | None,
        window_sum: torch.Tensor | None,
        last: HostRows | None,
    ) -> "UpdateEntry":
        layout = weight.layout
        return cls(
            weight=weight,
            rows=weight.state.host_master[layout.k_local :] if rounded is None else rounded,
            rounded=rounded is not None,
            columns=layout.on(weight.param.device, "unselected"),
            counts=layout.unselected_counts,
            window_sum=window_sum,
            last=last,
        )

    def release(self) -> None:
        """The job is done with the window's buffers."""
        if self.window_sum is not None:
            self.weight.window.give_back(self.window_sum)
        if self.last is not None and self.last.release is not None:
            self.last.release()

    def write(self) -> int:
        """Write the rows into the parameter; returns the bytes sent to the device."""
        return self.weight.write_rows(self.rows, self.rounded, self.columns, self.counts)


@dataclass
class PendingUpdate:
    """A submitted CPU update (``handle``; None: finished before a checkpoint was loaded) and
    its entries, one per weight."""

    handle: cpu_adam.CPUAdamHandle | None
    entries: list[UpdateEntry]

    @property
    def weights(self) -> list[OwnedWeight]:
        return [entry.weight for entry in self.entries]
