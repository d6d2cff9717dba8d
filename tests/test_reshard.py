"""Checkpoints resumed at another world size: the run continues as it would have."""

import os
import socket

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import zenflow
from tests.zero_configs import overlapped_zenflow_zero
from zenflow.runtime.comm import DataParallel
from zenflow.runtime.reshard import reshard
from zenflow.runtime.state_schema import saved_weights

STEPS, SAVED_AT, BATCH = 12, 7, 12


def config(world_size: int, stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": BATCH // world_size,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        # Windows close at steps 2 and 6 in the background, 4 and 8 before a reselection:
        # after step 7 the update of window 6 is pending and window 8 is open.
        "zero_optimization": overlapped_zenflow_zero(stage) if stage else {"stage": 0},
    }


def model() -> nn.Module:
    torch.manual_seed(0)
    # In one process the first layer's gradients (batch 12 against 64 columns) are kept as
    # factors through a window: resharding multiplies them into the window's sum.
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))


def run(world_size, rank, stage, stop, load_dir=None, save_dir=None) -> list[torch.Tensor]:
    net = model()
    engine, *_ = zenflow.initialize(model=net, config=config(world_size, stage))
    if world_size == 1:  # compiled: gradients reach the runtime as factors only from a graph
        torch._dynamo.reset()
        engine.compile(options={"inner": "eager"})
    if load_dir is not None:
        engine.load_checkpoint(load_dir)
    shard = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
    for step in range(engine.global_steps, stop):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(BATCH, 64, generator=g), torch.randn(BATCH, 8, generator=g)
        engine.backward(F.mse_loss(engine(x[shard]), y[shard]))
        engine.step()
    if save_dir is not None:
        engine.save_checkpoint(save_dir, tag="mid")
        if world_size == 1 and stage:
            saved = saved_weights(engine.optimizer.state_dict())
            assert any(weight["window_factors"] for weight in saved)
    engine.flush()
    return [p.detach().clone() for p in net.parameters()]


def _rank(rank, world_size, port, stage, stop, load_dir, save_dir, out_dir) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    try:
        params = run(world_size, rank, stage, stop, load_dir, save_dir)
        torch.save(params, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


def launched(world_size, stage, stop, tmp_path, load_dir=None, save_dir=None):
    """``run`` in ``world_size`` gloo processes; every rank's final parameters."""
    if world_size == 1:
        return [run(1, 0, stage, stop, load_dir, save_dir)]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out_dir = tmp_path / f"out{world_size}"
    out_dir.mkdir(exist_ok=True)
    args = (world_size, port, stage, stop, load_dir, save_dir, str(out_dir))
    torch.multiprocessing.spawn(_rank, args=args, nprocs=world_size, join=True)
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(world_size)]


@pytest.mark.parametrize(
    "saved_by, loaded_by, stage",
    # stage 0: data-parallel AdamW, whose whole state every rank holds.
    [(2, 1, 2), (2, 1, 1), (1, 2, 2), (2, 3, 2), (2, 1, 0)],
)
def test_a_checkpoint_resumes_at_another_world_size(tmp_path, saved_by, loaded_by, stage):
    straight = run(1, 0, stage, STEPS)
    launched(saved_by, stage, SAVED_AT, tmp_path, save_dir=str(tmp_path / "ckpt"))
    resumed = launched(loaded_by, stage, STEPS, tmp_path, load_dir=str(tmp_path / "ckpt"))
    # Straight runs of this model at 1 and 2 ranks differ by up to 7e-6 (one weight whose
    # second moment is tiny); a row in the wrong place would differ by about the lr, 1e-2.
    for params in resumed:
        assert_close(params, straight, rtol=1e-4, atol=2e-5)


def test_resharding_to_the_saved_layout_changes_nothing():
    """One process: the resharded state is the saved one, so training goes on bitwise alike."""
    runs = []
    for reshape in (False, True):
        net = model()
        optimizer = zenflow.ZenFlowAdamW(
            net.parameters(), lr=1e-2, topk_ratio=0.25, update_interval=2, select_interval=4
        )
        g = torch.Generator().manual_seed(0)
        data = [(torch.randn(BATCH, 64, generator=g), torch.randn(BATCH, 8, generator=g))]
        data *= 10
        for step, (x, y) in enumerate(data):
            if step == 6:  # a window boundary: no factors are waiting in a window's sum
                state = optimizer.state_dict()
                if reshape:
                    state = reshard([state], 1, 0, DataParallel().block)
                optimizer.load_state_dict(state)
            optimizer.zero_grad()
            F.mse_loss(net(x), y).backward()
            optimizer.step()
        optimizer.flush()
        runs.append([p.detach().clone() for p in net.parameters()])
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


def test_reshard_refuses_an_incomplete_set_of_ranks():
    net = model()
    state = zenflow.ZenFlowAdamW(net.parameters()).state_dict()
    with pytest.raises(ValueError, match="every saved rank in rank order"):
        reshard([state, state], 1, 0, lambda columns, rank: (0, columns))
    with pytest.raises(ValueError, match="got none"):
        reshard([], 1, 0, lambda columns, rank: (0, columns))


def test_a_state_dict_from_another_world_size_points_to_load_resharded():
    optimizer = zenflow.ZenFlowAdamW(model().parameters())
    state = {**optimizer.state_dict(), "world_size": 2}
    with pytest.raises(ValueError, match="rank 0 of 2 cannot load into rank 0 of 1.*load_resh"):
        optimizer.load_state_dict(state)
