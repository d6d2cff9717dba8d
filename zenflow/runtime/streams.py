"""Device-to-host copies that overlap with compute, behind one interface for CUDA and CPU.

CUDA: ``copy_to_host`` snapshots the source on the current stream (a device-side copy, ordered
before any later compute that may reuse the source's buffer, as compiled graphs do; skipped for
a source the caller owns), then copies the snapshot to pinned host memory on a side stream; ``wait()`` synchronizes on that copy's
event, so the transfer overlaps with the rest of the backward pass.

CPU: the device is the host, so the snapshot is the transfer and ``wait()`` has nothing to wait
for; the runtime's code is the same either way, which is what lets it be tested on CPU.

``out``: a host buffer to copy into (pinned, for CUDA), reused from step to step: a fresh
allocation of this size costs more in page faults than the copy itself.
"""

import functools

import torch


class PendingCopy:
    """A host tensor that is complete once ``wait()`` returns."""

    def __init__(self, host: torch.Tensor, event=None):
        self._host = host
        self._event = event

    def wait(self) -> torch.Tensor:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host


class CopyStream:
    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def copy_to_host(
        self, source: torch.Tensor, out: torch.Tensor | None = None, owned: bool = False
    ) -> PendingCopy:
        """``owned``: the caller hands ``source`` over (it made it, and nothing will write it
        again), so no snapshot is taken; the copy keeps it alive until done."""
        if self._stream is None:
            if out is None:
                return PendingCopy(source.to("cpu", copy=True))
            return PendingCopy(out.copy_(source))
        snapshot = source if owned else source.clone()
        host = out if out is not None else torch.empty_like(source, device="cpu", pin_memory=True)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            host.copy_(snapshot, non_blocking=True)
            snapshot.record_stream(self._stream)
            event = torch.cuda.Event()
            event.record(self._stream)
        return PendingCopy(host, event)


@functools.cache
def copy_stream(device: torch.device) -> CopyStream:
    """The process's copy stream for ``device`` (one side stream per device is enough)."""
    return CopyStream(device)
