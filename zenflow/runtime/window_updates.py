"""The CPU updates of one optimizer's windows: submitted, in flight, applied.

A window's update is one C++ job per param group over the weights whose window is open: AdamW
of each weight's unselected columns on the window's mean gradient (the fused boundary pass:
the window's sum, plus the last step's rows where it folds them in, divided by the window's
committed steps). The job also copies the new values, in the same pass, into a buffer in the
parameter's dtype (rounded for a 16-bit model; pinned for any model on a GPU), so that writing
them back converts and copies nothing on the training thread. A synchronous update is applied
at once; an overlapped one stays pending until the next window boundary.

With device-side sums the job reads the sums shipped to the host at the close. An overlapped
update waits for them on the copy stream's host thread and is submitted from there
(``ShippedJob``): were the training thread to wait, it would stop queueing work until the
device had finished everything it was given, the sums' copy included, and the device would
then idle until the next step's work reached it.
"""

import contextlib
import functools

import torch

from zenflow.runtime import cpu_adam
from zenflow.runtime.cpu_jobs import CPUJobs
from zenflow.runtime.host_sync import HostSync
from zenflow.runtime.owned_weight import OwnedWeight
from zenflow.runtime.pending_update import CopyBuffers, PendingUpdate, ShippedJob, UpdateEntry
from zenflow.runtime.streams import PendingCopy, copy_stream
from zenflow.runtime.window_sum import SumShipment


class WindowUpdates:
    """Owns the updates in flight (``pending``, oldest first) and each param group's shipment
    of device-side sums to the host (``SumShipment``); counts into the optimizer's
    ``counters`` (the bytes of shipped device-side sums and of write-backs), waits for CPU jobs
    through its ``jobs`` and for copies through ``sync``."""

    def __init__(self, jobs: CPUJobs, counters: dict, sync: HostSync):
        self.jobs = jobs
        self.sync = sync
        self.counters = counters
        self.pending: list[PendingUpdate] = []
        self._shipments: dict[int, SumShipment] = {}  # by param group: device-side sums

    def submit(
        self, weights: list[OwnedWeight], hyper: dict, window_steps: int, background: bool
    ) -> PendingUpdate:
        """Queue the update of one param group's ``weights`` (``hyper``: its AdamW settings,
        the learning rate already scaled for the window)."""
        if background:
            self.jobs.background()
        entries, sums, lasts = [], [], []
        copies = CopyBuffers(weights)
        unselected = [w.state.unselected(w.layout) for w in weights]
        masters, exp_avgs, exp_avg_sqs, steps = (
            list(part) for part in zip(*unselected, strict=True)
        )
        torch._foreach_add_(steps, 1)
        for w, copied in zip(weights, copies.rows, strict=True):
            if w.device_sums:
                entries.append(UpdateEntry.of(w, copied, None, None))
            else:
                # The job reads (then zeroes) this window's sum while the next window fills
                # the other buffer.
                window_sum, last = w.window.take(background)
                sums.append(window_sum)
                lasts.append(None if last is None else last.rows)
                entries.append(UpdateEntry.of(w, copied, window_sum, last))
        shipping = []
        if weights[0].device_sums:
            shipment = self._shipments.setdefault(weights[0].group_index, SumShipment())
            shipping, sums = shipment.ship(
                [w.window for w in weights], [w.param.dtype for w in weights]
            )
            self.counters["d2h_bytes"] += sum(s.numel() * s.element_size() for s in sums)
        common = dict(
            steps=steps,
            segment_len=[w.out for w in weights],
            out=copies.rows,
            **hyper,
        )
        if weights[0].device_sums:
            submit = functools.partial(
                cpu_adam.submit_adamw_step,
                masters,
                sums,
                exp_avgs,
                exp_avg_sqs,
                grad_scale=1.0 / window_steps,
                **common,
            )
            handle = self._submit_once_landed(submit, shipping, weights, background)
        else:
            handle = cpu_adam.submit_boundary_adamw_step(
                masters, sums, lasts, exp_avgs, exp_avg_sqs, n=window_steps, **common
            )
        update = PendingUpdate(handle, entries, copies)
        if background:
            self.pending.append(update)
        return update

    def _submit_once_landed(
        self,
        submit,
        shipping: list[PendingCopy],
        weights: list[OwnedWeight],
        background: bool,
    ) -> "cpu_adam.CPUAdamHandle | ShippedJob":
        """``submit()`` once every shipped sum has landed (the pool reads them): for an
        overlapped update whose weights share a device, on that device's copy stream's host
        thread; otherwise here, waiting for the copies (one counted synchronization: they land
        in order)."""
        devices = {w.param.device for w in weights}
        if background and len(devices) == 1:

            def landed_then_submit():
                for pending in shipping:
                    pending.landed()
                return submit()

            return ShippedJob(copy_stream(devices.pop()).on_host_thread(landed_then_submit))
        for pending in shipping:
            pending.wait(self.sync)
        return submit()

    def apply(self, update: PendingUpdate, rewritten=(), unwritten=None) -> None:
        """Wait for ``update`` and write its result to the parameters, except for the weights
        in ``rewritten`` (a synchronous update is about to write them again). ``unwritten``:
        values the step has not yet written, by weight, the selected columns' first
        (``Conductor._device_commit``); a weight's are written in the pass of its result, and
        it is taken out of ``unwritten``."""
        with torch.profiler.record_function("zenflow::write_back"):
            if update.handle is not None:
                self.jobs.collect(update.handle, "cpu_adam_s")
            skipped = {id(w) for w in rewritten}
            writing = any(id(w) not in skipped for w in update.weights)
            placed = [None] * len(update.entries)
            if writing and update.copies is not None:
                placed = update.copies.on_device()
            with torch.profiler.record_function("zenflow::write_unselected"):
                for entry, copied in zip(update.entries, placed, strict=True):
                    entry.release()
                    if id(entry.weight) in skipped:
                        entry.weight.state.settle()
                    else:
                        also = () if unwritten is None else unwritten.pop(entry.weight, ())
                        self.counters["h2d_bytes"] += entry.write(copied, tuple(also))

    def apply_pending(self, rewritten=(), unwritten=None) -> None:
        for update in self.pending:
            self.apply(update, rewritten, unwritten)
        self.pending = []

    def wait(self) -> None:
        """Let the pending jobs end without applying them (a state dict taken between steps,
        or host rows read before the result is written); the host rows they read move where
        their layout has them now."""
        for update in self.pending:
            if update.handle is not None:
                self.jobs.wait(update.handle)
            for entry in update.entries:
                entry.weight.state.settle()

    def abandon(self) -> None:
        """After a failure: let running jobs end without raising (their results are undefined
        and state loaded next replaces everything they touched)."""
        for update in self.pending:
            if update.handle is not None:
                with contextlib.suppress(cpu_adam.CPUAdamError):
                    update.handle.wait()
        self.pending = []
