"""Writing a window's updated columns back into row-major weights, against the memory floor.

    .venv/bin/python benchmarks/bench_write_back.py [--quick] [--width 1024] [--blocks 2]
        [--classes 2048] [--topk 0.1] [--rounds 15] [--threads 2]

On a CPU-only machine every window close writes the unselected columns' new values (a tenth
of the columns left out at topk 0.1) from zenflow's column-major rows (``[n, out]``) into the
parameters (``[out, columns]``), and every step writes the selected columns: a transpose of
most of the model, on the training thread. With ``overlap_step`` each window's update lands at
its own boundary, so a select cycle of two windows writes twice. This times those writes for
bench_step.py's model (residual MLP blocks of width -> 4 width -> width and a classifier head,
fp32) beside what the same bytes cost without the transpose:

  zenflow unselected     ``write_columns`` of the unselected columns (csrc's scatter)
  zenflow close          the unselected and the selected columns in one pass (a window close)
  zenflow selected       the selected columns alone (every step inside a window)
  zenflow gather         the reverse, on the gradient's side: a gradient the backward hands
                         over as ``[out, columns]`` gathered into rows, every column, in the
                         selected-first order (``gather_rows``: csrc's gather; every step where
                         the batch is too large for the gradient's factors to pay)
  torch index_copy_      ``index_copy_`` along the columns from the same rows, transposed view
  torch copy (floor)     a contiguous copy of the whole parameter (no transpose, every column)

"warm": the sources and the parameters were just touched; "cold": a 256 MB pass over another
tensor ran between rounds (as a forward and backward would). Medians over ``--rounds``, and
each row's ratio to the floor's median. Times depend on the machine's caches and memory; the
ratios within one run are the comparable figures.
"""

import argparse
import platform
import statistics
import sys
import time

import torch
from bench_step import build_model

from zenflow.runtime.gradient_rows import gather_rows
from zenflow.runtime.param_writes import ColumnValues, write_columns

EVICT_ELEMENTS = 64 << 20  # 256 MB of fp32: larger than most last-level caches' share


def _args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes, few rounds (smoke)")
    parser.add_argument("--width", type=int, default=None, help="model width (1024)")
    parser.add_argument("--blocks", type=int, default=None, help="residual MLP blocks (2)")
    parser.add_argument("--classes", type=int, default=None, help="classifier outputs (2048)")
    parser.add_argument("--topk", type=float, default=0.1, help="selected share of columns")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per row (15)")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads, for the torch rows (csrc's scatter uses every usable core)",
    )
    args = parser.parse_args(argv)
    defaults = (
        dict(width=64, blocks=1, classes=32, rounds=3)
        if args.quick
        else dict(width=1024, blocks=2, classes=2048, rounds=15)
    )
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if not 0.0 <= args.topk < 1.0:
        parser.error(f"--topk must be in [0, 1), got {args.topk}")
    return args


def _shapes(width: int, blocks: int, classes: int) -> list[tuple[int, int]]:
    """bench_step.py's weights, ``[out, in]``."""
    model = build_model(width, blocks, classes)
    return [tuple(p.shape) for p in model.parameters() if p.dim() == 2]


class Weight:
    """One parameter, its selected and unselected columns and their new rows."""

    def __init__(self, shape: tuple[int, int], topk: float, generator: torch.Generator):
        out, columns = shape
        self.param = torch.randn(shape, generator=generator)
        order = torch.randperm(columns, generator=generator)
        k = int(topk * columns)
        self.selected = ColumnValues(order[:k], torch.randn(k, out, generator=generator))
        unselected = order[k:].sort().values
        self.unselected = ColumnValues(
            unselected, torch.randn(unselected.numel(), out, generator=generator)
        )
        self.whole = torch.randn(shape, generator=generator)
        self.order = torch.cat([self.selected.columns, unselected])
        self.gathered = torch.empty(columns, out)


def _rows(weights: list[Weight]) -> dict:
    return {
        "zenflow unselected": lambda: [write_columns(w.param, w.unselected) for w in weights],
        "zenflow close": lambda: [
            write_columns(w.param, w.unselected, w.selected) for w in weights
        ],
        "zenflow selected": lambda: [write_columns(w.param, w.selected) for w in weights],
        "zenflow gather": lambda: [
            gather_rows(w.whole.t(), w.order, out=w.gathered) for w in weights
        ],
        "torch index_copy_": lambda: [
            w.param.index_copy_(1, w.unselected.columns, w.unselected.rows.t()) for w in weights
        ],
        "torch copy (floor)": lambda: [w.param.copy_(w.whole) for w in weights],
    }


def _time(run, rounds: int, evict: torch.Tensor | None) -> float:
    run()
    seconds = []
    for _ in range(rounds):
        if evict is not None:
            evict.mul_(1.0)
        started = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def main(argv=None) -> None:
    args = _args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    weights = [
        Weight(s, args.topk, generator) for s in _shapes(args.width, args.blocks, args.classes)
    ]
    elements = sum(w.param.numel() for w in weights)
    unselected = sum(w.unselected.rows.numel() for w in weights)
    print(
        "# bench_write_back: writing updated columns into row-major fp32 weights "
        "(and gathering a gradient's columns)"
    )
    print(
        f"machine: {platform.machine()}, {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}"
    )
    print(
        f"weights: {len(weights)}, {elements / 1e6:.1f}M parameters, topk {args.topk} "
        f"({unselected / 1e6:.1f}M unselected); median of {args.rounds} rounds"
    )
    evict = torch.ones(64 if args.quick else EVICT_ELEMENTS)
    rows = _rows(weights)
    timed = {
        name: (_time(run, args.rounds, None), _time(run, args.rounds, evict))
        for name, run in rows.items()
    }
    floor_warm, floor_cold = timed["torch copy (floor)"]
    print(f"{'row':<20} {'warm':>10} {'cold':>10} {'/ floor warm':>13} {'/ floor cold':>13}")
    for name, (warm, cold) in timed.items():
        print(
            f"{name:<20} {warm * 1e3:>8.2f}ms {cold * 1e3:>8.2f}ms "
            f"{warm / floor_warm:>12.2f}x {cold / floor_cold:>12.2f}x"
        )


if __name__ == "__main__":
    # Each line reaches a pipe or a log file when printed, not at exit: rows of a long run.
    sys.stdout.reconfigure(line_buffering=True)
    main()
