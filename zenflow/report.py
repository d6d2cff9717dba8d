"""``python -m zenflow``: what zenflow finds on this machine and how it would run here.

For a user setting up a machine (as DeepSpeed's ``ds_report`` is for DeepSpeed): the versions
it runs with, whether the compiler backend resolves by name and the C++ CPU AdamW is built (and
which kernels it picked), the CPUs this process may use and where the CPU pool of each rank
would run (``zenflow.runtime.core_binding``: ``--ranks N`` for N ranks started on this machine
with this process's affinity mask, as ``torchrun`` starts them), the pinned-memory limit, each
GPU's free memory and how large a model's unselected columns may be for device-side sums
("auto"), the CPU pools other zenflow processes run on this machine (independent jobs pinned to
the same cores slow each other), and the optional integrations. ``--json`` prints the same as
one JSON object.
"""

import argparse
import importlib.metadata
import json
import os
import platform
import resource
import shutil
import sys
from pathlib import Path

import torch

import zenflow
from zenflow.runtime import core_binding
from zenflow.runtime.device_sums import DEVICE_SUMS_SHARE
from zenflow.settings import ZenFlowSettings

OPTIONAL_PACKAGES = ("deepspeed", "transformers", "accelerate")


def _args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m zenflow",
        description="What zenflow finds on this machine and how it would run here.",
    )
    parser.add_argument(
        "--ranks",
        type=int,
        default=1,
        help="ranks started on this machine with this process's affinity mask (torchrun's "
        "--nproc-per-node): where each one's CPU pool runs (default 1)",
    )
    parser.add_argument(
        "--pt-reserved-cores-perc",
        type=float,
        default=ZenFlowSettings().pt_reserved_cores_perc,
        help="the setting of that name: the share of a rank's cores kept for PyTorch (0.5)",
    )
    parser.add_argument(
        "--bind-cores",
        choices=("auto", "true", "false"),
        default="auto",
        help='the setting of that name; "auto" pins where the weights are on a GPU, which '
        "this report takes to be so where CUDA is available",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object instead of text")
    args = parser.parse_args(argv)
    if args.ranks < 1:
        parser.error(f"--ranks must be at least 1, got {args.ranks}")
    if not 0.0 <= args.pt_reserved_cores_perc <= 1.0:
        parser.error(
            f"--pt-reserved-cores-perc must be in [0, 1], got {args.pt_reserved_cores_perc}"
        )
    return args


def _cpu_adam() -> dict:
    try:
        from zenflow.runtime import cpu_adam

        return {"built": True, "isa": cpu_adam.isa()}
    except (ImportError, OSError) as error:
        return {"built": False, "error": str(error)}


def _backend_registered() -> bool:
    entry_points = importlib.metadata.entry_points(group="torch_dynamo_backends")
    return any(entry.name == "zenflow" for entry in entry_points)


def _gpus() -> list[dict]:
    if not torch.cuda.is_available():
        return []
    gpus = []
    for index in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(index)
        gpus.append(
            {
                "index": index,
                "name": torch.cuda.get_device_name(index),
                "total_bytes": total,
                "free_bytes": free,
                # fp32 sums of unselected columns that "auto" keeps on the device
                "device_sums_max_parameters": int(DEVICE_SUMS_SHARE * free) // 4,
            }
        )
    return gpus


def _pinned_memory_limit() -> int | None:
    """``ulimit -l`` in bytes; None: unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def _pools(args, mask: set[int], gpus: list[dict]) -> dict:
    requested = {"true": True, "false": False}.get(args.bind_cores, "auto")
    bind = core_binding.binds(requested, torch.device("cuda" if gpus else "cpu"))
    masks = [mask] * args.ranks
    ranks = []
    for index in range(args.ranks):
        place = core_binding.place_pool(args.pt_reserved_cores_perc, bind, masks, index)
        ranks.append(
            {
                "rank": index,
                "threads": place.threads,
                "cpus": list(place.cpus or ()),
                "waited_threads": place.waited_threads,
                "waited_cpus": list(place.waited_cpus or ()),
            }
        )
    return {
        "bind_cores": args.bind_cores,
        "pinned": bind,
        "pt_reserved_cores_perc": args.pt_reserved_cores_perc,
        "ranks": ranks,
    }


def _running_pools() -> list[dict]:
    """Other processes' CPU pools on this machine (their workers are the threads named
    ``zenflow-adamw``), by process: the pid and the CPUs its workers may run on (from Linux's
    /proc; none where it is not there or another user's processes are hidden)."""
    pools: dict[int, set[int]] = {}
    for task in Path("/proc").glob("[0-9]*/task/[0-9]*"):
        try:
            if (task / "comm").read_text().strip() != "zenflow-adamw":
                continue
            status = (task / "status").read_text().splitlines()
        except OSError:  # the thread or its process ended while the list was read
            continue
        allowed = [line.split(":", 1)[1] for line in status if line.startswith("Cpus_allowed_list")]
        pid = int(task.parent.parent.name)
        if allowed and pid != os.getpid():
            pools.setdefault(pid, set()).update(core_binding.parse_cpu_list(allowed[0]))
    return [{"pid": pid, "cpus": sorted(cpus)} for pid, cpus in sorted(pools.items())]


def _packages() -> dict:
    versions = {}
    for name in OPTIONAL_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def gather(args) -> dict:
    """Everything the report shows, as plain values."""
    mask = core_binding.allowed_cpus()
    gpus = _gpus()
    shm = shutil.disk_usage("/dev/shm").free if Path("/dev/shm").is_dir() else None
    return {
        "zenflow": {"version": zenflow.__version__, "path": str(Path(zenflow.__file__).parent)},
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "backend_registered": _backend_registered(),
        "cpu_adam": _cpu_adam(),
        "cpus": {
            "allowed": sorted(mask),
            "physical_cores": len(core_binding.physical_cores(mask)),
            "machine": platform.machine(),
        },
        "pinned_memory_limit_bytes": _pinned_memory_limit(),
        "shm_free_bytes": shm,
        "gpus": gpus,
        "pools": _pools(args, mask, gpus),
        "running_pools": _running_pools(),
        "packages": _packages(),
    }


def _cpu_list(cpus: list[int]) -> str:
    """Linux's CPU list format: ``0-3,8``."""
    runs: list[list[int]] = []
    for cpu in cpus:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{first}-{last}" if first != last else f"{first}" for first, last in runs)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _text(report: dict) -> str:
    cpu_adam = report["cpu_adam"]
    cpus = report["cpus"]
    pools = report["pools"]
    limit = report["pinned_memory_limit_bytes"]
    lines = [
        f"zenflow {report['zenflow']['version']} ({report['zenflow']['path']})",
        f"python {report['python']}, torch {report['torch']}, CUDA {report['cuda'] or 'none'}",
        'compiler backend: torch.compile(backend="zenflow") '
        + ("resolves by name" if report["backend_registered"] else "NOT registered: reinstall"),
        "CPU AdamW (csrc): "
        + (
            f"built, {cpu_adam['isa']} kernels"
            if cpu_adam["built"]
            else f"NOT built: {cpu_adam['error']}"
        ),
        f"CPUs: {len(cpus['allowed'])} allowed ({_cpu_list(cpus['allowed'])}), "
        f"{cpus['physical_cores']} physical cores, {cpus['machine']}",
        "pinned memory limit (ulimit -l): " + ("unlimited" if limit is None else _size(limit)),
    ]
    if report["shm_free_bytes"] is not None:
        lines.append(f"/dev/shm free: {_size(report['shm_free_bytes'])}")
    if not report["gpus"]:
        lines.append('GPUs: none (weights on the CPU: device-side sums off under "auto")')
    for gpu in report["gpus"]:
        lines.append(
            f"GPU {gpu['index']}: {gpu['name']}, {_size(gpu['free_bytes'])} free of "
            f'{_size(gpu["total_bytes"])}; device-side sums ("auto", one rank) fit models whose '
            f"unselected columns hold up to {gpu['device_sums_max_parameters'] / 1e9:.2f}e9 "
            "parameters"
        )
    ranks = pools["ranks"]
    lines.append(
        f"CPU pool, pt_reserved_cores_perc {pools['pt_reserved_cores_perc']}, "
        f"bind_cores {pools['bind_cores']} ({'pinned' if pools['pinned'] else 'unpinned'}"
        f"{', no GPU' if pools['bind_cores'] == 'auto' and not pools['pinned'] else ''}), "
        f"{len(ranks)} "
        f"rank{'s' if len(ranks) > 1 else ''} on this mask:"
    )
    for rank in ranks:
        beside = f"{rank['threads']} thread{'s' if rank['threads'] > 1 else ''} " + (
            f"on CPUs {_cpu_list(rank['cpus'])}" if rank["cpus"] else "unpinned"
        )
        waited = f"{rank['waited_threads']} " + (
            f"on CPUs {_cpu_list(rank['waited_cpus'])}" if rank["waited_cpus"] else "unpinned"
        )
        lines.append(
            f"  rank {rank['rank']}: overlapped updates {beside}; waited-for jobs {waited}"
        )
    pinned = {cpu for rank in ranks for cpu in rank["cpus"]}
    for other in report["running_pools"]:
        shared = pinned & set(other["cpus"])
        lines.append(
            f"  another zenflow process, pid {other['pid']}: its pool on CPUs "
            f"{_cpu_list(other['cpus'])}"
            + (
                f", {len(shared)} of them where this one's would be pinned: give each job "
                "cores of its own (taskset) or bind_cores false"
                if shared
                else ""
            )
        )
    packages = ", ".join(
        f"{name} {version or 'not installed'}" for name, version in report["packages"].items()
    )
    lines.append(f"optional: {packages}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = _args(argv)
    report = gather(args)
    print(json.dumps(report, indent=2) if args.json else _text(report))
    healthy = report["backend_registered"] and report["cpu_adam"]["built"]
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
