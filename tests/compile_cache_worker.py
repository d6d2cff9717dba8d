"""Trains a small MLP compiled with backend "zenflow" (Inductor) in a fresh process and prints,
as JSON, what torch.compile's AOTAutograd cache did and a digest of the trained weights.

    python -m tests.compile_cache_worker [--bystander]

``--bystander``: another model of the same shapes and its optimizer come first, so this model's
weights get other registry slots than in a run without it (a graph compiled for those slots
would hand this model's gradients to the bystander). The cache folder is the caller's
``TORCHINDUCTOR_CACHE_DIR``.
"""

import argparse
import hashlib
import json

import torch
from torch._dynamo.utils import counters

from tests.models import batches, build, loss_of
from zenflow.optimizer import ZenFlowAdamW


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bystander", action="store_true")
    args = parser.parse_args()
    # step_backend "eager": the optimizer's own compiled step stays out of the cache counts.
    settings = dict(
        lr=1e-2, topk_ratio=0.25, update_interval=2, select_interval=4, step_backend="eager"
    )
    bystander_opt = ZenFlowAdamW(build("mlp").parameters(), **settings) if args.bystander else None
    model = build("mlp")
    opt = ZenFlowAdamW(model.parameters(), **settings)
    compiled = torch.compile(model, backend="zenflow")
    for inputs, targets in batches("mlp", 6):
        opt.zero_grad()
        loss_of("mlp", compiled, inputs, targets).backward()
        opt.step()
    opt.flush()
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
    aot = counters["aot_autograd"]
    result = {
        "hits": aot["autograd_cache_hit"],
        "misses": aot["autograd_cache_miss"],
        "weights": digest.hexdigest(),
        "bystander_untouched": bystander_opt is None or not any(bystander_opt.staged_host_rows()),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
