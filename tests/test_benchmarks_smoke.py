"""The benchmark scripts still run: each one with --quick, in a subprocess, prints its table.

Nothing here is timed against a threshold; the scripts only print tables.
"""

import gzip
import json
import os
import select
import subprocess
import sys

from tests.python_process import ROOT, stdout_of
from zenflow.runtime import core_binding, cpu_adam


def _run(script: str, *args: str) -> str:
    return stdout_of([str(ROOT / "benchmarks" / script), "--quick", *args], timeout_s=900)


def test_bench_step_quick():
    out = _run("bench_step.py")
    assert "median step" in out and "zenflow / row" in out
    assert "\nzenflow " in out
    (positions,) = [line for line in out.splitlines() if "position in the select cycle" in line]
    assert positions.startswith("zenflow ms by position") and " 7: " in positions


def test_bench_accuracy_quick(tmp_path):
    """After test_bench_step_quick: DeepSpeed's CPU Adam is built by then."""
    out = _run("bench_accuracy.py", "--out-dir", str(tmp_path))
    report = json.loads((tmp_path / "bench_accuracy.json").read_text())
    assert set(report) == {"fine-tune", "char-lm", "classify"}
    assert (tmp_path / "bench_accuracy.png").read_bytes().startswith(b"\x89PNG")
    for name, task in report.items():
        assert f"## {name}: held-out loss, AdamW {task['adamw']['loss']:.4f}" in out
        (zenflow,) = task["rows"]["zenflow"]
        (deepspeed,) = task["rows"]["ds-zenflow"]
        assert "error" not in deepspeed, deepspeed
        assert zenflow["settings"] == deepspeed["settings"]
        cells = [
            f"{r['loss']:.4f} {r['loss'] / task['adamw']['loss']:.3f}x"
            for r in (zenflow, deepspeed)
        ]
        row = next(
            line
            for line in out.splitlines()
            if line.startswith("topk 0.1 / every 4") and cells[0] in line
        )
        assert cells[1] in row
        # Same weights, same batches, other optimizers: every row lands elsewhere.
        assert len({task["adamw"]["loss"], zenflow["loss"], deepspeed["loss"]}) == 3


def test_bench_compile_overhead_quick():
    out = _run("bench_compile_overhead.py")
    assert "## backward" in out and "ratio" in out and "page faults" in out
    control = next(line for line in out.splitlines() if "(control)" in line)
    assert control.split()[-1].endswith("x")  # the control's ratio is printed
    assert "step kind" in out and "select boundary" in out
    assert "## host time added per weight" in out
    alone = _run("bench_compile_overhead.py", "--hand-over-only", "--device", "cpu")
    assert "## host time added per weight" in alone and "## backward" not in alone


def test_bench_demo_gap_quick():
    out = _run("bench_demo_gap.py")
    assert "of the squared gradient norm" in out
    rows = {line[:40].strip(): line.split()[-1] for line in out.splitlines() if "%" in line[40:]}
    assert rows["AdamW"] == "+0.0%"
    assert {"AdamW, parameters 1 step(s) stale", "zenflow, the demo's settings"} <= set(rows)


def test_bench_auto_interval_quick(tmp_path):
    out = _run("bench_auto_interval.py", "--plot", str(tmp_path / "auto.png"))
    assert (tmp_path / "auto.png").read_bytes().startswith(b"\x89PNG")
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line[:1].isdigit()}
    assert set(rows) == {"2", "4", "8"}
    assert int(rows["2"][0]) == 2 * int(rows["4"][0])  # a fixed interval's update count
    assert rows["8"][1] != rows["8"][2]  # auto's step size changed the same windows' loss
    assert out.count("against the curves at") == 2 and out.count("criterion") == 2


def test_bench_host_ops_quick():
    out = _run("bench_host_ops.py", "--threads", "2", "--width", "16")
    assert "2 thread(s)" in out and "x Linear(16, 16)" in out
    assert "## float32: operations per layer" in out
    for row in ("zenflow device sums", "zenflow host sums", "torch adamw foreach"):
        assert any(line.startswith(row) for line in out.splitlines()), row
    # zenflow's rows, a second time: their hand-overs and host time after the synchronization.
    assert "in the backward's hand-overs" in out
    timed = [line.split() for line in out.splitlines() if line.startswith("zenflow device sums")]
    assert float(timed[-1][3]) > 0  # hand-overs, per layer


def test_bench_contention_quick():
    """The training thread's cost per operation with the pool idle, and for each share of the
    cores kept from it, pinned as bind_cores pins it (where this machine's cores can be split)
    and unpinned, each busy way with the pool's rate over the passes that ran beside it."""
    out = _run("bench_contention.py", "--device", "cpu", "--reserved", "0.5,0.9")
    record = json.loads(out.splitlines()[-1])
    expected = ["pool idle"]
    for share in (0.5, 0.9):
        unpinned = cpu_adam.threads_from_reserved_cores(share)
        pinned = core_binding.place_pool(share, True).cpus
        if pinned is not None:
            expected.append(f"{share} pinned, threads {len(pinned)}")
        expected.append(f"{share} unpinned, threads {unpinned}")
    assert [row["way"] for row in record["rows"]] == expected
    for row in record["rows"]:
        assert row["launch_us"] > 0 and row["python_us"] > 0
        assert (row["pool_gb_s"] is None) == (row["way"] == "pool idle")
        assert any(line.startswith(row["way"]) for line in out.splitlines())


def test_bench_write_back_quick():
    out = _run("bench_write_back.py", "--threads", "1")
    assert "1 torch threads" in out
    rows = [line.split()[0:2] for line in out.splitlines()]
    for row in (
        "zenflow unselected",
        "zenflow close",
        "zenflow selected",
        "zenflow gather",
        "torch index_copy_",
    ):
        assert row.split() in rows, row
    (floor,) = [line for line in out.splitlines() if line.startswith("torch copy (floor)")]
    assert floor.split()[-2:] == ["1.00x", "1.00x"]


def test_bench_gpu_step_quick_on_cpu(tmp_path):
    """The GPU check's timing script, its zenflow row and the peer without offload, through
    the same code on the CPU: the zenflow row checks that its timed steps did zenflow's work
    (a select cycle: two CPU updates, one reselection) and the table reports its CPU pass per
    window against the window's time, the host's time after each step's synchronization, and
    its slowest steps (timed, and of the warm-up) split into what the host knows of them; a
    trace of a step is kept; the device update's backend and core binding are the ones asked
    for.
    (The zenflow-hostsum row differs only on a GPU: on the CPU "auto" keeps the sums on the
    host too.)"""
    rows = ("zenflow", "adamw")
    out = _run(
        "bench_gpu_step.py",
        *("--device", "cpu", "--out", str(tmp_path), "--peers", ",".join(rows)),
        *("--trace-steps", "1", "--pt-reserved-cores-perc", "0.75", "--step-backend", "inductor"),
        "--no-bind-cores",
    )
    table = (tmp_path / "bench.md").read_text()
    assert table in out
    for row in rows:
        record = json.loads((tmp_path / f"bench_{row}.json").read_text())
        assert record["status"] == "done", record.get("error")
        assert f"\n| {row} | done |" in table
    zenflow_row = json.loads((tmp_path / "bench_zenflow.json").read_text())
    assert zenflow_row["settings"]["pt_reserved_cores_perc"] == 0.75
    assert zenflow_row["settings"]["bind_cores"] is False
    assert zenflow_row["settings"]["cpu_pool_cpus"] == []  # the pool's workers on any core
    assert zenflow_row["settings"]["step_backend"] == "inductor"  # asked for, over --quick's eager
    (work,) = [line for line in table.splitlines() if line.startswith("zenflow over the timed")]
    assert "cpu_updates 2, reselections 1" in work
    assert "CPU pass per window" in work and "(update_interval x mean step)" in work
    assert "host time in step() after the step's synchronization" in work
    # The slowest steps, split: a slow step is found from one lease's results.
    (slowest,) = [line for line in table.splitlines() if line.startswith("zenflow slowest timed")]
    assert slowest.count("host after the sync") == 3
    assert slowest.count("garbage collection") == 3
    # And the slowest warm-up steps after the compiling one: a cost of the first windows only.
    (warmup,) = [line for line in table.splitlines() if line.startswith("zenflow slowest warm")]
    assert warmup.count("garbage collection") == 3 and "#0 " not in warmup
    # The host's time per part of a step, unprofiled, for every row.
    for row in rows:
        assert f"\n{row} host ms per step, unprofiled (medians over " in table
    # The kept trace, with the step's two halves marked, for reading a GPU's gaps offline.
    with gzip.open(tmp_path / "trace_zenflow.json.gz") as f:
        names = {event.get("name") for event in json.load(f)["traceEvents"]}
    assert {"bench::forward_backward", "bench::step", "zenflow::stage_matmul"} <= names


def test_a_benchmark_writes_each_line_to_a_pipe_as_it_prints_it():
    """Redirected to a log file or a pipe, a long run shows its rows as they come, not all at
    exit: the header of a run that would take many minutes arrives within seconds."""
    script = ROOT / "benchmarks" / "bench_host_ops.py"
    long_run = ["--layers", "8", "--dtype", "fp32", "--cycles", "100000"]
    # As a user's shell has it: Python's own default, a block buffer for a pipe or a file.
    environment = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    environment["PYTHONPATH"] = str(ROOT)
    process = subprocess.Popen(
        [sys.executable, str(script), *long_run],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
        env=environment,
    )
    try:
        ready, _, _ = select.select([process.stdout], [], [], 60)
        first = process.stdout.readline() if ready else b""
        assert process.poll() is None, "the run ended: it cannot show whether lines stream"
    finally:
        process.kill()
        process.wait()
    assert first.startswith(b"# bench_host_ops"), first
