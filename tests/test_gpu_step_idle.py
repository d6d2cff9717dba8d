"""The GPU check's split of device-idle time by what the host was doing
(``benchmarks/bench_gpu_step.py``), on a synthetic trace: its inputs are plain intervals, so
the arithmetic is checked here where no GPU is."""

import argparse
import importlib.util
import json

import pytest

from tests.python_process import ROOT


@pytest.fixture(scope="module")
def bench_gpu_step():
    spec = importlib.util.spec_from_file_location(
        "bench_gpu_step", ROOT / "benchmarks" / "bench_gpu_step.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_idle_time_goes_to_the_innermost_open_range(bench_gpu_step):
    """Kernels at 10-20, 15-30 and 50-60 of a 0-110 span leave 0-10, 30-50 and 60-110 idle;
    the step's range (0-100) holds a phase (5-40) that holds a wait (35-38)."""
    kernels = [(15, 30), (10, 20), (50, 60)]
    ranges = [(0, 100, "step"), (5, 40, "phase"), (35, 38, "wait")]
    idle = bench_gpu_step._idle_by_range(kernels, ranges, (0, 110))
    assert idle == {"step": 5 + 10 + 40, "phase": 5 + 5 + 2, "wait": 3, "no range": 10}


def test_ranges_of_two_threads_that_overlap_count_the_later_one_until_it_ends(bench_gpu_step):
    """A range that ends inside one opened after it (another thread's) stops counting when it
    ends; what is left of the later one counts to it; a device that is never busy idles
    throughout."""
    ranges = [(10, 30, "first"), (20, 40, "second")]
    idle = bench_gpu_step._idle_by_range([], ranges, (0, 50))
    assert idle == {"no range": 10 + 10, "first": 10, "second": 20}


def test_a_device_busy_throughout_has_no_idle_time(bench_gpu_step):
    idle = bench_gpu_step._idle_by_range([(-5, 20), (20, 60)], [(0, 50, "step")], (0, 50))
    assert idle == {}


def test_the_table_reports_each_rows_idle_split_largest_first(bench_gpu_step, tmp_path):
    """As a GPU run writes it: a row's split into its JSON file, the table from the files."""
    record = dict(
        peer="adamw",
        status="done",
        steps=4,
        median_s=0.03,
        mean_s=0.03,
        step_times_s=[0.03] * 4,
        phases=dict(device_idle_ms={"bench::step": 1.25, "bench::forward_backward": 7.5}),
    )
    (tmp_path / "bench_adamw.json").write_text(json.dumps(record))
    failed = dict(record, peer="zenflow", phases=dict(device_idle_error="KeyError: 'ts'"))
    (tmp_path / "bench_zenflow.json").write_text(json.dumps(failed))
    table = bench_gpu_step._summarize(argparse.Namespace(out=str(tmp_path)))
    assert (
        "adamw device idle ms per step by the host range open at the time (profiled with CPU "
        "activity, innermost range): bench::forward_backward 7.5, bench::step 1.2\n"
    ) in table
    assert "zenflow device idle by host range failed: KeyError: 'ts'\n" in table
