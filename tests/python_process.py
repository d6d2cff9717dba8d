"""Running Python in a fresh process from the repository root, as a user would."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def stdout_of(args: list[str], timeout_s: float, **env: str) -> str:
    """``python *args`` from the repository root (its packages importable), with ``env`` added
    to the environment; returns its stdout. Fails with the end of its output if it fails."""
    result = subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT), **env),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout
