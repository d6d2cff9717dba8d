"""``python -m zenflow``: the machine report."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.python_process import ROOT, stdout_of
from zenflow import report
from zenflow.runtime import core_binding, cpu_adam


def test_the_report_says_what_this_machine_runs_with():
    out = stdout_of(["-m", "zenflow"], timeout_s=120)
    mask = os.sched_getaffinity(0)
    assert f"torch {torch.__version__}" in out
    assert 'torch.compile(backend="zenflow") resolves by name' in out
    assert f"CPU AdamW (csrc): built, {cpu_adam.isa()} kernels" in out
    assert f"CPUs: {len(mask)} allowed" in out
    assert "rank 0: overlapped updates" in out
    assert out.count("\n  rank ") == 1  # one rank unless --ranks says more


def test_the_json_report_places_each_ranks_pool_as_the_runtime_would(capsys):
    """``--ranks 2``: two ranks started with this process's mask, as torchrun starts them; each
    one's pool where ``ZenFlowAdamW`` would put it with those settings."""
    argv = ["--json", "--ranks", "2", "--bind-cores", "true", "--pt-reserved-cores-perc", "0.25"]
    assert report.main(argv) == 0
    seen = json.loads(capsys.readouterr().out)
    mask = core_binding.allowed_cpus()
    assert seen["cpus"]["allowed"] == sorted(mask)
    assert seen["pools"]["pinned"] is True
    assert len(seen["pools"]["ranks"]) == 2
    for index, rank in enumerate(seen["pools"]["ranks"]):
        place = core_binding.place_pool(0.25, True, [mask, mask], index)
        assert rank["threads"] == place.threads >= 1
        assert rank["cpus"] == list(place.cpus or ())
        assert rank["waited_threads"] == place.waited_threads
    if len(core_binding.physical_cores(mask)) >= 2:
        first, second = (set(rank["waited_cpus"]) for rank in seen["pools"]["ranks"])
        assert first and second and first.isdisjoint(second)
    assert seen["cpu_adam"] == {"built": True, "isa": cpu_adam.isa()}
    assert seen["gpus"] == []  # this suite runs without CUDA (tests/test_cuda.py: with)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--ranks", "0"], "--ranks must be at least 1, got 0"),
        (
            ["--pt-reserved-cores-perc", "1.5"],
            "--pt-reserved-cores-perc must be in [0, 1], got 1.5",
        ),
        (["--bind-cores", "yes"], "argument --bind-cores: invalid choice: 'yes'"),
    ],
)
def test_bad_arguments_are_refused_with_the_reason(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        report.main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


_TRAINING_ALONGSIDE = """
import json, sys, torch, zenflow
model = torch.nn.Linear(16, 8)
opt = zenflow.ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=0.5, update_interval=2,
                           overlap_step=True, bind_cores=True)
for _ in range(4):
    model(torch.randn(4, 16)).square().mean().backward()
    opt.step()
    opt.zero_grad()
print(json.dumps(opt.stats()["cpu_pool_cpus"]), flush=True)
sys.stdin.read()  # the pool's workers stay until the test closes stdin
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")
def test_the_report_names_another_zenflow_process_and_where_its_pool_runs(capsys):
    """An independent job already training on this machine: its pid and its pool's CPUs, and
    whether they are where this one's would be pinned."""
    other = subprocess.Popen(
        [sys.executable, "-c", _TRAINING_ALONGSIDE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    try:
        pinned = json.loads(other.stdout.readline()) or sorted(os.sched_getaffinity(0))
        assert report.main(["--json"]) == 0
        seen = json.loads(capsys.readouterr().out)["running_pools"]
        assert {"pid": other.pid, "cpus": pinned} in seen
        assert report.main(["--bind-cores", "true"]) == 0
        text = capsys.readouterr().out
        assert f"another zenflow process, pid {other.pid}: its pool on CPUs" in text
        if core_binding.place_pool(0.5, True).cpus:  # this machine's cores split
            assert "where this one's would be pinned" in text
    finally:
        other.stdin.close()
        other.wait(timeout=60)
