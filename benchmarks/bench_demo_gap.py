"""Where the main job's ZenFlow loss gap comes from: the demo's fine-tuning, side by side.

    .venv/bin/python benchmarks/bench_demo_gap.py [--steps 200] [--quick]

Every row fine-tunes the demo's pre-trained GPT (examples/finetune_gpt.py, its default sizes,
its cached pre-training) on the same batches with the demo's hyperparameters (lr 5e-4, betas
0.9/0.95, weight decay 0.1 on Linear weights, clipping at 1.0), eagerly, and reports the
validation loss and its gap to plain AdamW:

* AdamW with its gradients computed on parameters 1 or 2 steps stale (the optimizer's master
  copy runs ahead of the model's): how sensitive this fine-tuning is to staleness alone;
* ZenFlowAdamW with the demo's settings (examples/ds_config_zenflow.json), with them and
  overlap_step switched, with the step benchmark's (update_interval 4, overlap_step), the steps
  between, and update_interval "auto", with the CPU updates each made
  (benchmarks/bench_accuracy.py runs the whole grid, on three tasks).

It also prints how concentrated the gradient is, the premise of ZenFlow: the share of each
weight's squared gradient norm held by its top 10 % of columns (mean over the weights, on
AdamW's first steps).
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import finetune_gpt as demo  # noqa: E402
from gpt_model import GPT  # noqa: E402
from text_data import BatchSampler, topics_prose_bytes, train_val_split  # noqa: E402

from zenflow import ZenFlowAdamW  # noqa: E402
from zenflow.columns import column_importance, topk_count  # noqa: E402

HYPER = dict(lr=5e-4, betas=(0.9, 0.95), eps=1e-8)
CLIP = 1.0
DEMO = {
    key: demo.ZERO_OPTIMIZATION["zenflow"][key]
    for key in ("topk_ratio", "update_interval", "select_interval", "overlap_step")
}
BENCH = dict(topk_ratio=0.1, update_interval=4, select_interval=8, overlap_step=True)
VARIANTS = {
    "zenflow, the demo's settings": DEMO,
    "zenflow, the demo's, overlap switched": {**DEMO, "overlap_step": not DEMO["overlap_step"]},
    "zenflow, update 4, no overlap": {**BENCH, "overlap_step": False},
    "zenflow, update 4, overlap": BENCH,
    "zenflow, update 4, overlap, topk 0.2": {**BENCH, "topk_ratio": 0.2},
    "zenflow, update auto, no overlap": {**BENCH, "update_interval": "auto", "overlap_step": False},
}


def _args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="fine-tuning steps (200)")
    parser.add_argument("--quick", action="store_true", help="20 steps, tiny model (smoke)")
    args = parser.parse_args(argv)
    demo_argv = ["--quick"] if args.quick else []
    if args.quick:
        args.steps = 20
    return args, demo.parse_args(demo_argv)


def _model(weights, demo_args) -> GPT:
    torch.manual_seed(demo_args.seed)
    model = GPT(demo.model_config(demo_args))
    model.load_state_dict(weights)
    return model


def _top_share(model: GPT) -> float:
    """Mean over the weights of the share of squared gradient norm in the top 10 % columns."""
    shares = []
    for p in model.parameters():
        if p.dim() == 2 and p.grad is not None:
            scores = column_importance(p.grad).sort(descending=True).values
            shares.append(float(scores[: topk_count(0.1, scores.numel())].sum() / scores.sum()))
    return sum(shares) / len(shares)


def adamw(weights, data, demo_args, steps: int, stale: int = 0) -> tuple[float, list[float]]:
    """AdamW whose gradients are taken on the parameters as they were ``stale`` steps ago."""
    train_tokens, val_tokens = data
    model, master = _model(weights, demo_args), _model(weights, demo_args)
    opt = torch.optim.AdamW(master.param_groups(demo.WEIGHT_DECAY), **HYPER)
    history = [[p.detach().clone() for p in master.parameters()]]
    sampler = BatchSampler(
        train_tokens, demo_args.block_size, demo_args.batch_size, seed=demo_args.seed + 1
    )
    shares = []
    for step in range(steps):
        _, loss = model(*sampler.next_batch("cpu"))
        loss.backward()
        if step < 5:
            shares.append(_top_share(model))
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        for p_master, p_model in zip(master.parameters(), model.parameters(), strict=True):
            p_master.grad, p_model.grad = p_model.grad, None
        opt.step()
        history = (history + [[p.detach().clone() for p in master.parameters()]])[-(stale + 1) :]
        with torch.no_grad():
            for p_model, value in zip(model.parameters(), history[0], strict=True):
                p_model.copy_(value)
    with torch.no_grad():
        for p_model, p_master in zip(model.parameters(), master.parameters(), strict=True):
            p_model.copy_(p_master)
    return demo.evaluate(model, val_tokens, demo_args), shares


def zenflow(weights, data, demo_args, steps: int, settings: dict) -> tuple[float, int]:
    train_tokens, val_tokens = data
    model = _model(weights, demo_args)
    opt = ZenFlowAdamW(
        model.param_groups(demo.WEIGHT_DECAY),
        step_backend="eager",
        max_grad_norm=CLIP,
        **HYPER,
        **settings,
    )
    sampler = BatchSampler(
        train_tokens, demo_args.block_size, demo_args.batch_size, seed=demo_args.seed + 1
    )
    for _ in range(steps):
        _, loss = model(*sampler.next_batch("cpu"))
        loss.backward()
        opt.step()
        opt.zero_grad()
    opt.flush()
    return demo.evaluate(model, val_tokens, demo_args), opt.stats()["cpu_updates"]


def main() -> None:
    args, demo_args = _args()
    print("# bench_demo_gap: the demo's fine-tuning, AdamW (fresh and stale) against ZenFlow")
    weights = demo.pretrained_weights(demo_args)
    data = train_val_split(topics_prose_bytes())
    rows = []
    started = time.perf_counter()
    base, shares = adamw(weights, data, demo_args, args.steps)
    rows.append(("AdamW", base, None))
    for stale in (1, 2):
        rows.append(
            (
                f"AdamW, parameters {stale} step(s) stale",
                adamw(weights, data, demo_args, args.steps, stale)[0],
                None,
            )
        )
    for name, settings in VARIANTS.items():
        rows.append((name, *zenflow(weights, data, demo_args, args.steps, settings)))
    print(
        f"\n{args.steps} fine-tuning steps, batch {demo_args.batch_size}; top 10 % of columns "
        f"hold {sum(shares) / len(shares):.0%} of the squared gradient norm (mean over weights, "
        f"AdamW's first {len(shares)} steps); {time.perf_counter() - started:.0f} s"
    )
    width = max(len(name) for name, _, _ in rows)
    header = f"{'run':<{width}} {'val loss':>9} {'vs AdamW':>9} {'CPU updates':>12}"
    print(header)
    print("-" * len(header))
    for name, loss, updates in rows:
        print(
            f"{name:<{width}} {loss:>9.4f} {100 * (loss / base - 1):>+8.1f}% "
            f"{'' if updates is None else updates:>12}"
        )


if __name__ == "__main__":
    # Each line reaches a pipe or a log file when printed, not at exit: rows of a long run.
    sys.stdout.reconfigure(line_buffering=True)
    main()
