"""Saves checkpoints in a process that the test kills with SIGKILL in the middle of a save:

    python -m tests.save_worker STATE_FILE SAVE_DIR FUNCTION N   # dies at a chosen point
    python -m tests.save_worker STATE_FILE SAVE_DIR              # saves until killed

STATE_FILE holds an engine checkpoint's state. With FUNCTION ("fsync" or "replace") and N, the
process saves tag "new" and SIGKILLs itself just before its Nth call of os.FUNCTION (a save
calls each once per file: the rank file, the commit marker, ``latest``). Without them it saves
tags loop0, loop1, ... forever, printing "ready" after the first.
"""

import os
import signal
import sys

import torch

from zenflow.runtime import checkpoint


def die_at(name: str, n: int) -> None:
    real = getattr(os, name)
    calls = 0

    def hooked(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)

    setattr(os, name, hooked)


def main(state_file: str, save_dir: str, *kill_point: str) -> None:
    state = torch.load(state_file, weights_only=False)
    if kill_point:
        die_at(kill_point[0], int(kill_point[1]))
        checkpoint.save(save_dir, "new", state, 0, 1, save_latest=True)
        return
    for i in range(1_000_000):
        checkpoint.save(save_dir, f"loop{i}", state, 0, 1, save_latest=True)
        if i == 0:
            print("ready", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
