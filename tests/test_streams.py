"""Device-to-host copies: the result is independent of later writes to the source, and on CPU
a source handed over is copied by the stream's worker thread."""

import threading

import pytest
import torch

from tests.forked import result_in_forked_child
from tests.python_process import stdout_of
from zenflow.runtime.host_sync import HostSync
from zenflow.runtime.streams import CopyStream, copy_stream, sent_to


def test_copy_to_host_snapshots_the_source():
    source = torch.arange(12.0).reshape(3, 4)
    pending = CopyStream(torch.device("cpu")).copy_to_host(source)
    source.zero_()  # a compiled graph reusing the buffer right after the hand-off
    host = pending.wait(HostSync())
    assert host.device.type == "cpu"
    assert torch.equal(host, torch.arange(12.0).reshape(3, 4))


def test_one_copy_stream_per_device():
    assert copy_stream(torch.device("cpu")) is copy_stream(torch.device("cpu"))


def test_an_owned_source_is_copied_by_the_worker_thread_in_order():
    stream = CopyStream(torch.device("cpu"))
    out = torch.empty(256, 256)
    copied_by = []

    class Recording(torch.Tensor):
        """A source whose copy records which thread read it."""

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            copied_by.append(threading.current_thread().name)
            return super().__torch_function__(func, types, args, kwargs or {})

    first = torch.full((256, 256), 1.0).as_subclass(Recording)
    second = torch.full((256, 256), 2.0).as_subclass(Recording)
    pending = [stream.copy_to_host(s, out=out, owned=True) for s in (first, second)]
    assert pending[-1].wait(HostSync()) is out
    assert torch.equal(out.as_subclass(torch.Tensor), torch.full((256, 256), 2.0))
    assert copied_by and all(name.startswith("zenflow-copy") for name in copied_by)


def test_a_failed_copy_raises_at_wait():
    stream = CopyStream(torch.device("cpu"))
    pending = stream.copy_to_host(torch.ones(3, 4), out=torch.empty(4, 3), owned=True)
    with pytest.raises(RuntimeError, match="size"):
        pending.wait(HostSync())


def _copy_in_child(queue):
    out = torch.empty(64, 64)
    copied = (
        copy_stream(torch.device("cpu"))
        .copy_to_host(torch.ones(64, 64), out, True)
        .wait(HostSync())
    )
    queue.put(copied.sum().item())


def test_a_forked_child_copies_with_its_own_worker():
    stream = copy_stream(torch.device("cpu"))
    stream.copy_to_host(torch.ones(8), out=torch.empty(8), owned=True).wait(
        HostSync()
    )  # parent's thread
    assert result_in_forked_child(_copy_in_child, "a copy") == 64 * 64


def test_copy_to_device_on_cpu_is_the_source():
    source = torch.arange(6.0)
    on_device, pending = CopyStream(torch.device("cpu")).copy_to_device(source)
    assert on_device is source and pending.wait(HostSync()) is source


@pytest.mark.parametrize("copy", ["to host", "to host, owned", "to host, into out", "to device"])
def test_waiting_for_any_copy_counts_one_synchronization_as_on_a_gpu(copy):
    """A copy the CPU twin makes at once (or needs not make) is still issued: waiting for it
    counts where waiting for a GPU's copy does, so that CPU tests see a GPU's count."""
    stream = CopyStream(torch.device("cpu"))
    source = torch.arange(6.0)
    if copy == "to device":
        _, pending = stream.copy_to_device(source)
    else:
        out = torch.empty(6) if copy == "to host, into out" else None
        pending = stream.copy_to_host(source, out=out, owned=copy == "to host, owned")
    sync = HostSync()
    assert torch.equal(pending.wait(sync), source)
    pending.wait(sync)
    assert sync.count == 1


def test_one_wait_covers_every_copy_issued_before_it():
    """The copies run in the order issued: the first wait waits for the latest one, once, and
    the others are then known done; a copy issued after it takes a wait of its own."""
    stream = CopyStream(torch.device("cpu"))
    sync = HostSync()
    sources = [torch.full((64, 64), float(i)) for i in range(3)]
    pending = [stream.copy_to_host(s, out=torch.empty(64, 64), owned=True) for s in sources]
    landed = [copy.wait(sync) for copy in pending]
    assert sync.count == 1
    assert all(torch.equal(out, source) for out, source in zip(landed, sources, strict=True))
    later = stream.copy_to_host(sources[0], out=torch.empty(64, 64), owned=True)
    later.wait(sync)
    pending[0].wait(sync)
    assert sync.count == 2


def test_a_failed_copy_raises_at_the_wait_that_covers_it():
    stream = CopyStream(torch.device("cpu"))
    failing = stream.copy_to_host(torch.ones(3, 4), out=torch.empty(4, 3), owned=True)
    fine = stream.copy_to_host(torch.ones(4), out=torch.empty(4), owned=True)
    with pytest.raises(RuntimeError, match="size"):
        fine.wait(HostSync())
    assert failing.wait(HostSync()) is not None  # known done since: no second raise


_THREADS_AFTER_A_WORKER_COPY = """
import os, torch
from zenflow.runtime.host_sync import HostSync
from zenflow.runtime.streams import CopyStream

torch.set_num_threads(2)
torch.ones(1 << 22).mul_(2)  # the training thread's own OpenMP team, started
before = len(os.listdir("/proc/self/task"))
source = torch.arange(float(1 << 22))
out = torch.empty_like(source)
stream = CopyStream(torch.device("cpu"))  # kept: its worker ends with it
stream.copy_to_host(source, out=out, owned=True).wait(HostSync())
assert torch.equal(out, torch.arange(float(1 << 22)))
print(len(os.listdir("/proc/self/task")) - before)
"""


def test_the_worker_copies_without_a_second_openmp_team():
    """[Note: OpenMP teams] in streams.py: a large copy on the worker starts the worker and no
    thread besides it (torch's copy there would start a second OpenMP team, which slows every
    later parallel operation of the training thread)."""
    started = stdout_of(["-c", _THREADS_AFTER_A_WORKER_COPY], timeout_s=120)
    assert started.split() == ["1"]


def test_the_worker_refuses_a_copy_between_dtypes():
    stream = CopyStream(torch.device("cpu"))
    pending = stream.copy_to_host(
        torch.ones(8), out=torch.empty(8, dtype=torch.bfloat16), owned=True
    )
    with pytest.raises(RuntimeError, match="one size and dtype"):
        pending.wait(HostSync())


def test_a_host_tensor_crosses_to_a_device_once_while_it_lives():
    """A reselection sends each row index for every state tensor it moves: the index
    crosses once ("meta" stands for a device here: a copy to it is made, not shared)."""
    index = torch.arange(6)
    sent = sent_to(index, torch.device("meta"))
    assert sent.device.type == "meta" and sent.shape == (6,)
    assert sent_to(index, "meta") is sent
    assert sent_to(torch.arange(6), "meta") is not sent  # another tensor: its own copy
    assert sent_to(index, "cpu") is index  # already there
