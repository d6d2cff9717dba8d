"""Fixtures shared by test files."""

import pytest

from zenflow.runtime.split_weight import SplitWeight


def _stage_through_the_copy_stream(monkeypatch) -> None:
    monkeypatch.setattr(SplitWeight, "stages_on_host", property(lambda self: False))


@pytest.fixture(params=["host block", "copy stream"])
def staging(request, monkeypatch):
    """How a CPU weight's gradient rows are staged: formed straight into its host block (what
    one process on the CPU does), or handed to the copy stream, which a weight on a GPU does and
    which on the CPU runs on the stream's worker thread."""
    if request.param == "copy stream":
        _stage_through_the_copy_stream(monkeypatch)
    return request.param


@pytest.fixture
def copy_stream_staging(monkeypatch):
    """A CPU weight's gradient rows staged as a weight on a GPU stages them: through the copy
    stream (its CPU twin, a worker thread)."""
    _stage_through_the_copy_stream(monkeypatch)
