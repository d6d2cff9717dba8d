"""update_interval "auto" against fixed intervals: the CPU updates each makes, the loss reached.

    .venv/bin/python benchmarks/bench_auto_interval.py [--steps 160] [--quick]
        [--plot runs/bench_auto_interval.png]

Three small teacher tasks: an MLP 32-64-8 learns a random teacher of its own shape from inputs
whose features have different scales, which spreads the first layer's gradient over its
columns differently: a linear ramp of scales (the task of tests/test_zenflow_adamw.py), a
geometric ramp, and four strong features among weak ones. Each is trained with ZenFlowAdamW
(lr 1e-2, topk 0.1, select_interval 16) on the same batches at fixed update intervals 1, 2, 4,
8, 16; at the same windows with "auto"'s step size (``update_interval="auto"`` with
``min_update_interval = max_update_interval = n``: each window's CPU step takes lr * sqrt(n));
and at "auto" itself, with its default floor of 4 and with floor 1 (the rule alone). The loss is
the mean over 20 held-out batches, after ``flush()``.

For each task the script prints both curves (CPU updates, loss) and, for each "auto" run, its
loss over the loss each curve reaches at the same number of updates (interpolated in
log(updates) between the two intervals around it): below 1.00x against the second curve means
the rule's windows beat fixed ones with the same step size. The issue's criterion compares
"auto" with a fixed 4: no more CPU updates and a loss within 1 %. The plot shows the same: per
task, loss against CPU updates, the curves as lines and "auto" as points.
"""

import argparse
import itertools
import math
import sys
import time
from pathlib import Path

import torch
from matplotlib.figure import Figure
from matplotlib.ticker import ScalarFormatter

from zenflow import ZenFlowAdamW
from zenflow.columns import column_importance, topk_count

HELD_OUT = 20
TASKS = {
    "linear ramp (the test's task)": torch.linspace(0.1, 2.0, 32),
    "geometric ramp": torch.logspace(-2, 0, 32),
    "4 strong features of 32": torch.cat([torch.full((28,), 0.1), torch.full((4,), 2.0)]),
}
SETTINGS = dict(lr=1e-2, topk_ratio=0.1, select_interval=16, step_backend="eager")
FIXED = "fixed"
SCALED = "same windows, auto's step"
AUTO = "auto"
RULE_ALONE = "auto, floor 1"


def _mlp() -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))


def teacher_task(scale: torch.Tensor, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    teacher = _mlp()
    for p in teacher.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.5
    inputs = [torch.randn(16, 32, generator=g) * scale for _ in range(steps + HELD_OUT)]
    with torch.no_grad():
        return [(x, teacher(x)) for x in inputs]


def train(data, update_interval, **interval_bounds) -> tuple[int, float]:
    """(CPU updates, held-out loss)."""
    torch.manual_seed(0)
    model = _mlp()
    opt = ZenFlowAdamW(
        model.parameters(), update_interval=update_interval, **interval_bounds, **SETTINGS
    )
    for x, y in data[:-HELD_OUT]:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    opt.flush()
    with torch.no_grad():
        losses = [torch.nn.functional.mse_loss(model(x), y).item() for x, y in data[-HELD_OUT:]]
    return opt.stats()["cpu_updates"], sum(losses) / len(losses)


def top_share(data) -> float:
    """Mean share of a weight's squared gradient norm held by its top 10 % of columns, over the
    first five batches at the initial weights."""
    torch.manual_seed(0)
    model = _mlp()
    shares = []
    for x, y in data[:5]:
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        for p in model.parameters():
            if p.dim() == 2:
                scores = column_importance(p.grad).sort(descending=True).values
                shares.append(float(scores[: topk_count(0.1, scores.numel())].sum() / scores.sum()))
    return sum(shares) / len(shares)


def curve_at(curve: list[tuple[int, float]], updates: int) -> float | None:
    """The fixed intervals' loss at ``updates`` CPU updates, linear in log(updates) between the
    two points around it (the intervals double: the curve's points are evenly spaced there, as
    on the plot); None outside the curve."""
    points = sorted(curve)
    for (u0, l0), (u1, l1) in itertools.pairwise(points):
        if u0 <= updates <= u1:
            if u1 == u0:
                return l0
            return l0 + (l1 - l0) * math.log(updates / u0) / math.log(u1 / u0)
    return None


def plot(results: dict[str, dict], path: Path) -> None:
    """Per task, held-out loss against CPU updates: the fixed intervals (labelled) as curves,
    "auto" as points; where a point sits below a curve its windows beat that curve's."""
    # A bare Figure (no pyplot) renders with matplotlib's Agg backend: no display needed.
    fig = Figure(figsize=(5 * len(results), 4.2))
    axes = fig.subplots(1, len(results), squeeze=False)[0]
    for ax, (name, result) in zip(axes, results.items(), strict=True):
        for curve, style in ((FIXED, "o-"), (SCALED, "s--")):
            points = sorted((u, loss, n) for n, (u, loss) in result[curve].items())
            ax.plot([u for u, _, _ in points], [loss for _, loss, _ in points], style, label=curve)
            for updates, loss, interval in points:
                ax.annotate(
                    f"{interval}", (updates, loss), textcoords="offset points", xytext=(4, 4)
                )
        for label, marker in ((AUTO, "*"), (RULE_ALONE, "P")):
            ax.plot(*result[label], marker, markersize=12, label=label)
        ax.set_xscale("log")
        ax.set_xticks(sorted(u for u, _ in result[FIXED].values()))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.minorticks_off()
        ax.set_xlabel("CPU updates")
        ax.set_ylabel("held-out loss")
        ax.set_title(name, fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle('update_interval: fixed (labelled) against "auto"')
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=160, help="training steps per run (160)")
    parser.add_argument("--quick", action="store_true", help="one task, 40 steps (smoke)")
    parser.add_argument(
        "--plot",
        type=Path,
        default=Path("runs/bench_auto_interval.png"),
        help="where the plot goes (runs/bench_auto_interval.png)",
    )
    args = parser.parse_args()
    tasks = dict(list(TASKS.items())[:1]) if args.quick else TASKS
    steps = 40 if args.quick else args.steps
    intervals = (2, 4, 8) if args.quick else (1, 2, 4, 8, 16)
    started = time.perf_counter()
    results = {}
    print('# bench_auto_interval: update_interval "auto" against fixed intervals')
    print(f"steps {steps}, {', '.join(f'{k} {v}' for k, v in SETTINGS.items())}")
    for name, scale in tasks.items():
        data = teacher_task(scale, steps)
        print(f"\n## {name}: top 10 % of columns hold {top_share(data):.0%} of the squared norm")
        print(f"{'update_interval':<22} {'cpu updates':>11} {'loss':>8} {SCALED:>28}")
        result = {FIXED: {}, SCALED: {}}
        for n in intervals:
            result[FIXED][n] = train(data, n)
            result[SCALED][n] = train(data, "auto", min_update_interval=n, max_update_interval=n)
            (updates, loss), scaled_loss = result[FIXED][n], result[SCALED][n][1]
            print(f"{n:<22} {updates:>11} {loss:>8.4f} {scaled_loss:>28.4f}")
        result[AUTO] = train(data, "auto")
        result[RULE_ALONE] = train(data, "auto", min_update_interval=1)
        results[name] = result
        fixed_updates, fixed_loss = result[FIXED][4]
        for label in (AUTO, RULE_ALONE):
            updates, loss = result[label]
            against = []
            for curve in (FIXED, SCALED):
                same_work = curve_at(list(result[curve].values()), updates)
                ratio = "outside it" if same_work is None else f"{loss / same_work:.3f}x"
                against.append(f"{ratio} of {curve}")
            met = updates <= fixed_updates and loss <= 1.01 * fixed_loss
            print(f"{label:<22} {updates:>11} {loss:>8.4f}")
            print(f"    against the curves at {updates} updates: {', '.join(against)}")
            print(
                f"    against fixed 4: {updates / fixed_updates:.2f}x the updates, "
                f"{loss / fixed_loss:.3f}x the loss (criterion <= 1x and <= 1.01x: "
                f"{'met' if met else 'not met'})"
            )
    plot(results, args.plot)
    print(f"\nplot: {args.plot} ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    # Each line reaches a pipe or a log file when printed, not at exit: rows of a long run.
    sys.stdout.reconfigure(line_buffering=True)
    main()
