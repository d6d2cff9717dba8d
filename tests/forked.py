"""Running a test's piece of work in a forked child, as a data-loader worker would be."""

import multiprocessing

import pytest


def result_in_forked_child(target, doing: str, timeout_s: float = 60.0):
    """``target(queue)`` in a forked child; returns the one small value it puts on the queue.
    Fails the test if the child hangs (``doing``: what it was doing) or dies."""
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=target, args=(queue,))
    child.start()
    child.join(timeout_s)
    if child.is_alive():
        child.kill()
        pytest.fail(f"the forked child hung in {doing}")
    assert child.exitcode == 0, f"the forked child died in {doing} (exit code {child.exitcode})"
    return queue.get(timeout=5)
