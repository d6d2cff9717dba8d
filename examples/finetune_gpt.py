"""The main job: fine-tune a small byte-level GPT with ZenFlow, next to plain AdamW.

1. Pre-train briefly with AdamW on the standard library's Python sources (cached on disk).
2. Fine-tune on English prose (pydoc's help topics) with ZenFlow AdamW: each step the top
   ``topk_ratio`` columns of every weight (by gradient energy) are updated; the rest accumulate
   their gradients and are updated together every ``update_interval`` steps.
3. Fine-tune again from the same weights, on the same batches, with plain AdamW as the baseline.
4. Print a comparison table and save the loss curves as a PNG.

This version runs ZenFlow's eager reference optimizer (``zenflow.reference``) on an eager model.

    python examples/finetune_gpt.py            # the demo, about 2-3 minutes on 2 CPU cores
    python examples/finetune_gpt.py --quick    # a few seconds, for the test suite
"""

import argparse
import statistics
import time
from pathlib import Path

import torch
from gpt_model import GPT, GPTConfig
from matplotlib.figure import Figure
from text_data import BatchSampler, stdlib_source_bytes, topics_prose_bytes, train_val_split
from tqdm import tqdm

from zenflow.reference import ReferenceZenFlowAdamW

HERE = Path(__file__).resolve().parent
PRETRAIN_LR = 2e-3
FINETUNE_LR = 5e-4
BETAS = (0.9, 0.95)
EPS = 1e-8
WEIGHT_DECAY = 0.1
TRAIN_LOSS_TAIL = 10  # the table's train loss: mean of the last steps (one batch is noisy)

# --quick: a tiny model and a few steps; flags given explicitly still win.
QUICK = dict(
    steps=30,
    pretrain_steps=30,
    batch_size=8,
    n_layer=2,
    n_head=2,
    n_embd=64,
    block_size=32,
    eval_batches=4,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=250, help="fine-tuning steps per optimizer")
    parser.add_argument("--pretrain-steps", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--topk-ratio", type=float, default=0.1)
    parser.add_argument("--update-interval", type=int, default=4)
    parser.add_argument(
        "--select-interval", type=int, default=8, help="steps between column reselections"
    )
    parser.add_argument("--eval-batches", type=int, default=16, help="validation batches")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=HERE.parent / "runs")
    parser.add_argument("--cache-dir", type=Path, default=HERE / "cache")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--quick", action="store_true", help="a very short run (tests)")
    args = parser.parse_args(argv)
    if args.quick:
        parser.set_defaults(**QUICK)
        args = parser.parse_args(argv)
    return args


def model_config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(
        block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd
    )


def synchronize(device: str) -> None:
    """Wait for queued GPU work, so that step times measure the work and not its launch."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def train(
    model: GPT,
    optimizer: torch.optim.Optimizer,
    sampler: BatchSampler,
    steps: int,
    device: str,
    desc: str,
) -> tuple[list[float], list[float]]:
    """Run ``steps`` optimizer steps; returns the per-step losses and step times (seconds)."""
    model.train()
    losses, times, skipped = [], [], 0
    progress = tqdm(range(steps), desc=desc)
    for _ in progress:
        x, y = sampler.next_batch(device)
        start = time.perf_counter()
        _, loss = model(x, y)
        loss.backward()
        # ZenFlow returns False for a skipped step (non-finite gradient); torch returns None.
        if optimizer.step() is False:
            skipped += 1
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
        progress.set_postfix(loss=f"{losses[-1]:.3f}", step_ms=f"{times[-1] * 1e3:.0f}")
    if skipped:
        print(f"{desc}: {skipped} steps skipped (non-finite gradients)")
    return losses, times


@torch.no_grad()
def evaluate(model: GPT, tokens: torch.Tensor, args: argparse.Namespace) -> float:
    """Mean loss over ``eval_batches`` batches; the fixed seed makes every call see the same ones."""
    model.eval()
    sampler = BatchSampler(tokens, args.block_size, args.batch_size, seed=args.seed)
    losses = [model(*sampler.next_batch(args.device))[1].item() for _ in range(args.eval_batches)]
    return sum(losses) / len(losses)


def pretrained_weights(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """Pre-train on stdlib code with AdamW, or load the result of an earlier identical run.

    The cache key covers what shapes the result; delete the cache after changing this code."""
    config = model_config(args)
    key = (
        f"gpt_L{config.n_layer}_H{config.n_head}_E{config.n_embd}_T{config.block_size}"
        f"_steps{args.pretrain_steps}_bs{args.batch_size}_seed{args.seed}.pt"
    )
    path = args.cache_dir / key
    if path.exists():
        print(f"pre-training: using cached weights {path}")
        return torch.load(path, map_location=args.device)

    torch.manual_seed(args.seed)
    model = GPT(config).to(args.device)
    train_tokens, val_tokens = train_val_split(stdlib_source_bytes())
    sampler = BatchSampler(train_tokens, args.block_size, args.batch_size, seed=args.seed)
    optimizer = torch.optim.AdamW(
        model.param_groups(WEIGHT_DECAY), lr=PRETRAIN_LR, betas=BETAS, eps=EPS
    )
    train(model, optimizer, sampler, args.pretrain_steps, args.device, desc="pre-training")
    print(f"pre-training: val loss on stdlib code {evaluate(model, val_tokens, args):.4f}")
    # Write then rename: an interrupted run never leaves a half-written cache entry.
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    torch.save(model.state_dict(), partial)
    partial.replace(path)
    print(f"pre-training: cached weights at {path}")
    return model.state_dict()


def make_optimizer(name: str, model: GPT, args: argparse.Namespace) -> torch.optim.Optimizer:
    groups = model.param_groups(WEIGHT_DECAY)
    if name == "zenflow-reference":
        return ReferenceZenFlowAdamW(
            groups,
            lr=FINETUNE_LR,
            betas=BETAS,
            eps=EPS,
            weight_decay=WEIGHT_DECAY,
            topk_ratio=args.topk_ratio,
            update_interval=args.update_interval,
            select_interval=args.select_interval,
        )
    return torch.optim.AdamW(groups, lr=FINETUNE_LR, betas=BETAS, eps=EPS)


def finetune(name: str, weights: dict, data: tuple, args: argparse.Namespace) -> dict:
    """Fine-tune a copy of the pre-trained model; every optimizer sees the same batches."""
    train_tokens, val_tokens = data
    model = GPT(model_config(args)).to(args.device)
    model.load_state_dict(weights)
    optimizer = make_optimizer(name, model, args)
    sampler = BatchSampler(train_tokens, args.block_size, args.batch_size, seed=args.seed + 1)

    val_before = evaluate(model, val_tokens, args)
    losses, times = train(model, optimizer, sampler, args.steps, args.device, desc=name)
    # ZenFlow holds part of the update back (the unselected columns' open window): apply it
    # before evaluating. Plain AdamW has nothing pending.
    if hasattr(optimizer, "flush"):
        optimizer.flush()
    val_after = evaluate(model, val_tokens, args)
    print(f"{name}: val loss on prose {val_before:.4f} -> {val_after:.4f}")
    return dict(losses=losses, times=times, val_before=val_before, val_after=val_after)


def print_table(results: dict[str, dict], steps: int) -> None:
    print(f"\nfine-tuning, {steps} steps")
    print(f"{'optimizer':<20}{'train_loss':>12}{'val_loss':>10}{'median_step_ms':>16}")
    for name, r in results.items():
        train_loss = statistics.fmean(r["losses"][-TRAIN_LOSS_TAIL:])
        step_ms = statistics.median(r["times"]) * 1e3
        print(f"{name:<20}{train_loss:>12.4f}{r['val_after']:>10.4f}{step_ms:>16.1f}")
    print(f"(train_loss: mean of the last {TRAIN_LOSS_TAIL} steps)")
    # Keep readers from taking the reference's step time for ZenFlow's speed.
    print("(zenflow-reference is the eager numerical oracle, not the offloading runtime)\n")


def smoothed(values: list[float], weight: float = 0.9) -> list[float]:
    """Exponential moving average, as TensorBoard draws it: the trend through noisy batches."""
    out, average = [], values[0]
    for v in values:
        average = weight * average + (1 - weight) * v
        out.append(average)
    return out


def plot(results: dict[str, dict], path: Path) -> None:
    # A bare Figure (no pyplot) renders with matplotlib's Agg backend: no display needed.
    fig = Figure(figsize=(8, 5))
    ax = fig.subplots()
    for name, r in results.items():
        (line,) = ax.plot(r["losses"], alpha=0.25, linewidth=1)
        color = line.get_color()
        ax.plot(smoothed(r["losses"]), color=color, label=f"{name} train (smoothed)")
        ax.plot(
            [0, len(r["losses"])],
            [r["val_before"], r["val_after"]],
            "o",
            markersize=8,
            color=color,
            label=f"{name} val (before, after)",
        )
    ax.set_xlabel("fine-tuning step")
    ax.set_ylabel("cross-entropy loss (nats per byte)")
    ax.set_title("GPT fine-tuning on pydoc topics: ZenFlow vs AdamW")
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def main() -> None:
    args = parse_args()
    weights = pretrained_weights(args)
    data = train_val_split(topics_prose_bytes())
    results = {name: finetune(name, weights, data, args) for name in ("zenflow-reference", "adamw")}
    print_table(results, args.steps)
    png = args.out_dir / "finetune_gpt.png"
    plot(results, png)
    print(f"loss curves: {png}")
    zenflow = results["zenflow-reference"]
    print(
        f"final: val_loss_before={zenflow['val_before']:.4f} val_loss_after={zenflow['val_after']:.4f}"
    )


if __name__ == "__main__":
    main()
