"""Processes that die: SIGKILL in the middle of save_checkpoint, a data-parallel peer that dies
or hangs. The survivors get a loadable checkpoint or a clear error in bounded time, never a
hang. Every child process has an outer timeout, so no test here can hang CI."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.multiprocessing as mp

import zenflow
from tests import dead_rank_worker, engine_worker
from tests.ports import free_port
from tests.zero_configs import overlapped_zenflow_zero

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD_TIMEOUT_S = 120


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


def load_tag(save_dir, tag: str | None, expected_module: dict) -> dict:
    """Load ``tag`` (None: the one ``latest`` names) into a fresh engine, check its module
    against ``expected_module`` and return its client_state."""
    engine = engine_worker.build()
    path, client_state = engine.load_checkpoint(save_dir, tag=tag)
    assert path is not None
    for name, value in expected_module.items():
        assert torch.equal(engine.module.state_dict()[name], value), (tag, name)
    return client_state


def is_committed(save_dir, tag: str, expected_module: dict) -> bool:
    """Whether ``tag`` loads (checking what it holds) or is refused as incomplete."""
    if (save_dir / tag / "COMMITTED").exists():
        load_tag(save_dir, tag, expected_module)
        return True
    with pytest.raises(RuntimeError, match=f"tag '{tag}' .* is incomplete"):
        engine_worker.build().load_checkpoint(save_dir, tag=tag)
    return False


def base_module(base) -> dict:
    return torch.load(base / "state.pt", weights_only=False)["module"]


# (function, call) of a save: os.fsync 1 and os.replace 1 write rank0.pt.next (os.fsync 2 syncs
# its directory), replace 2 renames the marker into place (the commit point), replace 3 renames
# rank0.pt.next to rank0.pt, replace 4 writes ``latest``. Dying just before each of these
# leaves, in turn: a partial temporary file; rank0.pt.next but no new marker; a new marker with
# rank0.pt.next not yet renamed; the new tag complete but ``latest`` not updated.
KILL_POINTS = [("fsync", 1), ("fsync", 2), ("replace", 3), ("replace", 4)]


def save_and_die(base, save_dir, tag: str, version: int, function: str, call: int) -> None:
    child = subprocess.run(
        [sys.executable, "-m", "tests.save_worker", str(base / "state.pt"), str(save_dir)]
        + [tag, str(version), function, str(call)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr


@pytest.mark.parametrize("tag", ["new", "base"], ids=["new-tag", "overwrite"])
@pytest.mark.parametrize("function, call", KILL_POINTS, ids=[f"{f}{n}" for f, n in KILL_POINTS])
def test_sigkill_at_each_point_of_a_save(tmp_path, base, function, call, tag):
    save_dir = tmp_path / "ckpt"
    shutil.copytree(base / "ckpt", save_dir)
    save_and_die(base, save_dir, tag, 1, function, call)
    committed = (function, call) in [("replace", 3), ("replace", 4)]
    expected = base_module(base)
    assert (save_dir / "latest").read_text() == "base"
    base_state = load_tag(save_dir, None, expected)
    if tag == "new":
        assert base_state == {}
        assert is_committed(save_dir, "new", expected) == committed
    else:  # the previous state of the tag until the commit point, the new one after it
        assert base_state == ({"version": 1} if committed else {})


def test_a_second_crash_keeps_what_the_first_committed(tmp_path, base):
    # The first save of "base" dies after its commit point, before renaming rank0.pt.next; the
    # second dies before its own commit point, having rewritten rank0.pt.next.
    save_dir = tmp_path / "ckpt"
    shutil.copytree(base / "ckpt", save_dir)
    save_and_die(base, save_dir, "base", 1, "replace", 3)
    save_and_die(base, save_dir, "base", 2, "fsync", 2)
    assert load_tag(save_dir, "base", base_module(base)) == {"version": 1}


@pytest.mark.slow
def test_sigkill_at_random_moments_of_repeated_saves(tmp_path, base):
    rng = random.Random(0)
    expected = base_module(base)
    for attempt in range(8):
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
        loops = sorted(int(t.removeprefix("loop")) for t in os.listdir(save_dir) if "loop" in t)
        committed = [i for i in loops[-2:] if is_committed(save_dir, f"loop{i}", expected)]
        # "base" (overwritten at every odd save) always loads: its last committed version.
        version = load_tag(save_dir, "base", expected)["version"]
        assert version % 2 == 1 and version >= max(committed, default=0) - 1
        latest = (save_dir / "latest").read_text()
        assert latest in ["base"] + [f"loop{i}" for i in committed]
        load_tag(save_dir, None, expected)


# A data-parallel peer that dies or hangs.


ZENFLOW = overlapped_zenflow_zero()
DEAD_RANK_CASES = [
    ("die", ZENFLOW),
    ("hang", ZENFLOW),
    ("hang", {"stage": 0}),
    ("die-in-save", ZENFLOW),
]


@pytest.mark.parametrize(
    "mode, zero",
    DEAD_RANK_CASES,
    ids=["die-zenflow", "hang-zenflow", "hang-adamw", "die-in-save"],
)
def test_a_dead_or_stuck_rank_makes_the_other_fail_within_the_timeout(tmp_path, mode, zero):
    timeout_s = 3.0
    port = free_port()
    context = mp.get_context("spawn")
    ranks = [
        context.Process(
            target=dead_rank_worker.run, args=(rank, port, timeout_s, mode, zero, str(tmp_path))
        )
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
    assert result["type"] == "CollectiveError"
    assert "A peer rank has probably died" in result["message"]
    assert "process_group_timeout_s" in result["message"]
    # After a failed step ZenFlowAdamW's host state is undefined: it refuses to go on until
    # reloaded. A failed save changes no state.
    assert result["failed_state"] == ("zenflow" in zero and mode != "die-in-save")
    # The checkpoint of step 2 stays the one latest names; step 4's was never committed.
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step2"
    assert (tmp_path / "ckpt" / "global_step2" / "COMMITTED").exists()
    assert not (tmp_path / "ckpt" / "global_step4" / "COMMITTED").exists()
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
