"""Saves checkpoints in a process that the test kills with SIGKILL in the middle of a save:

    python -m tests.save_worker STATE_FILE SAVE_DIR TAG V FUNCTION N   # dies at a chosen point
    python -m tests.save_worker STATE_FILE SAVE_DIR                  # saves until killed

STATE_FILE holds an engine checkpoint's state; what this process saves has client_state
{"version": v} with v >= 1 added. With TAG, V, FUNCTION ("fsync" or "replace") and N, the
process saves TAG (version V) and SIGKILLs itself just before its Nth call of os.FUNCTION. Without them it saves
forever, alternately a new tag loop<i> and the existing tag "base" (version i), printing "ready"
after the first save.
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
        tag, version, function, n = kill_point
        die_at(function, int(n))
        state["client_state"] = {"version": int(version)}
        checkpoint.save(save_dir, tag, state, 0, 1, save_latest=True)
        return
    for i in range(1, 1_000_000):
        state["client_state"] = {"version": i}
        checkpoint.save(save_dir, "base" if i % 2 else f"loop{i}", state, 0, 1, save_latest=True)
        if i == 1:
            print("ready", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
