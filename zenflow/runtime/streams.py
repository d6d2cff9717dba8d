"""Copies between device and host that overlap with compute, behind one interface for CUDA and
CPU.

CUDA: ``copy_to_host`` snapshots the source on the current stream (a device-side copy, ordered
before any later compute that may reuse the source's buffer, as compiled graphs do; skipped for
a source the caller owns), then copies the snapshot to pinned host memory on a side stream;
``wait()`` returns once that copy is done, so the transfer overlaps with the rest of the
backward pass.

CPU: the device is the host. A source the caller owns is copied by the stream's worker thread
(the side stream's twin, one copy after another in the order issued, each a plain ``memmove``:
see [Note: OpenMP teams]), and ``wait()`` joins that copy; any other source is copied at once, which is its snapshot and its transfer in one. Every
copy is issued on the twin all the same, so waiting for it counts one synchronization exactly
where waiting for a GPU's copy does. The runtime's code is the same either way, so its overlap
logic and its synchronizations run, and are tested, on CPU.

``out``: a host buffer to copy into (pinned, for CUDA), reused from step to step: a fresh
allocation of this size costs more in page faults than the copy itself.

``copy_to_device``: the updated parameters' way back. CUDA: from a pinned host buffer, on the
side stream, with the current stream made to wait for it on the device; the host buffer is free
again once the returned copy's ``wait()`` returns. CPU: nothing to copy (issued all the same).

Waiting is one synchronization (``zenflow.runtime.host_sync``) for every copy issued so far:
the side stream (and its CPU twin) runs its copies in the order issued, so the host waits for
the latest one, and every copy before it is done too (on the CPU twin: every job not yet
waited for, so that a failed copy raises whichever wait covers it). Waiting for a copy already
known done costs none.
"""

import ctypes
import functools
import os
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch.utils.weak import WeakIdKeyDictionary

from zenflow.runtime.host_sync import HostSync


class PendingCopy:
    """A copy in flight, the ``seq``-th on its stream (none: done when made), and what marks
    its end (its event, or its job on the CPU twin); ``wait(sync)`` returns its host tensor
    once the copy is done (complete, for a copy to the host; free to write again, for one to
    the device)."""

    def __init__(
        self,
        host: torch.Tensor,
        stream: "CopyStream | None" = None,
        seq: int = 0,
        mark: "torch.cuda.Event | Future | None" = None,
    ):
        self._host = host
        self._stream = stream
        self._seq = seq
        self._mark = mark

    def wait(self, sync: HostSync) -> torch.Tensor:
        if self._stream is not None:
            self._stream.wait_through(self._seq, sync)
            self._stream = None
        return self._host

    def landed(self) -> torch.Tensor:
        """``wait`` for a thread other than the training thread (the stream's host thread,
        ``CopyStream.on_host_thread``): waits for this copy alone, uncounted."""
        HostSync.wait_off_the_training_thread(self._mark)
        return self._host


class CopyStream:
    """Owns a device's side stream (or, for the CPU, its worker thread), its host thread (the
    CPU's worker; on CUDA a thread where work waits for copies off the training thread), the
    number of copies issued on it (``issued``), how many of them are known done
    (``done_through``), and what waiting for the rest takes: the latest copy's event, or the
    worker's jobs not yet waited for."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._worker = None
        self._worker_pid = None
        self.issued = 0
        self.done_through = 0
        self._latest: torch.cuda.Event | list[Future] | None = None

    def _issue(self, mark: "torch.cuda.Event | Future") -> int:
        self.issued += 1
        if isinstance(mark, Future):
            self._latest = [*(self._latest or []), mark]
        else:
            self._latest = mark
        return self.issued

    def wait_through(self, seq: int, sync: HostSync) -> None:
        """Return once copy ``seq`` is done: at once if it is known done, else after one
        synchronization with the latest copy issued (counted alike on every device, whether or
        not the copy happened to be done already)."""
        if seq <= self.done_through:
            return
        sync.wait(self.latest())

    def latest(self) -> "torch.cuda.Event | list[Future] | None":
        """What to wait for (the latest copy's event, or the worker's jobs), None if every
        copy is known done; the caller waits for it, after which every copy issued so far is
        known done."""
        latest, self._latest = self._latest, None
        self.done_through = self.issued
        return latest

    def copy_to_host(
        self, source: torch.Tensor, out: torch.Tensor | None = None, owned: bool = False
    ) -> PendingCopy:
        """``owned``: the caller hands ``source`` over (it made it, and nothing will write it
        again), so no snapshot is taken; the copy keeps it alive until done."""
        if self._stream is None:
            if owned and out is not None:
                job = self._host_worker().submit(_copy_bytes, out, source)
                return PendingCopy(out, self, self._issue(job), job)
            # Copied now (a source the caller keeps may change after the call) or not at all
            # (an owned source is its own copy), but issued all the same: waiting for it then
            # counts where a GPU's wait does.
            if owned:
                host = source
            elif out is None:
                host = source.to("cpu", copy=True)
            else:
                host = out.copy_(source)
            done = _done()
            return PendingCopy(host, self, self._issue(done), done)
        snapshot = source if owned else source.clone()
        host = out if out is not None else torch.empty_like(source, device="cpu", pin_memory=True)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            host.copy_(snapshot, non_blocking=True)
            snapshot.record_stream(self._stream)
            event = _copy_event()
            event.record(self._stream)
        return PendingCopy(host, self, self._issue(event), event)

    def copy_to_device(self, source: torch.Tensor) -> tuple[torch.Tensor, PendingCopy]:
        """``source`` (host) on the device, for work queued on the current stream from now on,
        and a ``PendingCopy`` whose ``wait()`` tells when ``source`` may be written again.

        CUDA: ``source`` should be pinned (pageable memory makes the copy synchronous). The copy
        runs on the side stream, so it overlaps with work queued before the call; the current
        stream waits for it on the device, the host thread not at all. CPU: ``source`` itself,
        as the device is the host."""
        if self._stream is None:
            done = _done()
            return source, PendingCopy(source, self, self._issue(done), done)
        current = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._stream):
            # Allocated on the side stream: a block the current stream's queued work still uses
            # cannot be handed out for it.
            device_copy = torch.empty_like(source, device=self.device)
            device_copy.copy_(source, non_blocking=True)
            event = _copy_event()
            event.record(self._stream)
        current.wait_event(event)
        device_copy.record_stream(current)
        return device_copy, PendingCopy(source, self, self._issue(event), event)

    def on_host_thread(self, work) -> Future:
        """Run ``work()`` on the stream's host thread (its CPU twin's worker, which runs it
        after the copies issued before it), where it may wait for copies (``landed``) while
        the training thread goes on; returns its future."""
        if self._stream is not None:
            work = functools.partial(_on_device, self.device, work)
        return self._host_worker().submit(work)

    def _host_worker(self) -> ThreadPoolExecutor:
        """The stream's host thread (the CPU twin of the side stream), started on first use; a
        forked child (a data-loader worker) starts its own, since the parent's thread does not
        exist there."""
        if self._worker is None or self._worker_pid != os.getpid():
            if self._worker is not None:  # forked: the parent's copies are not ours
                self.done_through, self._latest = self.issued, None
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zenflow-copy")
            self._worker_pid = os.getpid()
        return self._worker


def _copy_event() -> "torch.cuda.Event":
    """A copy's end. Blocking: a thread that waits for it sleeps, where it would otherwise spin
    on a core that the CPU pool or the training thread could use, for as long as a step."""
    return torch.cuda.Event(blocking=True)


def _on_device(device: torch.device, work):
    """``work()`` on a thread of zenflow's own with ``device`` current, so that the CUDA calls
    it makes act on that device's context, not the default device's."""
    torch.cuda.set_device(device)
    return work()


def _copy_bytes(out: torch.Tensor, source: torch.Tensor) -> None:
    """``out.copy_(source)`` for two contiguous host tensors of one shape and dtype, as one
    ``memmove`` (the GIL released), for the CPU twin's worker: the copy engine's twin.

    [Note: OpenMP teams] torch's own copy of a large tensor runs on OpenMP threads, and the
    first parallel region a second thread enters gives the process a second team of them.
    Once GNU OpenMP manages more threads than there are cores it stops spinning between
    regions, so every later parallel operation of the training thread waits for its sleeping
    team to wake: on a 2-core machine a 64 x 64 matmul went from 5 to 100 us for the rest of
    the run, after the first window's device-side sums were copied here."""
    if out.shape != source.shape or out.dtype != source.dtype:
        raise RuntimeError(
            f"copy of a {source.dtype} tensor of size {list(source.shape)} into a {out.dtype} "
            f"tensor of size {list(out.shape)}: the copy stream's CPU twin copies between "
            "tensors of one size and dtype"
        )
    if not (out.is_contiguous() and source.is_contiguous()):
        raise RuntimeError("the copy stream's CPU twin copies between contiguous tensors")
    ctypes.memmove(out.data_ptr(), source.data_ptr(), out.numel() * out.element_size())


def _done() -> Future:
    """A CPU twin's copy that was made at once (or needed none)."""
    done = Future()
    done.set_result(None)
    return done


def sent_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor made on the host that nothing writes again (an index, a collective's input),
    on ``device`` for work queued there. To a GPU through pinned memory and without the host
    waiting: a copy from pageable memory, even a non-blocking one, first waits for the
    device's stream. A host tensor crosses once per device, while it lives: a reselection
    sends each of a weight's row indices for every state tensor it moves (four or five), and
    each send is a pinned copy and a transfer on the host's time while the device waits."""
    device = torch.device(device)
    if tensor.device == device:
        return tensor
    if tensor.device.type != "cpu":
        return tensor.to(device)
    copies = _sent_from_host.setdefault(tensor, {})
    sent = copies.get(device)
    if sent is None:
        pinned = tensor.pin_memory() if device.type == "cuda" else tensor
        sent = copies[device] = pinned.to(device, non_blocking=True)
    return sent


# Host tensor (by identity, held weakly) -> device -> its copy there, for ``sent_to``.
_sent_from_host = WeakIdKeyDictionary()


@functools.cache
def copy_stream(device: torch.device) -> CopyStream:
    """The process's copy stream for ``device`` (one side stream per device is enough)."""
    return CopyStream(device)
