"""One optimizer's side of the process-wide CPU pool (``zenflow.runtime.cpu_adam``).

The pool runs jobs in submission order. An optimizer queues window-sum additions (host rows
added into the windows' sums behind the update that may still be running) and CPU updates;
it waits for a job only where its result is needed, and counts the time: how long the
training thread waited (``optimizer_wait_s``, and its share per phase of the step,
``optimizer_wait_s_<phase>``) and how long each kind of job ran in the pool (``cpu_adam_s``,
``cpu_accumulate_s``), waited for or not.
"""

import contextlib
import time
from collections.abc import Callable

import torch

from zenflow.runtime import core_binding, cpu_adam

# Niceness of the CPU AdamW workers while an overlapped update runs beside training: they take
# the time the training thread leaves idle rather than competing with it for a core (its
# kernel launches on a GPU machine; its compute on a CPU-only one, where on 2 cores this moves
# the cost from the steps inside the window to the wait at its close: the mean step is the same).
BACKGROUND_NICE = 10
# What the training thread may be doing when it waits for the pool: a step inside a window, a
# reselecting one, one closing a window, a select boundary, a warm-up step; flush(); or a
# state dict (taken or loaded) waiting for the jobs in flight. Each has its share of
# optimizer_wait_s.
WAIT_PHASES = (
    "ordinary",
    "select",
    "window_close",
    "select_boundary",
    "warm_up",
    "flush",
    "state_dict",
)
# Steps whose unselected rows may wait in the pool's queue: each holds a staging block (a pinned
# copy of the weights' unselected gradient rows on a GPU machine), so one, not more.
SUMS_QUEUED = 1


class _QueuedSums:
    def __init__(self, handle: cpu_adam.CPUAdamHandle, releases: list[Callable[[], None]]):
        self.handle = handle
        self.releases = releases  # give back the blocks the job reads, once it is done


class CPUJobs:
    """Owns the pool settings this optimizer trains with (``place``, from
    ``zenflow.runtime.core_binding.place_pool``), its queued window-sum additions, the phase its waits count to (``phase``, one
    of ``WAIT_PHASES``), and its share of ``counters`` (the timings above)."""

    def __init__(self, place: core_binding.PoolPlace, counters: dict):
        self.place = place
        self.background()
        self.counters = counters
        for phase in WAIT_PHASES:
            counters.setdefault(f"optimizer_wait_s_{phase}", 0.0)
        self.phase = "ordinary"  # what the training thread is doing, set by the conductor
        self._sums: list[_QueuedSums] = []

    @contextlib.contextmanager
    def every_core(self):
        """For jobs the training thread waits for: the cores it keeps for itself would idle
        meanwhile, so the pool uses them too, at normal priority (the rank's whole share of
        the machine: ``place``)."""
        cpu_adam.set_num_threads(self.place.waited_threads)
        cpu_adam.set_worker_nice(0)
        cpu_adam.set_worker_cpus(self.place.waited_cpus)
        try:
            yield
        finally:
            self.background()

    def background(self) -> None:
        """The pool as overlapped updates run it, beside training: set before each of them is
        submitted (each setting a no-op when already so), as another user of the process's
        pool (a ``CPUAdamW`` step, another optimizer) may have set it otherwise meanwhile."""
        cpu_adam.set_num_threads(self.place.threads)
        cpu_adam.set_worker_nice(BACKGROUND_NICE)
        cpu_adam.set_worker_cpus(self.place.cpus)

    def wait(self, handle: cpu_adam.CPUAdamHandle) -> None:
        started = time.perf_counter()
        handle.wait()
        waited = time.perf_counter() - started
        self.counters["optimizer_wait_s"] += waited
        self.counters[f"optimizer_wait_s_{self.phase}"] += waited

    def collect(self, handle: cpu_adam.CPUAdamHandle, counter: str) -> None:
        """Wait for a job this optimizer is done with and count the time it ran in the pool."""
        self.wait(handle)
        self.counters[counter] += handle.seconds()

    def queue_sums(
        self,
        sums: list[torch.Tensor],
        rows: list[torch.Tensor | cpu_adam.GatheredRows],
        releases: list[Callable[[], None]],
        scale: float,
    ) -> None:
        """``sums[i] += scale * rows[i]`` on the pool; ``releases`` run once it is done."""
        self.background()
        handle = cpu_adam.submit_accumulate(sums, rows, scale=scale)
        self._sums.append(_QueuedSums(handle, releases))

    def finish_sums(self, keep: int = 0) -> None:
        """Wait until at most ``keep`` additions are still queued (the oldest finish first)
        and give their blocks back; finished ones beyond that are collected without waiting."""
        while self._sums:
            oldest = self._sums[0]
            if len(self._sums) <= keep and not oldest.handle.done():
                return
            self.collect(oldest.handle, "cpu_accumulate_s")
            for release in oldest.releases:
                release()
            self._sums.pop(0)

    def abandon_sums(self) -> None:
        """After a failure: let queued additions end (their results are undefined) without
        raising, so that nothing writes into state loaded next."""
        for queued in self._sums:
            with contextlib.suppress(cpu_adam.CPUAdamError):
                queued.handle.wait()
        self._sums = []
