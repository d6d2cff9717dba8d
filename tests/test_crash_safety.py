"""Processes that die: SIGKILL in the middle of save_checkpoint, a data-parallel peer that dies
or hangs. The survivors get a loadable checkpoint or a clear error in bounded time, never a
hang. Every child process has an outer timeout, so no test here can hang CI."""

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.multiprocessing as mp

import zenflow
from tests import dead_rank_worker, engine_worker

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# SIGKILL during save_checkpoint.


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A checkpoint directory with one committed tag "base", and that tag's state as a file."""
    root = tmp_path_factory.mktemp("base")
    engine = engine_worker.build()
    engine_worker.train(engine, 0, 2)
    engine.save_checkpoint(root / "ckpt", tag="base")
    shutil.copy(root / "ckpt" / "base" / "rank0.pt", root / "state.pt")
    return root


def assert_survivors_load(save_dir, expected_module: dict, tags: list[str]) -> list[str]:
    """The tag ``latest`` names loads; each of ``tags`` either is committed and loads the
    expected state, or is refused as incomplete. Returns the committed ones."""
    engine = engine_worker.build()
    path, _ = engine.load_checkpoint(save_dir)
    assert path is not None
    committed = []
    for tag in tags:
        fresh = engine_worker.build()
        if (save_dir / tag / "COMMITTED").exists():
            fresh.load_checkpoint(save_dir, tag=tag)
            for name, value in expected_module.items():
                assert torch.equal(fresh.module.state_dict()[name], value), (tag, name)
            committed.append(tag)
        else:
            with pytest.raises(RuntimeError, match=f"tag '{tag}' .* is incomplete"):
                fresh.load_checkpoint(save_dir, tag=tag)
    return committed


def base_module(base) -> dict:
    return torch.load(base / "state.pt", weights_only=False)["module"]


# (function, call): a save calls os.fsync then os.replace for the rank file, then the marker,
# then ``latest``; dying before call n of either leaves the first n - 1 files of the new tag.
KILL_POINTS = [("fsync", 1), ("replace", 1), ("fsync", 2), ("replace", 2), ("replace", 3)]


@pytest.mark.parametrize("function, call", KILL_POINTS, ids=[f"{f}{n}" for f, n in KILL_POINTS])
def test_sigkill_at_each_point_of_a_save(tmp_path, base, function, call):
    save_dir = tmp_path / "ckpt"
    shutil.copytree(base / "ckpt", save_dir)
    child = subprocess.run(
        [sys.executable, "-m", "tests.save_worker", str(base / "state.pt"), str(save_dir)]
        + [function, str(call)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    committed = assert_survivors_load(save_dir, base_module(base), ["base", "new"])
    # The marker is renamed into place by the second os.replace: only then is "new" committed.
    assert committed == (["base", "new"] if (function, call) == ("replace", 3) else ["base"])
    assert (save_dir / "latest").read_text() == "base"


@pytest.mark.slow
def test_sigkill_at_random_moments_of_repeated_saves(tmp_path, base):
    rng = random.Random(0)
    kills = 12
    for attempt in range(kills):
        save_dir = tmp_path / f"ckpt{attempt}"
        shutil.copytree(base / "ckpt", save_dir)
        child = subprocess.Popen(
            [sys.executable, "-m", "tests.save_worker", str(base / "state.pt"), str(save_dir)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert child.stdout.readline().strip() == "ready"
            time.sleep(rng.uniform(0.0, 0.2))
        finally:
            child.kill()
            child.wait(timeout=CHILD_TIMEOUT_S)
        saved = sorted(
            int(tag.removeprefix("loop")) for tag in os.listdir(save_dir) if "loop" in tag
        )
        last_two = [f"loop{i}" for i in saved[-2:]]
        committed = assert_survivors_load(save_dir, base_module(base), ["base", *last_two])
        # latest names the newest committed tag, or the one before while the newest was
        # committed but latest not yet renamed into place.
        assert "base" in committed and (save_dir / "latest").read_text() in committed[-2:]


# A data-parallel peer that dies or hangs.


@pytest.mark.parametrize("mode", ["die", "hang"])
def test_a_dead_or_stuck_rank_makes_the_other_fail_within_the_timeout(tmp_path, mode):
    timeout_s = 5.0
    context = mp.get_context("spawn")
    ranks = [
        context.Process(
            target=dead_rank_worker.run, args=(rank, port, timeout_s, mode, str(tmp_path))
        )
        for port in [free_port()]
        for rank in range(2)
    ]
    for process in ranks:
        process.start()
    try:
        ranks[0].join(timeout=CHILD_TIMEOUT_S)
        assert ranks[0].exitcode == 0, f"rank 0 did not fail cleanly (exit {ranks[0].exitcode})"
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
            process.join(timeout=CHILD_TIMEOUT_S)
    result = json.loads((tmp_path / "rank0.json").read_text())
    assert result["step"] == dead_rank_worker.FAILING_STEP
    assert result["type"] == "CollectiveError" and result["failed_state"]
    assert "A peer rank has probably died" in result["message"]
    assert "process_group_timeout_s" in result["message"]
    if mode == "hang":  # gloo gives up at the timeout
        assert timeout_s - 0.5 <= result["seconds"] <= timeout_s + 10
    else:  # a closed connection is noticed at once
        assert result["seconds"] <= timeout_s + 10


def test_process_group_timeout_reaches_init_process_group(monkeypatch):
    import torch.distributed as dist

    launcher = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    for name, value in launcher.items():
        monkeypatch.setenv(name, value)
    calls = []
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **kw: calls.append((a, kw)))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 0},
        "process_group_timeout_s": 42.5,
    }
    zenflow.initialize(model=torch.nn.Linear(2, 2), config=config)
    assert calls[0][1]["timeout"].total_seconds() == 42.5
    config["process_group_timeout_s"] = 0
    with pytest.raises(zenflow.config.ConfigError, match="^process_group_timeout_s: "):
        zenflow.initialize(model=torch.nn.Linear(2, 2), config=config)
    assert len(calls) == 1
