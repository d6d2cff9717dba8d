"""The operations the training thread dispatches per weight and step: what keeps a GPU waiting.

    .venv/bin/python benchmarks/bench_host_ops.py [--quick] [--layers 96] [--dtype both]
        [--cycles 32]

On a GPU every operation the host dispatches is a kernel launch (or at least a trip through
the dispatcher), a few microseconds each: a model of many small weights, or one whose step is
short, runs only as fast as its host thread dispatches. This counts them on the CPU, where the
count is the same as on a GPU for the same code path (device-independent; no timing noise): a
stack of ``--layers`` Linear(64, 64) layers, trained on a batch of 8 rows, each step's backward
and ``step()`` + ``zero_grad()`` under torch.profiler, counting the top-level aten operations
that do work (views, ``aten::to`` to the same dtype, and other operations that move no data are
left out). Per weight (one weight and one bias per layer), by kind of step over one select
cycle after warm-up (topk 0.1, update_interval 4, select_interval 8, overlap_step; the device
step eager, as on a GPU):

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
"""

import argparse
import collections
import gc
import statistics
import time

import torch

import zenflow

CYCLE = 8
SETTINGS = dict(topk_ratio=0.1, update_interval=4, select_interval=CYCLE, overlap_step=True)
# Operations that dispatch without moving data (views, metadata, profiler marks).
NO_WORK = {
    "aten::t",
    "aten::view",
    "aten::reshape",
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
    parser.add_argument("--layers", type=int, default=None, help="Linear(64, 64) layers (96)")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "both"), default=None)
    parser.add_argument("--cycles", type=int, default=None, help="timed select cycles (32)")
    args = parser.parse_args(argv)
    args.layers = args.layers or (8 if args.quick else 96)
    args.cycles = args.cycles or (2 if args.quick else 32)
    args.dtype = args.dtype or ("fp32" if args.quick else "both")
    return args


def _is_aten(event) -> bool:
    return event.name.startswith("aten::")


def _working_ops(prof) -> int:
    """Top-level aten operations (none of their callers an aten operation) that do work."""
    children = collections.defaultdict(list)
    for event in prof.events():
        if event.cpu_parent is not None:
            children[id(event.cpu_parent)].append(event)
    count = 0
    for event in prof.events():
        if not _is_aten(event) or (event.name in NO_WORK and event.name not in MAYBE_WORK):
            continue
        parent = event.cpu_parent
        while parent is not None and not _is_aten(parent):
            parent = parent.cpu_parent
        if parent is not None:
            continue
        if event.name in MAYBE_WORK and not _copies(event, children):
            continue
        count += 1
    return count


def _copies(event, children) -> bool:
    return any(c.name in COPIES or _copies(c, children) for c in children[id(event)])


def _training(name: str, layers: int, dtype: torch.dtype):
    """The row's compiled model, optimizer and batch."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(layers))).to(dtype)
    if name.startswith("zenflow"):
        opt = zenflow.ZenFlowAdamW(
            model.parameters(),
            lr=1e-3,
            accumulate_on_device=name == "zenflow device sums",
            step_backend="eager",
            **SETTINGS,
        )
        compiled = torch.compile(model, backend="zenflow", options={"inner": "eager"})
    else:
        variant = dict(fused=True) if name.endswith("fused") else dict(foreach=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **variant)
        compiled = torch.compile(model, backend="aot_eager")
    return compiled, opt, torch.randn(8, 64, dtype=dtype)


def _row(name: str, layers: int, dtype: torch.dtype):
    compiled, opt, x = _training(name, layers, dtype)
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
        return _working_ops(backward), _working_ops(stepped)

    for _ in range(3 * CYCLE):  # warm-up, the first selection, one whole select cycle
        step(False)
    return [step(True) for _ in range(CYCLE)]


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

    def __init__(self, name: str, layers: int, dtype: torch.dtype):
        self.compiled, self.opt, self.x = _training(name, layers, dtype)
        self.times: list[tuple[float, float, float]] = []
        self.passes = _Collections()
        for _ in range(3 * CYCLE):  # warm-up, the first selection, one whole select cycle
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

    def cycle(self) -> None:
        gc.callbacks.append(self.passes)
        try:
            self.times += [self._step() for _ in range(CYCLE)]
        finally:
            gc.callbacks.remove(self.passes)

    def summary(self) -> dict:
        """Milliseconds: the backward's and each kind of step's median, the mean whole step;
        the collector's passes per 100 steps."""
        cycles = len(self.times) // CYCLE
        by_kind = [[self.times[c * CYCLE + i][1] for c in range(cycles)] for i in range(CYCLE)]
        ordinary = statistics.mean(statistics.median(by_kind[i]) for i in (0, 1, 2, 4, 5, 6))
        return dict(
            backward=statistics.median(t[0] for t in self.times) * 1e3,
            ordinary=ordinary * 1e3,
            window=statistics.median(by_kind[3]) * 1e3,
            select=statistics.median(by_kind[7]) * 1e3,
            mean=statistics.mean(t[2] for t in self.times) * 1e3,
            young=100 * self.passes.young / len(self.times),
            full=100 * self.passes.full / len(self.times),
        )


def _print_times(layers: int, dtype: torch.dtype, cycles: int, rows: tuple[str, ...]) -> None:
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
    runs = {name: _TimedRow(name, layers, dtype) for name in rows}
    gc.collect()
    for _ in range(cycles):
        for run in runs.values():
            run.cycle()
    timed = {name: run.summary() for name, run in runs.items()}
    reference = timed["torch adamw foreach"]["mean"]
    per_layer = 1e3 / layers
    for name, t in timed.items():
        print(
            f"{name:22s}{t['backward'] * per_layer:10.1f}{t['ordinary'] * per_layer:10.1f}"
            f"{t['window'] * per_layer:10.1f}{t['select'] * per_layer:10.1f}"
            f"{t['mean'] * per_layer:11.1f}{t['mean'] / reference:11.2f}x"
            f"{t['young']:9.0f} young{t['full']:4.1f} full"
        )


def main(argv=None) -> None:
    args = _args(argv)
    torch.set_num_threads(1)
    dtypes = {"fp32": [torch.float32], "bf16": [torch.bfloat16]}.get(
        args.dtype, [torch.float32, torch.bfloat16]
    )
    rows = ("zenflow device sums", "zenflow host sums", "torch adamw foreach", "torch adamw fused")
    print("# bench_host_ops: operations dispatched per weight and step (top-level aten ops)")
    print(
        f"model: {args.layers} x Linear(64, 64), batch 8; torch {torch.__version__}; "
        f"zenflow {', '.join(f'{k} {v}' for k, v in SETTINGS.items())}; one select cycle"
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
            steps = _row(name, args.layers, dtype)
            per_weight = [(b / args.layers, s / args.layers) for b, s in steps]
            by_kind = [s for _, s in per_weight]
            # Steps 0..7 of the cycle: 3 and 7 close a window; 7 is also a select boundary.
            ordinary = statistics.mean(by_kind[i] for i in (0, 1, 2, 4, 5, 6))
            print(
                f"{name:22s}{statistics.mean(b for b, _ in per_weight):10.1f}{ordinary:10.1f}"
                f"{by_kind[3]:10.1f}{by_kind[7]:10.1f}{statistics.mean(by_kind):11.1f}"
            )
    print(
        "\nordinary: a step inside a window; window: one closing a window; select: a select "
        "boundary. Step columns count step() + zero_grad()."
    )
    timed_rows = ("zenflow device sums", "zenflow host sums", "torch adamw foreach")
    for dtype in dtypes:
        _print_times(args.layers, dtype, args.cycles, timed_rows)
    print(
        "\nbackward, ordinary, window, select: medians over the cycles; mean step: forward, "
        "backward and step over whole select cycles, the garbage collector's passes included; "
        "vs foreach: the mean step over torch foreach AdamW's. young: collections of "
        "generations 0 and 1; full: of every object the process tracks (a compiled model's "
        "many: a fraction of a second each)."
    )


if __name__ == "__main__":
    main()
