"""Device-to-host copies: the result is independent of later writes to the source."""

import torch

from zenflow.runtime.streams import CopyStream, copy_stream


def test_copy_to_host_snapshots_the_source():
    source = torch.arange(12.0).reshape(3, 4)
    pending = CopyStream(torch.device("cpu")).copy_to_host(source)
    source.zero_()  # a compiled graph reusing the buffer right after the hand-off
    host = pending.wait()
    assert host.device.type == "cpu"
    assert torch.equal(host, torch.arange(12.0).reshape(3, 4))


def test_one_copy_stream_per_device():
    assert copy_stream(torch.device("cpu")) is copy_stream(torch.device("cpu"))
