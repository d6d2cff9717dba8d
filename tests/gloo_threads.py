"""The gloo threads a process still runs: what a destroyed process group must not leave."""

import glob


def _thread_name(comm_path: str) -> str:
    """A thread's name, or "" when the thread ended after its directory was listed (threads
    that finish while the list is taken, such as a CPU job's worker, are not running)."""
    try:
        with open(comm_path) as comm:
            return comm.read().strip()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def gloo_threads() -> list[str]:
    """Names of this process's threads that belong to gloo (its transport loop and a process
    group's workers): none once every process group is destroyed (Linux)."""
    names = [_thread_name(path) for path in glob.glob("/proc/self/task/*/comm")]
    return sorted(name for name in names if "gloo" in name)
