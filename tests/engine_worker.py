"""The checkpoint test's training run, importable and runnable in a fresh process:

    python -m tests.engine_worker CHECKPOINT_DIR OUT_FILE

builds the engine, resumes from CHECKPOINT_DIR's latest tag, trains steps 10..19 and writes the
module's state dict (before and after flush) and the returned client_state to OUT_FILE.
"""

import sys

import torch
import torch.nn.functional as F
from torch import nn

import zenflow

ACCUMULATION = 2
CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": ACCUMULATION,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
    "gradient_clipping": 1.0,
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu"},
        # Windows close at steps 4, 8, 12, 16 and 20, all in the background; 12 is a select
        # boundary too, where that step's gradient chooses the next selection.
        "zenflow": {
            "topk_ratio": 0.25,
            "update_interval": 4,
            "select_interval": 12,
            "overlap_step": True,
        },
    },
}


def build():
    torch.manual_seed(0)
    # Dropout draws from the global RNG: resuming exactly needs the RNG state restored.
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.1), nn.Tanh(), nn.Linear(16, 4))
    engine, *_ = zenflow.initialize(
        model=model,
        config=CONFIG,
        lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: 0.95**step
        ),
    )
    return engine


def train(engine, start: int, stop: int) -> None:
    for step in range(start, stop):
        for micro in range(ACCUMULATION):
            generator = torch.Generator().manual_seed(step * ACCUMULATION + micro)
            x = torch.randn(4, 8, generator=generator)
            y = torch.randn(4, 4, generator=generator)
            engine.backward(F.mse_loss(engine(x.to(engine.device)), y.to(engine.device)))
            engine.step()


def results(engine) -> dict:
    raw = {name: value.clone() for name, value in engine.module.state_dict().items()}
    engine.flush()
    return {"raw": raw, "flushed": engine.module.state_dict()}


def main(checkpoint_dir: str, out_file: str) -> None:
    engine = build()
    _, client_state = engine.load_checkpoint(checkpoint_dir)
    train(engine, 10, 20)
    torch.save({**results(engine), "client_state": client_state}, out_file)


if __name__ == "__main__":
    main(*sys.argv[1:])
