"""A data-parallel training run for tests: ``run(rank, world_size, port, out_dir, settings)``.

Each rank trains on its slice of every global batch; rank 0 saves the final parameters and
every rank its host-state size, for the test to compare with a single-process run.
"""

import os
import warnings

import torch
import torch.distributed as dist

# Before the process group exists, as zenflow.initialize does it (see zenflow/engine.py):
# imported later, it would keep the group, and gloo's threads, alive past destroy_process_group.
import torch.distributed.nn.functional  # noqa: F401

from tests.gloo_threads import gloo_threads
from tests.models import batches, build, loss_of
from zenflow.optimizer import ZenFlowAdamW
from zenflow.runtime import comm


def train(world_size: int, rank: int, settings: dict) -> tuple[torch.nn.Module, ZenFlowAdamW]:
    settings = dict(settings)
    compiled = settings.pop("compiled", False)
    as_over_nccl = settings.pop("as_over_nccl", False)
    torch_clip = settings.pop("torch_clip", None)  # torch.nn.utils.clip_grad_norm_ after backward
    model = build("mlp")
    # NCCL's path for host tensors (a copy on the collective's device, results copied back),
    # with the CPU standing in for the GPU.
    comm._route_host_tensors_for_tests(torch.device("cpu") if as_over_nccl else None)
    opt = ZenFlowAdamW(model.parameters(), step_backend="eager", **settings)
    forward = (
        torch.compile(model, backend="zenflow", options={"inner": "eager"}) if compiled else model
    )
    opt.staged_rows_after_backward = []
    opt.syncs_by_step = []
    for inputs, targets in batches("mlp", 12):
        shard = slice(rank * len(inputs) // world_size, (rank + 1) * len(inputs) // world_size)
        opt.zero_grad()
        loss_of("mlp", forward, inputs[shard], targets[shard]).backward()
        unselected = [
            p.shape[1] - opt.selected_columns(p).numel() for p in model.parameters() if p.dim() >= 2
        ]
        opt.staged_rows_after_backward.append((opt.staged_host_rows(), unselected))
        if torch_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), torch_clip)
        before = opt.stats()["device_syncs"]
        opt.step()
        opt.syncs_by_step.append(opt.stats()["device_syncs"] - before)
    opt.flush()
    return model, opt


def run(rank: int, world_size: int, port: int, out_dir: str, settings: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, opt = train(world_size, rank, settings)
        result = {
            "distributed_warnings": [
                str(w.message) for w in caught if f"torch{os.sep}distributed" in w.filename
            ],
            "params": [p.detach() for p in model.parameters()],
            "host_columns": opt.stats()["host_columns"],
            "staged_rows_after_backward": opt.staged_rows_after_backward,
            "syncs_by_step": opt.syncs_by_step,
        }
    finally:
        dist.destroy_process_group()
    result["gloo_threads_after_destroy"] = gloo_threads()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


COUNTED_COLLECTIVES = ("all_reduce", comm.REDUCE_SCATTER, comm.ALL_GATHER)


def collectives_by_step(rank: int, world_size: int, port: int, out_dir: str, settings: dict):
    """For each count in ``settings["weights"]``, trains a stack of that many Linear layers (12
    steps, update_interval 2, select_interval 4, overlap) on this rank's half of every batch;
    saves, per count and step, the synchronizations its ``step()`` took and the collectives
    it issued, by name."""
    settings = dict(settings)
    counts = settings.pop("weights")
    comm._route_host_tensors_for_tests(torch.device("cpu"))  # NCCL's path for host tensors
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    issued = dict.fromkeys(COUNTED_COLLECTIVES, 0)

    def counting(name, collective):
        def call(*args, **kwargs):
            issued[name] += 1
            return collective(*args, **kwargs)

        return call

    originals = {name: getattr(dist, name) for name in COUNTED_COLLECTIVES}
    by_count = {}
    try:
        for name, collective in originals.items():
            setattr(dist, name, counting(name, collective))
        for weights in counts:
            by_count[weights] = _count_steps(rank, weights, issued, settings)
    finally:
        for name, collective in originals.items():
            setattr(dist, name, collective)
        dist.destroy_process_group()
        comm._route_host_tensors_for_tests(None)
    torch.save(by_count, os.path.join(out_dir, f"rank{rank}.pt"))


def _count_steps(rank: int, weights: int, issued: dict, settings: dict) -> list:
    torch.manual_seed(0)
    layers = []
    for _ in range(weights):
        layers += [torch.nn.Linear(12, 12), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers)
    opt = ZenFlowAdamW(
        model.parameters(),
        lr=1e-2,
        topk_ratio=0.25,
        update_interval=2,
        select_interval=4,
        overlap_step=True,
        step_backend="eager",
        **settings,
    )
    g = torch.Generator().manual_seed(1)
    steps = []
    for _ in range(12):
        x = torch.randn(8, 12, generator=g) * torch.linspace(0.1, 3.0, 12)
        opt.zero_grad()
        model(x[rank * 4 : rank * 4 + 4]).square().mean().backward()
        before, syncs = dict(issued), opt.stats()["device_syncs"]
        opt.step()
        after = opt.stats()["device_syncs"]
        steps.append((after - syncs, {name: issued[name] - before[name] for name in issued}))
    return steps
