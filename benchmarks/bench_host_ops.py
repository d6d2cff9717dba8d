"""The operations the training thread dispatches per weight and step: what keeps a GPU waiting.

    .venv/bin/python benchmarks/bench_host_ops.py [--quick] [--layers 96] [--width 64]
        [--dtype both] [--cycles 32] [--update-interval 4] [--select-interval 8] [--threads 1]

On a GPU every operation the host dispatches is a kernel launch (or at least a trip through the
dispatcher), a few microseconds each: a model of many small weights, or one whose step is short,
runs only as fast as its host thread dispatches. This counts them on the CPU, where the count is
the same as on a GPU for the same code path (device-independent; no timing noise): a stack of
``--layers`` Linear(``--width``, ``--width``) layers, trained on a batch of 8 rows, each step's
backward and ``step()`` + ``zero_grad()`` under torch.profiler, counting the top-level aten
operations that do work (views, ``aten::to`` to the same dtype, and other operations that move
no data are left out). Per weight (one weight and one bias per layer), by kind of step over one
select cycle after warm-up (topk 0.1, update_interval 4, select_interval 8 unless given,
overlap_step; the device step eager, as on a GPU; the GPU check's settings are update_interval 4
or 8, select_interval 64):

  zenflow device sums  ZenFlowAdamW, accumulate_on_device True (what "auto" picks on one GPU)
  zenflow host sums    ZenFlowAdamW, accumulate_on_device False
  torch adamw foreach  torch.optim.AdamW(foreach=True): the peer without offload
  torch adamw fused    torch.optim.AdamW(fused=True)

Every model's backward runs through the same eager graph (zenflow: backend "zenflow" with inner
"eager"; torch: backend "aot_eager"), so the backward column is the model's own operations plus
what zenflow adds. "mean" is over the whole select cycle (window-closing and reselecting steps
included). DeepSpeed's rows are not here: its engine needs torch.distributed and its offload
step runs on the host by design (bench_step.py times it).

Then the same models timed: host microseconds per layer of the backward and of each kind of
step, and the mean whole step over ``--cycles`` select cycles (forward, backward, step). The
layers are so small that their arithmetic is nothing: what is timed is the host's dispatching
and Python, which on a GPU is the floor under the step while the device waits. The garbage
collector runs, as in training, and its passes are counted: a compiled model leaves several
hundred thousand Python objects that each full pass walks (a quarter of a second here), and
every step that keeps many new objects alive at once sets passes off. Times vary with the
machine and what else runs on it; ratios within one run are the comparable figures.

Last, each zenflow row's host time in the backward's hand-overs of gradients to the runtime
(``stats()["hand_over_s"]``: what zenflow adds to the backward) and in ``step()`` after the
step's last synchronization (``stats()["host_after_sync_s"]``, per step, over the same timed
cycles): on a GPU the device has run out of work at that synchronization and waits for the host
about that long, whatever the model's size, since what the host queues then comes after it.
torch's AdamW has no such wait: its host runs ahead of the device.
"""

import argparse
import collections
import gc
import statistics
import sys
import time
from dataclasses import dataclass

import torch

import zenflow

TOPK = 0.1
KINDS = ("ordinary", "window", "select")
# Operations that dispatch without moving data (views, metadata, profiler marks).
NO_WORK = {
    "aten::t",
    "aten::view",
    "aten::slice",
    "aten::permute",
    "aten::detach",
    "aten::expand",
    "aten::unsqueeze",
    "aten::squeeze",
    "aten::select",
    "aten::as_strided",
    "aten::alias",
    "aten::transpose",
    "aten::resolve_conj",
    "aten::resolve_neg",
    "aten::split_with_sizes",
    "aten::split",
    "aten::lift_fresh",
    "aten::empty",
    "aten::empty_strided",
    "aten::new_empty",
}
# Operations that move data only when they copy (a nested copy among their callees).
MAYBE_WORK = {"aten::to", "aten::contiguous", "aten::reshape", "aten::type_as"}
COPIES = {"aten::_to_copy", "aten::copy_", "aten::clone"}


def _args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 layers, fp32 only (smoke)")
    parser.add_argument("--layers", type=int, default=None, help="Linear layers (96)")
    parser.add_argument(
        "--width",
        type=int,
        default=64,
        help="each layer's inputs and outputs (64); 16 leaves the host's dispatching and Python "
        "nearly alone in the times, as on a GPU",
    )
    parser.add_argument("--dtype", choices=("fp32", "bf16", "both"), default=None)
    parser.add_argument("--cycles", type=int, default=None, help="timed select cycles (32)")
    parser.add_argument("--update-interval", type=int, default=4, help="zenflow's (4)")
    parser.add_argument("--select-interval", type=int, default=8, help="zenflow's (8)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch's intra-op threads (1: the layers are too small to share; more shows what "
        "a process's threads do to each other's small operations)",
    )
    args = parser.parse_args(argv)
    if args.update_interval < 1 or args.select_interval % args.update_interval:
        parser.error("--select-interval must be a multiple of --update-interval (>= 1)")
    args.layers = args.layers or (8 if args.quick else 96)
    args.cycles = args.cycles or (2 if args.quick else 32)
    args.dtype = args.dtype or ("fp32" if args.quick else "both")
    return args


def _is_aten(event) -> bool:
    return event.name.startswith("aten::")


def working_ops(prof) -> list[str]:
    """The names of the top-level aten operations in ``prof`` (none of their callers an aten
    operation) that do work, in the order they ran; ``tests/test_host_ops.py`` holds the
    runtime to budgets in these."""
    children = collections.defaultdict(list)
    for event in prof.events():
        if event.cpu_parent is not None:
            children[id(event.cpu_parent)].append(event)
    ops = []
    for event in prof.events():
        if not _is_aten(event) or event.name in NO_WORK:
            continue
        parent = event.cpu_parent
        while parent is not None and not _is_aten(parent):
            parent = parent.cpu_parent
        if parent is not None:
            continue
        if event.name in MAYBE_WORK and not _copies(event, children):
            continue
        ops.append(event.name)
    return ops


def _copies(event, children) -> bool:
    return any(c.name in COPIES or _copies(c, children) for c in children[id(event)])


@dataclass(frozen=True)
class Cadence:
    """zenflow's update and select intervals, and the kind of each step of a select cycle once
    the cycles are aligned (warm-up over, the first selection made: ``3 * select_interval``
    steps into training)."""

    update_interval: int
    select_interval: int

    def settings(self) -> dict:
        return dict(
            topk_ratio=TOPK,
            update_interval=self.update_interval,
            select_interval=self.select_interval,
            overlap_step=True,
        )

    def kind(self, i: int) -> str:
        """Step ``i`` of a cycle: "select" (a select boundary, which also closes a window),
        "window" (one that closes a window) or "ordinary"."""
        if i == self.select_interval - 1:
            return "select"
        return "window" if (i + 1) % self.update_interval == 0 else "ordinary"

    def of_kind(self, kind: str) -> list[int]:
        return [i for i in range(self.select_interval) if self.kind(i) == kind]


def _training(name: str, layers: int, width: int, dtype: torch.dtype, cadence: Cadence):
    """The row's compiled model, optimizer and batch."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    model = model.to(dtype)
    if name.startswith("zenflow"):
        opt = zenflow.ZenFlowAdamW(
            model.parameters(),
            lr=1e-3,
            accumulate_on_device=name == "zenflow device sums",
            step_backend="eager",
            **cadence.settings(),
        )
        compiled = torch.compile(model, backend="zenflow", options={"inner": "eager"})
    else:
        variant = dict(fused=True) if name.endswith("fused") else dict(foreach=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **variant)
        compiled = torch.compile(model, backend="aot_eager")
    return compiled, opt, torch.randn(8, width, dtype=dtype)


def _row(name: str, layers: int, width: int, dtype: torch.dtype, cadence: Cadence):
    compiled, opt, x = _training(name, layers, width, dtype, cadence)
    activities = [torch.profiler.ProfilerActivity.CPU]

    def step(profiled: bool):
        loss = compiled(x).float().square().mean()
        if not profiled:
            loss.backward()
            opt.step()
            opt.zero_grad()
            return None
        with torch.profiler.profile(activities=activities) as backward:
            loss.backward()
        with torch.profiler.profile(activities=activities) as stepped:
            opt.step()
            opt.zero_grad()
        return len(working_ops(backward)), len(working_ops(stepped))

    for _ in range(3 * cadence.select_interval):  # warm-up, the first selection, a cycle
        step(False)
    return [step(True) for _ in range(cadence.select_interval)]


class _Collections:
    """Counts the garbage collector's passes, young (generations 0 and 1) and full."""

    def __init__(self):
        self.young = self.full = 0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            if info["generation"] == 2:
                self.full += 1
            else:
                self.young += 1


class _TimedRow:
    """One row's model, optimizer and batch, and the host time of every step it ran: the
    backward, ``step()`` + ``zero_grad()`` and the whole step, in seconds, and the garbage
    collector's passes during its steps."""

    def __init__(self, name: str, layers: int, width: int, dtype: torch.dtype, cadence: Cadence):
        self.cadence = cadence
        self.compiled, self.opt, self.x = _training(name, layers, width, dtype, cadence)
        self.times: list[tuple[float, float, float]] = []
        self.after_sync: list[float] = []  # zenflow: each step's host_after_sync_s
        self.hand_overs: list[float] = []  # zenflow: each backward's hand_over_s
        self.passes = _Collections()
        for _ in range(3 * cadence.select_interval):  # warm-up, the first selection, a cycle
            self._step()

    def _step(self) -> tuple[float, float, float]:
        started = time.perf_counter()
        loss = self.compiled(self.x).float().square().mean()
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad()
        stepped = time.perf_counter()
        return backward - forward, stepped - backward, stepped - started

    def _counted_s(self) -> tuple[float, float]:
        """zenflow's host time after the steps' synchronizations and in the backward's
        hand-overs so far (0 for torch's AdamW)."""
        stats = getattr(self.opt, "stats", None)
        if stats is None:
            return 0.0, 0.0
        counted = stats()
        return counted["host_after_sync_s"], counted["hand_over_s"]

    def cycle(self) -> None:
        counted = self._counted_s()
        gc.callbacks.append(self.passes)
        try:
            for _ in range(self.cadence.select_interval):
                self.times.append(self._step())
                before, counted = counted, self._counted_s()  # read outside the timed step
                self.after_sync.append(counted[0] - before[0])
                self.hand_overs.append(counted[1] - before[1])
        finally:
            gc.callbacks.remove(self.passes)

    def summary(self) -> dict:
        """Milliseconds: the backward's and each kind of step's median, the mean whole step;
        the collector's passes per 100 steps; each kind of step's median host time after
        its synchronization (``after_<kind>``) and the mean (``after_mean``); the median
        backward's hand-overs (``hand_overs``)."""
        steps = [t[1] for t in self.times]
        by_kind = self._medians_by_kind(steps)
        after = self._medians_by_kind(self.after_sync)
        return dict(
            backward=statistics.median(t[0] for t in self.times) * 1e3,
            **{kind: t * 1e3 for kind, t in by_kind.items()},
            mean=statistics.mean(t[2] for t in self.times) * 1e3,
            young=100 * self.passes.young / len(self.times),
            full=100 * self.passes.full / len(self.times),
            **{f"after_{kind}": t * 1e3 for kind, t in after.items()},
            after_mean=statistics.mean(self.after_sync) * 1e3,
            hand_overs=statistics.median(self.hand_overs) * 1e3,
        )

    def _medians_by_kind(self, per_step: list[float]) -> dict[str, float]:
        """Each step of the cycle's median over the cycles, and of each kind their mean."""
        n = self.cadence.select_interval
        cycles = len(per_step) // n
        medians = [statistics.median(per_step[c * n + i] for c in range(cycles)) for i in range(n)]
        return {
            kind: statistics.mean(medians[i] for i in self.cadence.of_kind(kind))
            for kind in KINDS
            if self.cadence.of_kind(kind)
        }


def _print_times(
    layers: int,
    width: int,
    dtype: torch.dtype,
    cycles: int,
    rows: tuple[str, ...],
    cadence: Cadence,
) -> None:
    print(
        f"\n## {str(dtype).removeprefix('torch.')}: host time per layer (us), {cycles} select "
        "cycles, garbage collector on"
    )
    header = (
        f"{'row':22s}{'backward':>10s}{'ordinary':>10s}{'window':>10s}{'select':>10s}"
        f"{'mean step':>11s}{'vs foreach':>12s}{'gc per 100 steps':>18s}"
    )
    print(header + "\n" + "-" * len(header))
    # Whole select cycles of every row in turn, so that the machine's drift reaches all alike.
    runs = {name: _TimedRow(name, layers, width, dtype, cadence) for name in rows}
    gc.collect()
    for _ in range(cycles):
        for run in runs.values():
            run.cycle()
    timed = {name: run.summary() for name, run in runs.items()}
    reference = timed["torch adamw foreach"]["mean"]
    per_layer = 1e3 / layers
    for name, t in timed.items():
        kinds = "".join(_cell(t.get(kind), per_layer) for kind in KINDS)
        print(
            f"{name:22s}{t['backward'] * per_layer:10.1f}{kinds}"
            f"{t['mean'] * per_layer:11.1f}{t['mean'] / reference:11.2f}x"
            f"{t['young']:9.0f} young{t['full']:4.1f} full"
        )
    print(
        "\nzenflow's host time per layer (us): in the backward's hand-overs, and in step() after "
        "the step's synchronization:"
    )
    header = (
        f"{'row':22s}{'hand-overs':>12s}{'ordinary':>10s}{'window':>10s}{'select':>10s}"
        f"{'mean step':>11s}"
    )
    print(header + f"{'of the step':>13s}\n" + "-" * (len(header) + 13))
    for name, t in timed.items():
        if name.startswith("zenflow"):
            kinds = "".join(_cell(t.get(f"after_{kind}"), per_layer) for kind in KINDS)
            share = 100 * t["after_mean"] / t["mean"]
            print(
                f"{name:22s}{t['hand_overs'] * per_layer:12.1f}{kinds}"
                f"{t['after_mean'] * per_layer:11.1f}{share:12.0f}%"
            )


def _cell(value: float | None, scale: float) -> str:
    return f"{'-':>10s}" if value is None else f"{value * scale:10.1f}"


def main(argv=None) -> None:
    args = _args(argv)
    cadence = Cadence(args.update_interval, args.select_interval)
    torch.set_num_threads(args.threads)
    dtypes = {"fp32": [torch.float32], "bf16": [torch.bfloat16]}.get(
        args.dtype, [torch.float32, torch.bfloat16]
    )
    rows = ("zenflow device sums", "zenflow host sums", "torch adamw foreach", "torch adamw fused")
    print("# bench_host_ops: operations dispatched per weight and step (top-level aten ops)")
    print(
        f"model: {args.layers} x Linear({args.width}, {args.width}), batch 8; "
        f"torch {torch.__version__}, "
        f"{args.threads} thread(s); "
        f"zenflow {', '.join(f'{k} {v}' for k, v in cadence.settings().items())}; one select "
        "cycle"
    )
    for dtype in dtypes:
        print(
            f"\n## {str(dtype).removeprefix('torch.')}: operations per layer (a weight and a bias)"
        )
        header = (
            f"{'row':22s}{'backward':>10s}{'ordinary':>10s}{'window':>10s}{'select':>10s}"
            f"{'mean step':>11s}"
        )
        print(header + "\n" + "-" * len(header))
        for name in rows:
            if name.endswith("fused") and dtype != torch.float32:
                continue  # fused AdamW on the CPU takes fp32 parameters only
            steps = _row(name, args.layers, args.width, dtype, cadence)
            backward = statistics.mean(b for b, _ in steps) / args.layers
            stepped = [s / args.layers for _, s in steps]
            kinds = "".join(
                _cell(statistics.mean(stepped[i] for i in cadence.of_kind(kind)), 1.0)
                if cadence.of_kind(kind)
                else _cell(None, 1.0)
                for kind in KINDS
            )
            print(f"{name:22s}{backward:10.1f}{kinds}{statistics.mean(stepped):11.1f}")
    print(
        "\nordinary: a step inside a window; window: one closing a window; select: a select "
        "boundary (means over the cycle's steps of each kind). Step columns count step() + "
        "zero_grad()."
    )
    timed_rows = ("zenflow device sums", "zenflow host sums", "torch adamw foreach")
    for dtype in dtypes:
        _print_times(args.layers, args.width, dtype, args.cycles, timed_rows, cadence)
    print(
        "\nbackward, ordinary, window, select: medians over the cycles (of each kind, their "
        "mean); mean step: forward, backward and step over whole select cycles, the garbage "
        "collector's passes included; vs foreach: the mean step over torch foreach AdamW's. "
        "young: collections of generations 0 and 1; full: of every object the process tracks "
        "(a compiled model's many: a fraction of a second each). hand-overs: the median "
        "backward's time in zenflow's ops (stats()['hand_over_s']), part of its backward column. "
        "After the synchronization: medians as above; on a GPU, the device's wait for the host "
        "in each step; of the step: that wait's mean against the row's mean whole step."
    )


if __name__ == "__main__":
    # Each line reaches a pipe or a log file when printed, not at exit: rows of a long run.
    sys.stdout.reconfigure(line_buffering=True)
    main()
