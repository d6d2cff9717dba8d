"""The one place where the training thread waits for a device or reads a value a device
computed.

[Note: counted synchronizations] Each such point is a round trip: the host stops queueing work
until the device has caught up, and a device that runs ahead of its host by less than a step
idles meanwhile. A step's cost in them is a number (``stats()["device_syncs"]``) that tests
hold to a budget per kind of step. Every call here counts one, whatever the device, so the
count is the same on a CPU-only machine (where the reads cost nothing) as on a GPU: a test
there sees the budget a GPU run would. One call may read several tensors or wait for several
copies: the first read or wait holds the host until the device has done everything queued
before it, so the rest cost no further round trip.

On a GPU, ``torch.cuda.set_sync_debug_mode("error")`` makes any other synchronization raise;
the calls here lift it for their own duration.
"""

import contextlib
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TypeVar

import torch

T = TypeVar("T")


class HostSync:
    """Owns the count (``count``) of one optimizer's synchronizations and when the last one
    returned (``last_return``, ``time.perf_counter()``; None before the first): from then on
    the device has only what the host queues next to run."""

    def __init__(self):
        self.count = 0
        self.last_return: float | None = None

    @contextlib.contextmanager
    def _one(self):
        # A profiler range of its own: a trace shows the device idling while the host waits
        # here apart from the host's work around it.
        self.count += 1
        try:
            with torch.profiler.record_function("zenflow::wait_for_device"):
                # Not started, no CUDA work to wait for: reading the debug mode would start
                # CUDA (a context on GPU 0 for a CPU-only run, an error in a forked child).
                if not torch.cuda.is_initialized():
                    yield
                    return
                mode = torch.cuda.get_sync_debug_mode()
                torch.cuda.set_sync_debug_mode(0)
                try:
                    yield
                finally:
                    torch.cuda.set_sync_debug_mode(mode)
        finally:
            self.last_return = time.perf_counter()

    def values(self, tensors: Sequence[torch.Tensor], copies: Sequence = ()) -> list:
        """Every tensor's value as Python numbers (``tolist``: a 0-d tensor gives a number),
        in one synchronization; it also waits for every copy issued on the ``copies``
        streams (``zenflow.runtime.streams.CopyStream``), which finish about when the
        tensors' values are computed."""
        with self._one():
            values = [t.tolist() for t in tensors]
            for stream in copies:
                self._wait_for(stream.latest())
            return values

    @staticmethod
    def host_values(tensor: torch.Tensor) -> list:
        """A host tensor's values as Python numbers (a read of host memory, which waits for
        no device: not counted)."""
        if tensor.device.type != "cpu":
            raise ValueError(f"host_values of a tensor on {tensor.device}: use values()")
        return tensor.tolist()

    def around(self, call: Callable[[], T]) -> T:
        """``call()``'s result, in one synchronization: for a library call that waits for a
        device and reads its result itself (``torch.distributed.all_gather_object``)."""
        with self._one():
            return call()

    def to_host(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors on the host, in one synchronization."""
        with self._one():
            return [t.cpu() for t in tensors]

    def wait(self, mark: "torch.cuda.Event | list[Future] | None") -> None:
        """Wait for copies: a CUDA event, or the CPU copy worker's jobs."""
        with self._one():
            self._wait_for(mark)

    @staticmethod
    def wait_off_the_training_thread(mark: "torch.cuda.Event | Future | None") -> None:
        """Wait for one copy on a thread of zenflow's own (the copy stream's host thread):
        the training thread goes on queueing work meanwhile, so nothing is counted."""
        HostSync._wait_for([mark] if isinstance(mark, Future) else mark)

    @staticmethod
    def _wait_for(mark) -> None:
        if isinstance(mark, list):
            for job in mark:
                job.result()
        elif mark is not None:
            mark.synchronize()
