"""Fixtures shared by test files."""

import pytest

from zenflow.runtime.split_weight import SplitWeight


@pytest.fixture(params=["host block", "copy stream"])
def staging(request, monkeypatch):
    """How a CPU weight's gradient rows are staged: formed straight into its host block (what
    one process on the CPU does), or handed to the copy stream, which a weight on a GPU does and
    which on the CPU runs on the stream's worker thread."""
    if request.param == "copy stream":
        monkeypatch.setattr(SplitWeight, "stages_on_host", property(lambda self: False))
    return request.param
