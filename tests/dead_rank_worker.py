"""Two engine ranks train over gloo, launched as torchrun would, and save a checkpoint to
out_dir/ckpt after step 2; rank 1 dies (or hangs) at step 4:

    run(rank, port, timeout_s, mode, zero, out_dir)   # mode "die", "hang" or "die-in-save"

With "die-in-save" rank 0 saves a checkpoint at step 4 instead of training. Rank 0 writes what
its failing call raised, and how long that call took, to out_dir/rank0.json.
"""

import json
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

import zenflow

FAILING_STEP = 4


def run(rank: int, port: int, timeout_s: float, mode: str, zero: dict, out_dir: str) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": zero,
        "process_group_timeout_s": timeout_s,
    }
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    engine, *_ = zenflow.initialize(model=model, config=config)
    generator = torch.Generator().manual_seed(rank)
    for step in range(20):
        if rank == 1 and step == FAILING_STEP:
            if mode == "die":
                os._exit(1)
            time.sleep(3600)  # alive, but never joins another collective
        started = time.monotonic()
        try:
            if step == FAILING_STEP and mode == "die-in-save":
                engine.save_checkpoint(os.path.join(out_dir, "ckpt"))
            x, y = torch.randn(4, 6, generator=generator), torch.randn(4, 3, generator=generator)
            engine.backward(F.mse_loss(engine(x), y))
            engine.step()
            if step == 1:
                engine.save_checkpoint(os.path.join(out_dir, "ckpt"))
        except Exception as error:
            failure = getattr(engine.optimizer, "failure", None)
            result = {
                "step": step,
                "type": type(error).__name__,
                "message": str(error),
                "seconds": time.monotonic() - started,
                "failed_state": failure is error,
            }
            with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as file:
                json.dump(result, file)
            os._exit(0)  # the process group cannot be torn down cleanly with a dead peer
    os._exit(2)  # rank 0 must not finish training
