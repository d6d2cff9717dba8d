"""Two ranks train with ZenFlowAdamW over gloo; rank 1 dies (or hangs) at step 4:

    run(rank, port, timeout_s, mode, out_dir)   # mode "die" or "hang"

Rank 0 writes what its failing step raised, and how long that took, to out_dir/rank0.json.
"""

import datetime
import json
import os
import time

import torch.distributed as dist

from tests.models import batches, build, loss_of
from zenflow.optimizer import ZenFlowAdamW

FAILING_STEP = 4


def run(rank: int, port: int, timeout_s: float, mode: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timeout)
    model = build("mlp")
    opt = ZenFlowAdamW(
        model.parameters(),
        step_backend="eager",
        topk_ratio=0.25,
        update_interval=2,
        select_interval=4,
        overlap_step=True,
    )
    for step, (inputs, targets) in enumerate(batches("mlp", 20)):
        if rank == 1 and step == FAILING_STEP:
            if mode == "die":
                os._exit(1)
            time.sleep(3600)  # alive, but never joins another collective
        half = slice(rank * 4, rank * 4 + 4)
        opt.zero_grad()
        loss_of("mlp", model, inputs[half], targets[half]).backward()
        started = time.monotonic()
        try:
            opt.step()
        except Exception as error:
            result = {
                "step": step,
                "type": type(error).__name__,
                "message": str(error),
                "seconds": time.monotonic() - started,
                "failed_state": opt.failure is error,
            }
            with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as file:
                json.dump(result, file)
            os._exit(0)  # the process group cannot be torn down cleanly with a dead peer
    os._exit(2)  # rank 0 must not finish training
