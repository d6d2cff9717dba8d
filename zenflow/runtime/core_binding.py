"""Which logical CPUs the CPU pool's workers run on, apart from the training thread's cores and
from other ranks' pools.

``pt_reserved_cores_perc`` keeps a share of the rank's cores for PyTorch: on a GPU machine the
training thread, whose work in a step is launching kernels with Python between them, as fast as
the one core it runs on. Left to the scheduler, the pool's workers spread over every physical
core first, so during an overlapped update (a pass over the optimizer state at the host's memory
bandwidth) the training thread shares its core, or that core's SMT sibling, with a worker. The
pool's workers are therefore pinned to whole physical cores of their own: the last ones of the
rank's CPUs, with every SMT sibling of each, the first ``ceil(perc * cores)`` left to the
training thread (DeepSpeed's ZenFlow keeps the first cores for training too). The training
thread itself is not pinned: it keeps the cores the pool leaves idle (the scheduler may still
move it onto one of the pool's), and what it starts (torch's own threads, data-loader workers)
keeps the whole mask. The split goes by core number, as DeepSpeed's does, not by NUMA node: on a
machine of two sockets the pool may land on the other socket than the one its state was first
touched from.

A rank's CPUs are its affinity mask unless other ranks on its machine (the same running kernel:
containers on one host count as one machine) have the same mask, as when ``torchrun`` starts
one process per GPU without binding them. Those ranks then split the mask's physical cores
between them, in rank order, and each splits its share as above, so that their pools do not
all pin to the same cores or each take threads for the whole machine (DeepSpeed's ZenFlow
splits an equal mask by rank too). Masks that are disjoint are each rank's own; masks that
overlap without being equal, or fewer physical cores than ranks, leave the pools unpinned, each
with threads for its part of its mask. Jobs the training thread waits for (warm-up, flush, an
update without overlap) take the rank's whole share, the cores kept for training included,
since those idle meanwhile. Ranks learn their machine's masks from one collective when the
optimizer is built (``zenflow.runtime.comm.DataParallel.gather_objects``).

Several independent jobs on one machine, each with the whole machine as its mask, would all pin
their pools to the same cores: give each its own cores (``taskset``, ``numactl``, a container's
CPU set) or set ``bind_cores`` False; ``python -m zenflow`` lists the pools already running.

With ``bind_cores`` "auto" (the default) this is done where the weights live on a GPU: on the
CPU the training thread's own work spans every core (torch's threads), so there is no core of
its to keep apart, and a pinned pool would only lose the cores the training thread leaves idle.
The thread count follows the rank's share of the machine either way.

Physical cores come from Linux's sysfs (each CPU's ``topology/thread_siblings_list``); where
that is unreadable every CPU counts as a core of its own.
"""

import math
import os
import socket
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
    _check_share(reserved_perc)
    # A hair below the product, so that 0.3 * 10 (3.0000000000000004 in binary) reserves 3.
    reserved = math.ceil(reserved_perc * len(cores) - 1e-9)
    if not 0 < reserved < len(cores):
        return None
    return CoreSplit(
        training=tuple(sorted(cpu for core in cores[:reserved] for cpu in core)),
        pool=tuple(sorted(cpu for core in cores[reserved:] for cpu in core)),
    )


@dataclass(frozen=True)
class PoolPlace:
    """Where a rank's CPU pool runs: for the updates that overlap training, ``threads``
    workers pinned to the logical CPUs ``cpus``; for the jobs the training thread waits for
    (its cores would idle meanwhile), ``waited_threads`` workers on ``waited_cpus``, the
    rank's whole share. None: anywhere in the process's mask."""

    threads: int
    cpus: tuple[int, ...] | None
    waited_threads: int
    waited_cpus: tuple[int, ...] | None = None


def machine_id() -> str:
    """What ranks on one machine share: the running kernel's boot id (the same in every
    container on a host), or the host name where Linux's is unreadable."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


def machine_masks(ranks: list[tuple[str, list[int]]], rank: int) -> tuple[list[set[int]], int]:
    """From every rank's ``(machine_id(), affinity mask)``, in rank order: the masks of the
    ranks on ``rank``'s machine, in rank order, and ``rank``'s place among them."""
    mine = ranks[rank][0]
    local = [index for index, (machine, _) in enumerate(ranks) if machine == mine]
    return [set(ranks[index][1]) for index in local], local.index(rank)


def threads_for(cpus: float, reserved_perc: float) -> int:
    """Worker threads left when ``reserved_perc`` of ``cpus`` logical CPUs stay with the
    training thread (ZenFlow's ``pt_reserved_cores_perc``): ``max(1, int(cpus * (1 - perc)))``."""
    _check_share(reserved_perc)
    return max(1, int(cpus * (1.0 - reserved_perc)))


def rank_share(masks: list[set[int]], index: int, sysfs: Path = SYSFS_CPUS) -> set[int] | None:
    """The logical CPUs that are the ``index``-th of the ranks on one machine, whose affinity
    masks are ``masks`` (in rank order). The ranks whose masks overlap its own share them: where
    all of those masks are the same, it gets its part of their physical cores (whole cores, in
    core order, as even as they divide, in the order of the ranks), which is its whole mask
    where no other rank's overlaps it; None otherwise (masks overlapping without being equal,
    fewer physical cores than ranks sharing them, a platform without masks)."""
    mine = masks[index]
    sharing = [position for position, mask in enumerate(masks) if not mine.isdisjoint(mask)]
    if not mine or any(masks[position] != mine for position in sharing):
        return None
    cores = physical_cores(mine, sysfs)
    if len(cores) < len(sharing):
        return None
    part = sharing.index(index)
    first = part * len(cores) // len(sharing)
    last = (part + 1) * len(cores) // len(sharing)
    return {cpu for core in cores[first:last] for cpu in core}


def place_pool(
    reserved_perc: float,
    bind: bool,
    masks: list[set[int]] | None = None,
    index: int = 0,
    sysfs: Path = SYSFS_CPUS,
) -> PoolPlace:
    """The pool of the ``index``-th rank on a machine whose ranks' affinity masks are ``masks``
    (by default this process alone, with its own mask). With ``bind``, its workers for
    overlapped updates are pinned to the physical cores ``reserved_perc`` leaves of the rank's
    share (``rank_share``), one per logical CPU there; where the share cannot be split (one
    core, a share of 0 or 1) they are pinned to the share itself if it is part of a mask other
    ranks share, and unpinned otherwise. Unpinned, they are as many as ``reserved_perc`` leaves
    of the share's logical CPUs. Jobs the training thread waits for take the whole share, on
    it where it is part of a shared mask and ``bind``. Where there is no share, the rank's mask
    divided evenly among the machine's ranks counts instead, unpinned."""
    _check_share(reserved_perc)
    masks = [allowed_cpus()] if masks is None else masks
    share = rank_share(masks, index, sysfs)
    if share is None:
        cpus = (len(masks[index]) or os.cpu_count() or 1) / len(masks)
        return PoolPlace(threads_for(cpus, reserved_perc), None, max(1, int(cpus)))
    threads = threads_for(len(share), reserved_perc)
    if not bind:
        return PoolPlace(threads, None, len(share))
    part = tuple(sorted(share)) if share != masks[index] else None
    split = split_cores(physical_cores(share, sysfs), reserved_perc)
    if split is not None:
        return PoolPlace(len(split.pool), split.pool, len(share), part)
    return PoolPlace(threads, part, len(share), part)


def _check_share(reserved_perc: float) -> None:
    if not 0.0 <= reserved_perc <= 1.0:
        raise ValueError(f"pt_reserved_cores_perc must be in [0, 1], got {reserved_perc}")


def _siblings(cpu: int, sysfs: Path) -> frozenset[int]:
    try:
        text = (sysfs / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text()
        siblings = parse_cpu_list(text)
    except (OSError, ValueError):
        return frozenset({cpu})
    return siblings if cpu in siblings else frozenset({cpu})


def parse_cpu_list(text: str) -> frozenset[int]:
    """Linux's CPU list format: ``0-3,8,10-11``."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return frozenset(cpus)
