"""What the GPU check's timing script (``benchmarks/bench_gpu_step.py``) reports from its rows'
records and traces, on records and intervals made here: the device-idle time split by what the
host was doing, and which rows claim a ratio. Only a GPU makes such traces; the arithmetic and
the table are checked here where no GPU is."""

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


def test_the_hosts_time_per_part_is_over_the_steps_inside_a_window(bench_gpu_step, tmp_path):
    """Unprofiled medians of the host's forward, backward (with zenflow's hand-overs in it)
    and step, beside the device's forward+backward: a window's closing step (slow on the host)
    stays out of them."""
    inside = "inside a window"
    record = dict(
        peer="zenflow",
        status="done",
        steps=4,
        median_s=0.07,
        mean_s=0.08,
        step_times_s=[0.07, 0.07, 0.07, 0.2],
        step_kinds=[inside, inside, inside, "window close"],
        host_s=[[0.008, 0.030, 0.012], [0.010, 0.034, 0.010], [0.009, 0.032, 0.011], [1, 1, 1]],
        fwd_bwd_s=[0.05, 0.052, 0.051, 0.5],
        step_counters=[dict(hand_over_s=s) for s in (0.004, 0.006, 0.005, 0.009)],
    )
    (tmp_path / "bench_zenflow.json").write_text(json.dumps(record))
    (tmp_path / "bench_adamw.json").write_text(
        json.dumps(dict(_row("adamw", 0.03, "done", True), host_s=[[0.004, 0.006, 0.002]] * 4))
    )
    table = bench_gpu_step._summarize(argparse.Namespace(out=str(tmp_path)))
    assert (
        "zenflow host ms per step, unprofiled (medians over the 3 steps inside a window): "
        "forward 9.0, backward 32.0, optimizer step 11.0 (of the backward, zenflow's gradient "
        "hand-overs 5.0); forward+backward on the device's clock 51.0\n"
    ) in table
    assert (
        "adamw host ms per step, unprofiled (medians over 4 steps): forward 4.0, backward 6.0, "
        "optimizer step 2.0\n"
    ) in table


def _row(peer: str, mean_s: float, status: str, timings_valid: bool) -> dict:
    return dict(
        peer=peer,
        status=status,
        steps=4,
        median_s=mean_s,
        mean_s=mean_s,
        step_times_s=[mean_s] * 4,
        timings_valid=timings_valid,
    )


def _ratios(bench_gpu_step, out, *rows: dict) -> dict[str, str]:
    """The table's last column by row, from the rows' records written as a GPU run does."""
    for record in rows:
        (out / f"bench_{record['peer']}.json").write_text(json.dumps(record))
    table = bench_gpu_step._summarize(argparse.Namespace(out=str(out)))
    cells = [line.strip("| ").split(" | ") for line in table.splitlines() if line.startswith("| ")]
    return {cell[0]: cell[-1] for cell in cells if cell[0] not in ("row", "---")}


def test_a_row_cut_short_while_profiling_keeps_its_ratio_and_one_that_failed_its_check_has_none(
    bench_gpu_step, tmp_path
):
    """A row's ratio to zenflow comes from its timed steps once they are checked: a row cut by
    its stage's limit while it was being profiled keeps it; a zenflow row whose timed steps
    did not do zenflow's work (recorded, then failed) claims none, for itself or the others."""
    cut = _row("zenflow", 0.04, "cut at 75s after 'timed'", timings_valid=True)
    adamw = _row("adamw", 0.03, "done", timings_valid=True)
    unchecked = _row("zenflow-hostsum", 0.05, "failed", timings_valid=False)
    ratios = _ratios(bench_gpu_step, tmp_path, cut, adamw, unchecked)
    assert ratios == {"zenflow": "1.00x", "adamw": "0.75x", "zenflow-hostsum": "n/a"}
    failed = dict(cut, status="failed", timings_valid=False)
    ratios = _ratios(bench_gpu_step, tmp_path, failed)
    assert ratios == {"zenflow": "n/a", "adamw": "n/a", "zenflow-hostsum": "n/a"}
