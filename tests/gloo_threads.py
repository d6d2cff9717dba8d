"""The gloo threads a process still runs: what a destroyed process group must not leave."""

import glob
import time


def _thread_name(comm_path: str) -> str:
    """A thread's name, or "" when the thread ended after its directory was listed (threads
    that finish while the list is taken, such as a CPU job's worker, are not running)."""
    try:
        with open(comm_path) as comm:
            return comm.read().strip()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def _running_gloo_threads() -> list[str]:
    names = [_thread_name(path) for path in glob.glob("/proc/self/task/*/comm")]
    return sorted(name for name in names if "gloo" in name)


def gloo_threads(wait_s: float = 10.0) -> list[str]:
    """Names of this process's threads that belong to gloo (its transport loop and a process
    group's workers), once they have ended or ``wait_s`` has passed: none once every process
    group is destroyed (Linux). A destroyed group's transport loop stops on its own thread, a
    moment after ``destroy_process_group`` returns; one that something still holds runs on."""
    deadline = time.monotonic() + wait_s
    while (threads := _running_gloo_threads()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return threads
