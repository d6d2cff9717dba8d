"""The gloo threads a process still runs: what a destroyed process group must not leave."""

import glob


def gloo_threads() -> list[str]:
    """Names of this process's threads that belong to gloo (its transport loop and a process
    group's workers): none once every process group is destroyed (Linux)."""
    names = [open(path).read().strip() for path in glob.glob("/proc/self/task/*/comm")]
    return sorted(name for name in names if "gloo" in name)
