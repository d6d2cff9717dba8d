"""Copies between device and host that overlap with compute, behind one interface for CUDA and
CPU.

CUDA: ``copy_to_host`` snapshots the source on the current stream (a device-side copy, ordered
before any later compute that may reuse the source's buffer, as compiled graphs do; skipped for
a source the caller owns), then copies the snapshot to pinned host memory on a side stream;
``wait()`` synchronizes on that copy's event, so the transfer overlaps with the rest of the
backward pass.

CPU: the device is the host. A source the caller owns is copied by the stream's worker thread
(the side stream's twin, one copy after another in the order issued), and ``wait()`` joins that
copy; any other source is copied at once, which is its snapshot and its transfer in one. The
runtime's code is the same either way, so its overlap logic runs, and is tested, on CPU.

``out``: a host buffer to copy into (pinned, for CUDA), reused from step to step: a fresh
allocation of this size costs more in page faults than the copy itself.

``copy_to_device``: the updated parameters' way back. CUDA: from a pinned host buffer, on the
side stream, with the current stream made to wait for it on the device; the host buffer is free
again once the returned copy's ``wait()`` returns. CPU: nothing to copy.
"""

import functools
import os
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class PendingCopy:
    """A copy in flight; ``wait()`` returns its host tensor once the copy is done (complete,
    for a copy to the host; free to write again, for one to the device)."""

    def __init__(self, host: torch.Tensor, event=None, job: Future | None = None):
        self._host = host
        self._event = event
        self._job = job

    def wait(self) -> torch.Tensor:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        if self._job is not None:
            self._job.result()
            self._job = None
        return self._host


class CopyStream:
    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._worker = None
        self._worker_pid = None

    def copy_to_host(
        self, source: torch.Tensor, out: torch.Tensor | None = None, owned: bool = False
    ) -> PendingCopy:
        """``owned``: the caller hands ``source`` over (it made it, and nothing will write it
        again), so no snapshot is taken; the copy keeps it alive until done."""
        if self._stream is None:
            if out is None:
                return PendingCopy(source if owned else source.to("cpu", copy=True))
            if not owned:
                return PendingCopy(out.copy_(source))
            return PendingCopy(out, job=self._host_worker().submit(out.copy_, source))
        snapshot = source if owned else source.clone()
        host = out if out is not None else torch.empty_like(source, device="cpu", pin_memory=True)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            host.copy_(snapshot, non_blocking=True)
            snapshot.record_stream(self._stream)
            event = torch.cuda.Event()
            event.record(self._stream)
        return PendingCopy(host, event)

    def copy_to_device(self, source: torch.Tensor) -> tuple[torch.Tensor, PendingCopy]:
        """``source`` (host) on the device, for work queued on the current stream from now on,
        and a ``PendingCopy`` whose ``wait()`` tells when ``source`` may be written again.

        CUDA: ``source`` should be pinned (pageable memory makes the copy synchronous). The copy
        runs on the side stream, so it overlaps with work queued before the call; the current
        stream waits for it on the device, the host thread not at all. CPU: ``source`` itself,
        as the device is the host."""
        if self._stream is None:
            return source, PendingCopy(source)
        current = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._stream):
            # Allocated on the side stream: a block the current stream's queued work still uses
            # cannot be handed out for it.
            device_copy = torch.empty_like(source, device=self.device)
            device_copy.copy_(source, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        current.wait_event(event)
        device_copy.record_stream(current)
        return device_copy, PendingCopy(source, event)

    def _host_worker(self) -> ThreadPoolExecutor:
        """The CPU twin of the side stream, started on first use; a forked child (a data-loader
        worker) starts its own, since the parent's thread does not exist there."""
        if self._worker is None or self._worker_pid != os.getpid():
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zenflow-copy")
            self._worker_pid = os.getpid()
        return self._worker


@functools.cache
def copy_stream(device: torch.device) -> CopyStream:
    """The process's copy stream for ``device`` (one side stream per device is enough)."""
    return CopyStream(device)
