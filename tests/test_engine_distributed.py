"""The engine under data parallelism: two gloo processes equal one on the same global batch."""

import os
import socket

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import zenflow
from tests.gloo_threads import gloo_threads
from tests.zero_configs import overlapped_zenflow_zero

ZENFLOW = overlapped_zenflow_zero()
PLAIN = {"stage": 0}


def config(zero: dict, micro_batch: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "gradient_clipping": 0.5,
        "zero_optimization": zero,
    }


def train(zero: dict, world_size: int, rank: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    engine, *_ = zenflow.initialize(model=model, config=config(zero, 8 // world_size))
    g = torch.Generator().manual_seed(1)
    for _ in range(10):
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        shard = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
        engine.backward(F.mse_loss(engine(x[shard]), y[shard]))
        engine.step()
    engine.flush()
    return [p.detach().clone() for p in model.parameters()]


def _rank(rank: int, port: int, zero: dict, out_dir: str) -> None:
    # What torchrun and the deepspeed launcher set; the engine initializes the process group.
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank)
    )
    os.environ["WORLD_SIZE"] = "2"
    try:
        params = train(zero, 2, rank)
    finally:
        torch.distributed.destroy_process_group()
    torch.save((params, gloo_threads()), os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("zero", [ZENFLOW, PLAIN], ids=["zenflow-stage2", "adamw"])
def test_two_launched_ranks_equal_one_process(tmp_path, zero):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    torch.multiprocessing.spawn(_rank, args=(port, zero, str(tmp_path)), nprocs=2, join=True)
    single = train(zero, 1, 0)
    for rank in range(2):
        params, threads_after_destroy = torch.load(tmp_path / f"rank{rank}.pt")
        assert_close(params, single, rtol=1e-5, atol=1e-6)
        # The engine created the process group; once destroyed nothing keeps it (or the
        # threads that could abort the rank at exit) alive.
        assert threads_after_destroy == []
