"""The main job: fine-tune a small byte-level GPT with ZenFlow, next to the alternatives.

The regime ZenFlow is for: weights large against the batch (a 14M-parameter GPT of two wide
blocks, one 32-byte sequence per step), so that AdamW's pass over every parameter is a large
share of its step.

1. Pre-train briefly with AdamW on the standard library's Python sources (cached on disk).
2. Fine-tune on English prose (pydoc's help topics) through ``zenflow.initialize`` with a
   DeepSpeed JSON config and the ``zenflow`` torch.compile backend, three times from the same
   weights on the same batches:
   * ``zenflow``: ``ds_config_zenflow.json``, the top ``topk_ratio`` columns of every weight
     updated each step on the device, the rest every ``update_interval`` steps by the CPU AdamW;
   * ``zero-offload``: ``ds_config_offload.json``, every update on the CPU, every step;
   * ``adamw``: ``ds_config_adamw.json``, plain AdamW without offloading (torch's fused
     kernel: on the CPU 5.7x faster than its foreach one, see benchmarks/bench_cpu_adam.py).
   The model's graphs run the same way in all three (eager by default on the CPU).
3. Print a comparison table, save the loss curves and step-time breakdown as a PNG, save a
   checkpoint of the ZenFlow run (``--resume`` continues from it) and export its weights.

    python examples/finetune_gpt.py            # the demo, a few minutes on 2 CPU cores
    python examples/finetune_gpt.py --resume   # continue the ZenFlow run from its checkpoint
    python examples/finetune_gpt.py --quick    # seconds, for the test suite
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from gpt_model import GPT, GPTConfig
from matplotlib.figure import Figure
from progress import Progress
from text_data import BatchSampler, stdlib_source_bytes, topics_prose_bytes, train_val_split

import zenflow

HERE = Path(__file__).resolve().parent
PRETRAIN_LR = 2e-3
WEIGHT_DECAY = 0.1
# Every run's mean step is taken over whole select cycles of the ZenFlow config, so that the
# rows compare the same steps.
ZERO_OPTIMIZATION = json.loads((HERE / "ds_config_zenflow.json").read_text())["zero_optimization"]
SELECT_CYCLE = ZERO_OPTIMIZATION["zenflow"]["select_interval"]
TRAIN_LOSS_TAIL = 10  # the table's train loss: mean of the last steps (one batch is noisy)
RUNS = {
    "zenflow": HERE / "ds_config_zenflow.json",
    "zero-offload": HERE / "ds_config_offload.json",
    "adamw": HERE / "ds_config_adamw.json",
}

# --quick: a tiny model and a few steps; flags given explicitly still win.
QUICK = dict(
    steps=24,
    pretrain_steps=30,
    pretrain_batch_size=8,
    batch_size=8,
    n_layer=2,
    n_head=2,
    n_embd=64,
    block_size=32,
    eval_batches=4,
    eval_batch_size=8,
    step_backend="eager",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="fine-tuning steps per run")
    parser.add_argument("--pretrain-steps", type=int, default=300)
    parser.add_argument("--pretrain-batch-size", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=1, help="fine-tuning sequences per step")
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=768)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--topk-ratio", type=float, help="overrides the ZenFlow config")
    parser.add_argument("--update-interval", type=int, help="overrides the ZenFlow config")
    parser.add_argument("--select-interval", type=int, help="overrides the ZenFlow config")
    parser.add_argument("--eval-batches", type=int, default=32, help="validation batches")
    parser.add_argument("--eval-batch-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=HERE.parent / "runs")
    parser.add_argument("--cache-dir", type=Path, default=HERE / "cache")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--inner",
        choices=("eager", "inductor"),
        help="what runs the rewritten graphs: Inductor (default on cuda) or eager (default on "
        "cpu, where Inductor's compile time would dwarf a short demo)",
    )
    parser.add_argument(
        "--step-backend",
        default="auto",
        choices=("auto", "inductor", "eager"),
        help="what runs ZenFlow's step over the selected columns (auto: Inductor on the CPU)",
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue the ZenFlow run from its checkpoint"
    )
    parser.add_argument("--quick", action="store_true", help="a very short run (tests)")
    args = parser.parse_args(argv)
    if args.quick:
        parser.set_defaults(**QUICK)
        args = parser.parse_args(argv)
    if args.inner is None:
        args.inner = "inductor" if args.device.startswith("cuda") else "eager"
    return args


def model_config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(
        block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd
    )


def synchronize(device: str) -> None:
    """Wait for queued GPU work, so that step times measure the work and not its launch."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.no_grad()
def evaluate(model: GPT, tokens: torch.Tensor, args: argparse.Namespace) -> float:
    """Mean loss over ``eval_batches`` batches; the fixed seed makes every call see the same ones."""
    model.eval()
    sampler = BatchSampler(tokens, args.block_size, args.eval_batch_size, seed=args.seed)
    losses = [model(*sampler.next_batch(args.device))[1].item() for _ in range(args.eval_batches)]
    model.train()
    return sum(losses) / len(losses)


def pretrained_weights(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """Pre-train on stdlib code with AdamW, or load the result of an earlier identical run.

    The cache key covers what shapes the result; delete the cache after changing this code."""
    config = model_config(args)
    key = (
        f"gpt_L{config.n_layer}_H{config.n_head}_E{config.n_embd}_T{config.block_size}"
        f"_steps{args.pretrain_steps}_bs{args.pretrain_batch_size}_seed{args.seed}.pt"
    )
    path = args.cache_dir / key
    if path.exists():
        print(f"pre-training: using cached weights {path}")
        return torch.load(path, map_location=args.device)

    torch.manual_seed(args.seed)
    model = GPT(config).to(args.device)
    train_tokens, val_tokens = train_val_split(stdlib_source_bytes())
    sampler = BatchSampler(train_tokens, args.block_size, args.pretrain_batch_size, seed=args.seed)
    optimizer = torch.optim.AdamW(model.param_groups(WEIGHT_DECAY), lr=PRETRAIN_LR)
    for _ in Progress(args.pretrain_steps, "pre-training"):
        _, loss = model(*sampler.next_batch(args.device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    print(f"pre-training: val loss on stdlib code {evaluate(model, val_tokens, args):.4f}")
    # Write then rename: an interrupted run never leaves a half-written cache entry.
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    torch.save(model.state_dict(), partial)
    partial.replace(path)
    print(f"pre-training: cached weights at {path}")
    return model.state_dict()


def ds_config(name: str, args: argparse.Namespace) -> dict:
    """The run's DeepSpeed config, with the command line's batch size and ZenFlow settings."""
    config = json.loads(RUNS[name].read_text())
    config["train_micro_batch_size_per_gpu"] = args.batch_size
    block = config["zero_optimization"].get("zenflow")
    if block is not None:
        for key in ("topk_ratio", "update_interval", "select_interval"):
            if getattr(args, key) is not None:
                block[key] = getattr(args, key)
    return config


def train(engine, sampler: BatchSampler, steps: int, args, desc: str) -> dict:
    """Run ``steps`` optimizer steps; returns per-step losses and step times (seconds)."""
    losses, times = [], []
    progress = Progress(steps, desc)
    for _ in progress:
        x, y = sampler.next_batch(args.device)
        start = time.perf_counter()
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        synchronize(args.device)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
        progress.set_postfix(loss=f"{losses[-1]:.3f}", step_ms=f"{times[-1] * 1e3:.0f}")
    return dict(losses=losses, times=times)


def finetune(name: str, weights: dict, data: tuple, args: argparse.Namespace) -> dict:
    """Fine-tune a copy of the pre-trained model; every run sees the same batches."""
    train_tokens, val_tokens = data
    torch.manual_seed(args.seed)
    model = GPT(model_config(args)).to(args.device)
    model.load_state_dict(weights)
    engine, _, _, _ = zenflow.initialize(
        model=model,
        model_parameters=model.param_groups(WEIGHT_DECAY),
        config=ds_config(name, args),
    )
    engine.compile(options={"inner": args.inner})
    # ZenFlow's own step over the selected columns as step_backend "auto" runs it (on the CPU
    # one Inductor-fused loop: about 10 s to compile, then 2.5x faster than torch's _foreach
    # ops), whatever runs the model's graphs; torch's fused AdamW is a compiled kernel too.
    engine.optimizer.step_backend = args.step_backend
    sampler = BatchSampler(train_tokens, args.block_size, args.batch_size, seed=args.seed + 1)
    checkpoint_dir = args.out_dir / "checkpoint"
    if name == "zenflow" and args.resume:
        path, state = engine.load_checkpoint(checkpoint_dir)
        if path is None:
            raise SystemExit(f"--resume: no checkpoint under {checkpoint_dir}; run without it")
        sampler.load_state_dict(state["sampler"])
        print(f"resumed from {path} at step {engine.global_steps}")

    val_before = evaluate(model, val_tokens, args)
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    run = train(engine, sampler, args.steps, args, desc=name)
    if args.device.startswith("cuda"):
        run["peak_device_mb"] = torch.cuda.max_memory_allocated() / 2**20
    # ZenFlow holds part of the update back (the open window): apply it before evaluating.
    engine.flush()
    run.update(val_before=val_before, val_after=evaluate(model, val_tokens, args))
    run["stats"] = engine.stats()
    print(f"{name}: val loss on prose {run['val_before']:.4f} -> {run['val_after']:.4f}")
    if name == "zenflow":
        engine.save_checkpoint(checkpoint_dir, client_state={"sampler": sampler.state_dict()})
        engine.save_16bit_model(args.out_dir / "export")
        print(f"checkpoint: {checkpoint_dir} (continue with --resume)")
        print(f"exported 16-bit weights: {args.out_dir / 'export' / 'pytorch_model.bin'}")
    return run


def whole_cycles(times: list[float], cycle: int) -> list[float]:
    """The step times of whole select cycles after the first (whose first step compiles): a
    mean over them counts every kind of step as often as training meets it."""
    timed = times[cycle : cycle + (len(times) - cycle) // cycle * cycle]
    return timed or times


def summary(run: dict) -> dict:
    stats, total = run["stats"], sum(run["times"])
    steps = max(stats.get("steps", len(run["times"])), 1)
    return dict(
        train_loss=statistics.fmean(run["losses"][-TRAIN_LOSS_TAIL:]),
        val_loss=run["val_after"],
        median_step_ms=statistics.median(run["times"]) * 1e3,
        mean_step_ms=statistics.fmean(whole_cycles(run["times"], SELECT_CYCLE)) * 1e3,
        wait_share=stats.get("optimizer_wait_s", 0.0) / total,
        mb_per_step=(stats.get("d2h_bytes", 0) + stats.get("h2d_bytes", 0)) / steps / 1e6,
        cpu_updates=stats.get("cpu_updates", 0),
        **({"peak_device_mb": run["peak_device_mb"]} if "peak_device_mb" in run else {}),
    )


def print_table(summaries: dict[str, dict], args: argparse.Namespace) -> None:
    print(f"\nfine-tuning, {args.steps} steps, rewritten graphs run by {args.inner}")
    columns = [
        ("train_loss", "train_loss", "{:.4f}"),
        ("val_loss", "val_loss", "{:.4f}"),
        ("median_step_ms", "median_ms", "{:.1f}"),
        ("mean_step_ms", "mean_ms", "{:.1f}"),
        ("vs_adamw", "mean/adamw", "{:.2f}x"),
        ("wait_share", "opt_wait", "{:.1%}"),
        ("mb_per_step", "MB/step", "{:.2f}"),
        ("cpu_updates", "cpu_upd", "{:d}"),
        ("peak_device_mb", "peak_MB", "{:.0f}"),
    ]
    shown = [c for c in columns if any(c[0] in s for s in summaries.values())]
    print(f"{'run':<14}" + "".join(f"{title:>12}" for _, title, _ in shown))
    for name, s in summaries.items():
        cells = [fmt.format(s[key]) if key in s else "" for key, _, fmt in shown]
        print(f"{name:<14}" + "".join(f"{cell:>12}" for cell in cells))
    print(
        f"(train_loss: mean of the last {TRAIN_LOSS_TAIL} steps; mean_ms: over whole "
        f"{SELECT_CYCLE}-step select cycles after the first; mean/adamw: that over AdamW's; "
        "MB/step: device<->host)"
    )
    if "adamw" in summaries:
        ratio = summaries["zenflow"]["val_loss"] / summaries["adamw"]["val_loss"]
        print(f"zenflow val loss / adamw val loss: {ratio:.4f}\n")


def summaries_of(results: dict[str, dict]) -> dict[str, dict]:
    """Each run's summary, with its mean step over AdamW's where AdamW ran."""
    summaries = {name: summary(run) for name, run in results.items()}
    if "adamw" in summaries:
        for s in summaries.values():
            s["vs_adamw"] = s["mean_step_ms"] / summaries["adamw"]["mean_step_ms"]
    return summaries


def smoothed(values: list[float], weight: float = 0.9) -> list[float]:
    """Exponential moving average, as TensorBoard draws it: the trend through noisy batches."""
    out, average = [], values[0]
    for v in values:
        average = weight * average + (1 - weight) * v
        out.append(average)
    return out


def plot(results: dict[str, dict], path: Path) -> None:
    # A bare Figure (no pyplot) renders with matplotlib's Agg backend: no display needed.
    fig = Figure(figsize=(13, 5))
    curves, bars = fig.subplots(1, 2, width_ratios=[2, 1])
    for name, run in results.items():
        (line,) = curves.plot(run["losses"], alpha=0.25, linewidth=1)
        color = line.get_color()
        curves.plot(smoothed(run["losses"]), color=color, label=f"{name} train (smoothed)")
        curves.plot(
            [0, len(run["losses"])],
            [run["val_before"], run["val_after"]],
            "o",
            markersize=8,
            color=color,
            label=f"{name} val (before, after)",
        )
    curves.set_xlabel("fine-tuning step")
    curves.set_ylabel("cross-entropy loss (nats per byte)")
    curves.set_title("GPT fine-tuning on pydoc topics")
    curves.legend()

    names = list(results)
    step_ms = [summary(results[n])["median_step_ms"] for n in names]
    wait_ms = [s * summary(results[n])["wait_share"] for s, n in zip(step_ms, names, strict=True)]
    bars.bar(names, [s - w for s, w in zip(step_ms, wait_ms, strict=True)], label="compute")
    bars.bar(
        names,
        wait_ms,
        bottom=[s - w for s, w in zip(step_ms, wait_ms, strict=True)],
        label="waiting for the optimizer",
    )
    bars.set_ylabel("median step time (ms)")
    bars.set_title("step time breakdown")
    bars.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def main() -> None:
    args = parse_args()
    weights = pretrained_weights(args)
    data = train_val_split(topics_prose_bytes())
    names = ["zenflow"] if args.resume else list(RUNS)
    results = {name: finetune(name, weights, data, args) for name in names}
    summaries = summaries_of(results)
    print_table(summaries, args)
    report = args.out_dir / "finetune_gpt.json"
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(json.dumps(summaries, indent=2) + "\n")
    print(f"summary per run: {report}")
    png = args.out_dir / "finetune_gpt.png"
    plot(results, png)
    print(f"loss curves and step times: {png}")
    run = results["zenflow"]
    print(f"final: val_loss_before={run['val_before']:.4f} val_loss_after={run['val_after']:.4f}")


if __name__ == "__main__":
    main()
