"""The CPU pool's workers pinned to physical cores of their own (``bind_cores``)."""

import json
import os
import sys

import pytest
import torch

import zenflow
from tests.ports import free_port
from tests.python_process import stdout_of
from zenflow.runtime import core_binding


def _sysfs(tmp_path, siblings: dict[int, str]):
    """A fake /sys/devices/system/cpu: each CPU's thread_siblings_list."""
    for cpu, text in siblings.items():
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "thread_siblings_list").write_text(text + "\n")
    return tmp_path


def test_smt_siblings_numbered_apart_form_one_core(tmp_path):
    # Intel's usual numbering: CPU n and n + 4 are one core's two threads.
    sysfs = _sysfs(tmp_path, {cpu: f"{cpu % 4},{cpu % 4 + 4}" for cpu in range(8)})
    cores = core_binding.physical_cores(set(range(8)), sysfs)
    assert cores == [(0, 4), (1, 5), (2, 6), (3, 7)]
    split = core_binding.split_cores(cores, 0.5)
    assert split == core_binding.CoreSplit(training=(0, 1, 4, 5), pool=(2, 3, 6, 7))


def test_smt_siblings_numbered_together_and_ranges(tmp_path):
    sysfs = _sysfs(tmp_path, {cpu: f"{cpu - cpu % 2}-{cpu - cpu % 2 + 1}" for cpu in range(6)})
    cores = core_binding.physical_cores(set(range(6)), sysfs)
    assert cores == [(0, 1), (2, 3), (4, 5)]
    # A quarter of 3 cores is 0.75: one core kept for training, rounding up.
    assert core_binding.split_cores(cores, 0.25).pool == (2, 3, 4, 5)


def test_only_the_affinity_masks_cpus_count(tmp_path):
    # taskset -c 2,3,6,7 on the 4-core, 8-thread machine above.
    sysfs = _sysfs(tmp_path, {cpu: f"{cpu % 4},{cpu % 4 + 4}" for cpu in range(8)})
    cores = core_binding.physical_cores({2, 3, 6, 7}, sysfs)
    assert cores == [(2, 6), (3, 7)]
    assert core_binding.split_cores(cores, 0.5) == core_binding.CoreSplit((2, 6), (3, 7))
    # Half of a core's threads in the mask: that thread alone is the core.
    assert core_binding.physical_cores({0, 1, 5}, sysfs) == [(0,), (1, 5)]


def test_without_topology_every_cpu_is_a_core(tmp_path):
    assert core_binding.physical_cores({0, 1, 2}, tmp_path) == [(0,), (1,), (2,)]
    (tmp_path / "cpu1" / "topology").mkdir(parents=True)
    (tmp_path / "cpu1" / "topology" / "thread_siblings_list").write_text("garbage\n")
    assert core_binding.physical_cores({0, 1}, tmp_path) == [(0,), (1,)]


@pytest.mark.parametrize(
    "cores, perc, pool",
    [
        (10, 0.3, tuple(range(3, 10))),  # 0.3 * 10 is 3.0000000000000004 in binary: 3 kept
        (2, 0.5, (1,)),
        (16, 0.875, (14, 15)),
        (4, 0.0, None),  # nothing kept for training: nothing to keep apart
        (4, 1.0, None),  # no core left for the pool
        (1, 0.5, None),
    ],
)
def test_the_split_keeps_the_first_cores_for_training(cores, perc, pool):
    split = core_binding.split_cores([(cpu,) for cpu in range(cores)], perc)
    assert (None if split is None else split.pool) == pool
    if split is not None:
        assert sorted(split.training + split.pool) == list(range(cores))


def _smt_machine(tmp_path):
    """4 cores of 2 threads, numbered apart: CPU n and n + 4 are one core."""
    return _sysfs(tmp_path, {cpu: f"{cpu % 4},{cpu % 4 + 4}" for cpu in range(8)})


def _place(perc, bind, masks, index, sysfs) -> tuple:
    """Where a rank's pool runs: (threads, cpus) for overlapped updates, then for waited jobs."""
    place = core_binding.place_pool(perc, bind, masks, index, sysfs)
    return (place.threads, place.cpus), (place.waited_threads, place.waited_cpus)


def test_one_rank_splits_its_own_mask(tmp_path):
    sysfs = _smt_machine(tmp_path)
    everything = set(range(8))
    # Jobs the training thread waits for take every CPU of the mask, unpinned.
    assert _place(0.5, True, [everything], 0, sysfs) == ((4, (2, 3, 6, 7)), (8, None))
    # taskset -c 2,3,6,7: the two cores it leaves, split.
    assert _place(0.5, True, [{2, 3, 6, 7}], 0, sysfs) == ((2, (3, 7)), (4, None))
    # Unpinned: half of the mask's logical CPUs, wherever the scheduler puts them.
    assert _place(0.5, False, [everything], 0, sysfs) == ((4, None), (8, None))


def test_ranks_with_one_mask_split_its_cores_between_them(tmp_path):
    """torchrun without binding: every rank of the machine has its whole mask. Each takes its
    part of the physical cores in rank order and splits that, rather than every pool pinning
    to the mask's last cores, or taking threads for the whole machine; jobs the training
    thread waits for take the rank's whole part."""
    sysfs = _smt_machine(tmp_path)
    two = [set(range(8))] * 2
    assert core_binding.rank_share(two, 0, sysfs) == {0, 1, 4, 5}
    assert core_binding.rank_share(two, 1, sysfs) == {2, 3, 6, 7}
    assert _place(0.5, True, two, 0, sysfs) == ((2, (1, 5)), (4, (0, 1, 4, 5)))
    assert _place(0.5, True, two, 1, sysfs) == ((2, (3, 7)), (4, (2, 3, 6, 7)))
    assert _place(0.5, False, two, 1, sysfs) == ((2, None), (4, None))
    # A core each: nothing to split, so each pool stays on its own core.
    four = [set(range(8))] * 4
    assert [_place(0.5, True, four, i, sysfs) for i in range(4)] == [
        ((1, (i, i + 4)), (2, (i, i + 4))) for i in range(4)
    ]
    # Three ranks on four cores: parts as even as whole cores allow.
    three = [set(range(8))] * 3
    assert [len(core_binding.rank_share(three, i, sysfs)) for i in range(3)] == [2, 2, 4]


def test_ranks_with_masks_of_their_own_keep_them(tmp_path):
    sysfs = _smt_machine(tmp_path)
    bound = [{0, 1, 4, 5}, {2, 3, 6, 7}]  # a launcher's binding (--bind_cores_to_rank)
    assert _place(0.5, True, bound, 0, sysfs) == ((2, (1, 5)), (4, None))
    assert _place(0.5, True, bound, 1, sysfs) == ((2, (3, 7)), (4, None))
    # Two groups of two ranks, each group bound to one half of the machine.
    groups = [{0, 1, 4, 5}, {0, 1, 4, 5}, {2, 3, 6, 7}, {2, 3, 6, 7}]
    assert [core_binding.rank_share(groups, i, sysfs) for i in range(4)] == [
        {0, 4},
        {1, 5},
        {2, 6},
        {3, 7},
    ]


def test_ranks_whose_shares_cannot_be_told_stay_unpinned_with_threads_for_their_part(tmp_path):
    sysfs = _smt_machine(tmp_path)
    overlapping = [set(range(8)), {2, 3, 6, 7}]
    assert core_binding.rank_share(overlapping, 0, sysfs) is None
    assert _place(0.5, True, overlapping, 0, sysfs) == ((2, None), (4, None))
    # More ranks than physical cores.
    crowded = [set(range(8))] * 5
    assert _place(0.5, True, crowded, 4, sysfs) == ((1, None), (1, None))
    # No mask known (a platform without affinity): the machine's CPUs, shared.
    assert _place(0.0, True, [set(), set()], 1, sysfs)[0][1] is None


def test_ranks_are_grouped_by_machine():
    ranks = [("a", [0, 1]), ("b", [0, 1]), ("a", [0, 1]), ("b", [2])]
    assert core_binding.machine_masks(ranks, 2) == ([{0, 1}, {0, 1}], 1)
    assert core_binding.machine_masks(ranks, 3) == ([{0, 1}, {2}], 1)
    assert core_binding.machine_id() == core_binding.machine_id() != ""


def test_auto_binds_where_the_weights_are_on_a_gpu():
    assert core_binding.binds("auto", torch.device("cuda", 1))
    assert not core_binding.binds("auto", torch.device("cpu"))
    assert core_binding.binds(True, torch.device("cpu"))
    assert not core_binding.binds(False, torch.device("cuda"))


def test_a_share_outside_zero_to_one_is_refused():
    with pytest.raises(ValueError, match=r"pt_reserved_cores_perc must be in \[0, 1\], got 1.5"):
        core_binding.split_cores([(0,), (1,)], 1.5)


_TRAINING = """
import json, os, sys, torch, zenflow

two = sorted(os.sched_getaffinity(0))[:2]
os.sched_setaffinity(0, two)
torch.manual_seed(0)
model = torch.nn.Linear(16, 8)
bind = {"on": True, "off": False, "auto": "auto"}[sys.argv[1]]
opt = zenflow.ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=0.5, update_interval=2,
                           select_interval=4, overlap_step=True, bind_cores=bind,
                           accumulate_on_device=sys.argv[2] == "device")
other = torch.nn.Parameter(torch.ones(1 << 16))
for step in range(6):
    model(torch.randn(4, 16)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    if step == 2:  # another user of the process's pool, between two windows
        other.grad = torch.ones_like(other)
        zenflow.CPUAdamW([other]).step()

def allowed(tid):
    return sorted(os.sched_getaffinity(int(tid)))

workers = [allowed(t) for t in os.listdir("/proc/self/task")
           if open(f"/proc/self/task/{t}/comm").read().strip() == "zenflow-adamw"]
stats = opt.stats()
print(json.dumps(dict(
    two=two, workers=workers, training=allowed(os.getpid()),
    threads=stats["cpu_pool_threads"], cpus=stats["cpu_pool_cpus"],
    split=zenflow.runtime.core_binding.place_pool(0.5, True).cpus, updates=stats["cpu_updates"],
)))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="affinity masks are Linux's")
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a split needs two CPUs")
@pytest.mark.parametrize("sums", ["host", "device"])
@pytest.mark.parametrize("bind", ["on", "off", "auto"])
def test_the_pools_workers_run_where_stats_says(bind, sums):
    """On the two CPUs the process keeps (two cores, or one core's two threads): with binding
    the workers run on the CPUs the default share leaves them and nowhere else, also after a
    ``CPUAdamW`` step (every core) between two windows, and the training thread keeps both;
    without, they run anywhere, as "auto" has them for weights on the CPU. With host-side sums
    or device-side ones (whose steps queue nothing on the pool between windows)."""
    seen = json.loads(stdout_of(["-c", _TRAINING, bind, sums], timeout_s=180))
    assert seen["updates"] > 0  # the pool ran overlapped updates
    assert seen["training"] == seen["two"]
    assert len(seen["workers"]) == seen["threads"] > 0
    if bind == "on" and seen["split"] is not None:
        assert seen["cpus"] == seen["split"] != seen["two"]
        assert all(worker == seen["cpus"] for worker in seen["workers"])
    else:
        assert seen["cpus"] == []
        assert all(worker == seen["two"] for worker in seen["workers"])


_OUTSIDE_THE_MASK = """
import os, torch
from zenflow.runtime import cpu_adam
first, other = sorted(os.sched_getaffinity(0))[:2]
os.sched_setaffinity(0, {first})
cpu_adam.set_num_threads(1)
cpu_adam.set_worker_cpus([other])
t = [torch.zeros(1 << 10) for _ in range(4)]
cpu_adam.adamw_step(*([x] for x in t), lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-8,
                    weight_decay=0.0, steps=1)
workers = [sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")
           if open(f"/proc/self/task/{t}/comm").read().strip() == "zenflow-adamw"]
assert workers == [[first]], (workers, first, other)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="affinity masks are Linux's")
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a CPU outside the mask")
def test_workers_are_never_pinned_outside_the_mask_of_the_thread_that_starts_them():
    """Asked for a CPU the process was not given (the kernel would take it), the workers stay
    where the process may run."""
    stdout_of(["-c", _OUTSIDE_THE_MASK], timeout_s=120)


def _rank_pools(rank: int, port: int, out_dir: str, runs: list[dict]) -> None:
    """One of two gloo ranks on this machine, each with the test's mask: for each of ``runs``
    (an optimizer's settings) in turn, trains a few overlapped windows and records where its
    pool says it runs and where its workers do run."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    seen = []
    try:
        for settings in runs:
            torch.manual_seed(0)
            model = torch.nn.Linear(16, 8)
            opt = zenflow.ZenFlowAdamW(
                model.parameters(),
                lr=1e-2,
                topk_ratio=0.5,
                update_interval=2,
                select_interval=4,
                overlap_step=True,
                **settings,
            )
            syncs = opt.stats()["device_syncs"]
            for _ in range(6):
                model(torch.randn(4, 16)).square().mean().backward()
                opt.step()
                opt.zero_grad()
            stats = opt.stats()
            workers = [
                sorted(os.sched_getaffinity(int(t)))
                for t in os.listdir("/proc/self/task")
                if open(f"/proc/self/task/{t}/comm").read().strip() == "zenflow-adamw"
            ]
            seen.append(
                dict(
                    threads=stats["cpu_pool_threads"],
                    cpus=stats["cpu_pool_cpus"],
                    workers=workers,
                    updates=stats["cpu_updates"],
                    syncs_when_built=syncs,
                )
            )
    finally:
        torch.distributed.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as out:
        json.dump(seen, out)


def _two_ranks(tmp_path, *runs: dict) -> list[list[dict]]:
    """Per run, each rank's record."""
    torch.multiprocessing.spawn(
        _rank_pools, args=(free_port(), str(tmp_path), list(runs)), nprocs=2, join=True
    )
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    return [list(run) for run in zip(*ranks, strict=True)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="affinity masks are Linux's")
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a split needs two CPUs")
def test_two_ranks_on_one_mask_pin_their_pools_to_cores_apart(tmp_path):
    """Two ranks started without binding (both with this process's mask): with bind_cores
    each pool's workers run on CPUs of their own, apart from the other rank's (where the mask
    holds two physical cores; on one core's two threads they stay unpinned); without, each
    rank takes threads for its half of the mask, not for all of it. Agreeing on it costs one
    synchronization when the optimizer is built."""
    mask = os.sched_getaffinity(0)
    cores = core_binding.physical_cores(mask)
    bound, unbound = _two_ranks(
        tmp_path, dict(bind_cores=True), dict(bind_cores=False, pt_reserved_cores_perc=0.0)
    )
    for rank in bound:
        assert rank["updates"] > 0  # the pool ran overlapped updates
        assert rank["syncs_when_built"] == 1
        assert len(rank["workers"]) == rank["threads"] > 0
        if len(cores) >= 2:
            assert rank["cpus"] and set(rank["cpus"]) < mask
            assert all(worker == rank["cpus"] for worker in rank["workers"])
        else:
            assert rank["cpus"] == []
    if len(cores) >= 2:
        assert set(bound[0]["cpus"]).isdisjoint(bound[1]["cpus"])
    # With no share kept for training, one rank alone would take a worker per logical CPU;
    # two take about half each.
    for rank in unbound:
        assert rank["cpus"] == []
        assert rank["threads"] == len(rank["workers"]) >= 1
    assert sum(rank["threads"] for rank in unbound) <= max(2, len(mask))
