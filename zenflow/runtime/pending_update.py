"""A CPU update of unselected columns, submitted to the pool, and what applying it writes.

Each entry carries what its write needs. The job copies a 16-bit parameter's rows (rounded) and
a GPU's fp32 parameter's rows into buffers of their own (``CopyBuffers``: one per device and
dtype for all the update's weights, sent to the device in one copy each when the update is
applied); the entry keeps its rows with the columns they belong to (every rank's, in row order)
and how many rows each rank has, fixed when the update was submitted; if columns entered the
selection since (the update was submitted at a select boundary), they are written again from
their device state after it (in the same pass where the step hands its selected columns' values
to the write). An fp32 parameter on the CPU is written from the host master rows
the job updates, read where they are when the entry is written: after a select boundary, the
host rows move once the job is done (``ColumnState.settle``), and the columns that left the
selection then hold, in their host rows, the values their parameter columns already have.
"""

from concurrent.futures import Future
from dataclasses import dataclass

import torch

from zenflow.runtime import cpu_adam
from zenflow.runtime.layout import ColumnLayout
from zenflow.runtime.owned_weight import OwnedWeight
from zenflow.runtime.param_writes import ColumnValues
from zenflow.runtime.side_by_side import elements, indices_by, views
from zenflow.runtime.staging.contributions import HostRows
from zenflow.runtime.streams import copy_stream


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

    def write(
        self, copied_on_device: torch.Tensor | None = None, also: tuple[ColumnValues, ...] = ()
    ) -> int:
        """Write the rows into the parameter (the job is done): the job's copy, sent to the
        device (``copied_on_device``), or the host master rows; ``also``: the step's values of
        other columns, starting with the selected ones (``OwnedWeight.selected_values()``),
        written in the same pass, after the rows. Returns the bytes sent to the device."""
        w = self.weight
        w.state.settle()
        device = w.param.device
        if self.copied is None:
            layout = w.layout
            rows = w.state.host_master[layout.k_local :]
            columns = layout.on(device, "unselected")
            return w.write_rows(rows, False, columns, layout.unselected_counts, None, also)
        layout = self.layout
        columns = layout.on(device, "unselected")
        ascending = layout.ascending_on(device, "unselected")
        counts = layout.unselected_counts
        sent = w.write_rows(copied_on_device, True, columns, counts, ascending, also)
        if w.layout is not self.layout and not also:
            sent += w.write_selected()
        return sent


class CopyBuffers:
    """Where a CPU update copies its weights' new rows (in ``OwnedWeight.copy_dtype``): one
    buffer per device and dtype (pinned on a GPU), each weight's rows (``rows``, None where
    the weight takes no copy) a view of it, so that they cross to the device in one copy per
    buffer. Owns the buffers."""

    def __init__(self, weights: list[OwnedWeight]):
        self.rows: list[torch.Tensor | None] = [None] * len(weights)
        keys = [(w.param.device, w.copy_dtype()) for w in weights]
        self._buffers = []  # (device, buffer, members, each member's shape)
        for (device, dtype), members in indices_by(keys).items():
            if dtype is None:
                continue
            shapes = [(weights[i].layout.host_columns.numel(), weights[i].out) for i in members]
            pin = device.type == "cuda"
            buffer = torch.empty(elements(shapes), dtype=dtype, pin_memory=pin)
            for i, part in zip(members, views(buffer, shapes), strict=True):
                self.rows[i] = part
            self._buffers.append((device, buffer, members, shapes))

    def on_device(self) -> list[torch.Tensor | None]:
        """Every weight's copied rows on its device (the job is done), one copy per buffer,
        on the copy stream."""
        placed: list[torch.Tensor | None] = [None] * len(self.rows)
        for device, buffer, members, shapes in self._buffers:
            sent, _ = copy_stream(device).copy_to_device(buffer)
            for i, part in zip(members, views(sent, shapes), strict=True):
                placed[i] = part
        return placed


class ShippedJob:
    """A CPU update submitted by the copy stream's host thread once the device-side sums it
    reads have landed (``future``: its ``CPUAdamHandle``); waited for and timed as the job
    itself. A copy or a submission that failed raises ``CPUAdamError`` at ``wait``: the
    update did not run."""

    def __init__(self, future: Future):
        self._future = future

    def _job(self) -> cpu_adam.CPUAdamHandle:
        try:
            return self._future.result()
        except cpu_adam.CPUAdamError:
            raise
        except Exception as error:
            raise cpu_adam.CPUAdamError(
                f"a window's CPU update was not submitted, its sums did not reach the host: {error}"
            ) from error

    def wait(self) -> None:
        self._job().wait()

    def seconds(self) -> float:
        return self._job().seconds()


@dataclass
class PendingUpdate:
    """A submitted CPU update (``handle``; None: finished before a checkpoint was loaded), its
    entries, one per weight, and the buffers its rows were copied into."""

    handle: cpu_adam.CPUAdamHandle | ShippedJob | None
    entries: list[UpdateEntry]
    copies: CopyBuffers | None = None  # what the job copied the entries' rows into

    @property
    def weights(self) -> list[OwnedWeight]:
        return [entry.weight for entry in self.entries]
