"""Which logical CPUs the CPU pool's workers run on, apart from the training thread's cores.

``pt_reserved_cores_perc`` keeps a share of the rank's cores for PyTorch: on a GPU machine the
training thread, whose work in a step is launching kernels with Python between them, as fast as
the one core it runs on. Left to the scheduler, the pool's workers spread over every physical
core first, so during an overlapped update (a pass over the optimizer state at the host's memory
bandwidth) the training thread shares its core, or that core's SMT sibling, with a worker. The
pool's workers are therefore pinned to whole physical cores of their own: the last ones of the
process's affinity mask, with every SMT sibling of each, the first ``ceil(perc * cores)`` left
to the training thread (DeepSpeed's ZenFlow keeps the first cores for training too). The
training thread itself is not pinned: it keeps the cores the pool leaves idle (the scheduler
may still move it onto one of the pool's), and what it starts (torch's own threads, data-loader
workers) keeps the whole mask. The split goes by core number, as DeepSpeed's does, not by NUMA
node: on a machine of two sockets the pool may land on the other socket than the one its state
was first touched from.

Several independent jobs on one machine, each with the whole machine as its mask, would all pin
their pools to the same cores: give each its own cores (``taskset``, ``numactl``, a container's
CPU set) or set ``bind_cores`` False.

With ``bind_cores`` "auto" (the default) this is done where the weights live on a GPU: on the
CPU the training thread's own work spans every core (torch's threads), so there is no core of
its to keep apart, and a pinned pool would only lose the cores the training thread leaves idle.

Physical cores come from Linux's sysfs (each CPU's ``topology/thread_siblings_list``); where
that is unreadable every CPU counts as a core of its own.
"""

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

SYSFS_CPUS = Path("/sys/devices/system/cpu")


@dataclass(frozen=True)
class CoreSplit:
    """The logical CPUs kept for the training thread (``training``) and those the pool's workers
    are pinned to (``pool``), ascending; each physical core's CPUs are all on one side."""

    training: tuple[int, ...]
    pool: tuple[int, ...]


def binds(requested: bool | str, device: torch.device) -> bool:
    """``bind_cores`` decided for weights on ``device``: True or False as given, "auto" where
    the device is not the CPU."""
    if requested == "auto":
        return device.type != "cpu"
    return requested is True


def allowed_cpus() -> set[int]:
    """The logical CPUs this thread may run on (its affinity mask: ``taskset``, a container's CPU
    set); empty where the platform does not tell."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set()


def physical_cores(cpus: set[int], sysfs: Path = SYSFS_CPUS) -> list[tuple[int, ...]]:
    """``cpus`` grouped by physical core (SMT siblings together), each group ascending, the
    groups in the order of their first CPU."""
    groups: dict[frozenset[int], list[int]] = {}
    for cpu in sorted(cpus):
        siblings = _siblings(cpu, sysfs)
        groups.setdefault(siblings, []).append(cpu)
    return sorted((tuple(group) for group in groups.values()), key=lambda group: group[0])


def split_cores(cores: list[tuple[int, ...]], reserved_perc: float) -> CoreSplit | None:
    """The first ``ceil(reserved_perc * len(cores))`` physical cores for the training thread,
    the rest for the pool; None where either side would be empty (nothing to keep apart)."""
    if not 0.0 <= reserved_perc <= 1.0:
        raise ValueError(f"pt_reserved_cores_perc must be in [0, 1], got {reserved_perc}")
    # A hair below the product, so that 0.3 * 10 (3.0000000000000004 in binary) reserves 3.
    reserved = math.ceil(reserved_perc * len(cores) - 1e-9)
    if not 0 < reserved < len(cores):
        return None
    return CoreSplit(
        training=tuple(sorted(cpu for core in cores[:reserved] for cpu in core)),
        pool=tuple(sorted(cpu for core in cores[reserved:] for cpu in core)),
    )


def pool_cpus(
    reserved_perc: float,
    world_size: int,
    allowed: set[int] | None = None,
    sysfs: Path = SYSFS_CPUS,
) -> tuple[int, ...] | None:
    """The CPUs a rank's pool is pinned to under ``reserved_perc``, from the rank's ``allowed``
    CPUs (its affinity mask by default); None where the cores are not split: one core, a share
    of 0 or 1, a platform without affinity masks, or a rank that may share the machine with
    others: several ranks, unless the launcher says one runs per machine (``LOCAL_WORLD_SIZE``,
    torchrun's, or ``LOCAL_SIZE``, DeepSpeed's, of 1). Ranks on one machine cannot tell, short
    of a collective, whether their masks are their own cores or one shared set, and every rank
    would pin its pool to the same cores of a shared one."""
    allowed = allowed_cpus() if allowed is None else allowed
    local_size = os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE"))
    if world_size > 1 and local_size != "1":
        return None
    split = split_cores(physical_cores(allowed, sysfs), reserved_perc)
    return None if split is None else split.pool


def _siblings(cpu: int, sysfs: Path) -> frozenset[int]:
    try:
        text = (sysfs / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text()
        siblings = _parse_cpu_list(text)
    except (OSError, ValueError):
        return frozenset({cpu})
    return siblings if cpu in siblings else frozenset({cpu})


def _parse_cpu_list(text: str) -> frozenset[int]:
    """Linux's CPU list format: ``0-3,8,10-11``."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return frozenset(cpus)
