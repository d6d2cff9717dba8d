"""Soak: 2,000 steps of a tiny model with overlap_step on (checkpoints included) leak neither
memory, threads nor file descriptors, and the loss keeps falling. Run with ``make soak``."""

import gc
import os
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zenflow

STEPS = 2000
WARM_UP = 200
CHECKPOINT_EVERY = 250
CONFIG = {
    "train_micro_batch_size_per_gpu": 16,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
    "gradient_clipping": 1.0,
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu"},
        "zenflow": {
            "topk_ratio": 0.25,
            "update_interval": 4,
            "select_interval": 16,
            "overlap_step": True,
        },
    },
}


def resources() -> dict:
    gc.collect()
    with open("/proc/self/status") as status:
        rss_kib = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return {
        "rss_mib": rss_kib / 1024,
        "threads": threading.active_count(),
        "tasks": len(os.listdir("/proc/self/task")),
        "fds": len(os.listdir("/proc/self/fd")),
    }


@pytest.mark.slow
def test_two_thousand_overlapped_steps_leak_nothing(tmp_path):
    torch.manual_seed(0)
    teacher = nn.Linear(16, 4)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    engine, *_ = zenflow.initialize(model=model, config=CONFIG)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for step in range(STEPS):
        x = torch.randn(16, 16, generator=generator)
        with torch.no_grad():
            y = torch.tanh(teacher(x))
        loss = F.mse_loss(engine(x.to(engine.device)), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if (step + 1) % CHECKPOINT_EVERY == 0:
            engine.save_checkpoint(tmp_path)
        if step + 1 == WARM_UP:
            after_warm_up = resources()
    at_end = resources()
    first, last = sum(losses[:100]) / 100, sum(losses[-100:]) / 100
    print(f"soak: after warm-up {after_warm_up}, at the end {at_end}, loss {first} -> {last}")

    drift = (at_end["rss_mib"] - after_warm_up["rss_mib"]) / after_warm_up["rss_mib"]
    assert drift < 0.05, f"resident memory grew {drift:.1%}: {after_warm_up} -> {at_end}"
    for kind in ("threads", "tasks", "fds"):
        assert at_end[kind] <= after_warm_up[kind], (kind, after_warm_up, at_end)
    assert last < 0.2 * first, (first, last)
    assert engine.stats()["cpu_updates"] == STEPS // 4
    path, _ = engine.load_checkpoint(tmp_path)  # the last of the checkpoints taken on the way
    assert path.endswith(f"global_step{STEPS}/rank0.pt")
