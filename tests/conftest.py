"""Fixtures shared by test files."""

import contextlib
import os

import pytest
import torch

from zenflow.runtime import staging as staging_strategies

# Models are built from configs: nothing may reach for the Hugging Face Hub.
os.environ["HF_HUB_OFFLINE"] = "1"


@contextlib.contextmanager
def _through_the_copy_stream():
    staging_strategies._stage_like_a_gpu_weight_for_tests(True)
    try:
        yield
    finally:
        staging_strategies._stage_like_a_gpu_weight_for_tests(False)


@pytest.fixture(params=["host block", "copy stream"])
def staging(request):
    """How a CPU weight's gradient rows are staged: formed straight into its host block (what
    one process on the CPU does), or handed to the copy stream, which a weight on a GPU does and
    which on the CPU runs on the stream's worker thread."""
    with _through_the_copy_stream() if request.param == "copy stream" else contextlib.nullcontext():
        yield request.param


@pytest.fixture
def copy_stream_staging():
    """A CPU weight's gradient rows staged as a weight on a GPU stages them: through the copy
    stream (its CPU twin, a worker thread)."""
    with _through_the_copy_stream():
        yield


@pytest.fixture
def fresh_dynamo():
    """Compiles from scratch: after the suite's other tests, nn.Sequential's forward may be past
    Dynamo's recompile limit and would silently run eagerly (a file whose tests compile uses it
    for every test: ``pytestmark = pytest.mark.usefixtures("fresh_dynamo")``)."""
    torch._dynamo.reset()
