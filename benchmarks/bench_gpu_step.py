"""zenflow vs DeepSpeed ZeRO-Offload vs no offload: one GPT training step on a GPU.

    python benchmarks/bench_gpu_step.py [--device cuda] [--out DIR] [--peers zenflow,ds-offload,ds-zenflow,adamw]
        [--layers 24] [--width 1024] [--heads 16] [--seq 512] [--batch 8] [--vocab 50304]
        [--update-interval 8] [--select-interval 64] [--pt-reserved-cores-perc 0.5]
        [--warmup N] [--steps N]
        [--profile-steps N] [--trace-steps N] [--inner inductor] [--peer-timeout S]
    python benchmarks/bench_gpu_step.py --device cpu --quick   # a smoke run of the same code on CPU
    python benchmarks/bench_gpu_step.py --summarize --out DIR  # the table from the JSON files in DIR

benchmarks/gpu_check.sh runs it once per row, each under its own time limit. Without a CUDA
device and without --device cpu it prints a note and exits 0 (so `make bench` passes on CPUs).

Model: examples/gpt_model.py's GPT (pre-LN, tied LM head) at GPT-2-medium size by default: 24
layers, width 1024, 16 heads, 512 tokens, vocabulary 50304: 355M parameters, bf16 on the GPU.
Data: fixed random token batches (the step time does not depend on what is learnt).

Rows, each in its own process (DeepSpeed initializes torch.distributed; the rows must not share
a process group, a compile cache in memory or CPU threads):
  zenflow          torch.compile(model, backend="zenflow") (Inductor) + zenflow.ZenFlowAdamW
                   (topk 0.1, update_interval 8, select_interval 64, overlap_step: the schedule
                   zenflow's GPU targets are set at; --update-interval, --select-interval) on the
                   bf16 model;
                   accumulate_on_device as "auto" decides (on for one GPU rank where the window
                   sums fit: stats()["accumulate_on_device"] says)
  ds-offload       DeepSpeed ZeRO stage 2, offload_optimizer cpu (pinned), bf16, AdamW through
                   DeepSpeedCPUAdam (built just in time on first use), overlap_comm and
                   contiguous_gradients as DeepSpeed's offload tutorial sets them; eager model
  ds-zenflow       DeepSpeed's own ZenFlow: ds-offload plus the zero_optimization.zenflow block
                   with zenflow's settings and schedule (select_strategy "step"); eager model
  adamw            no offload: the bf16 model compiled by Inductor, fp32 master weights and
                   torch.optim.AdamW(fused=True) on the GPU (grads cast to fp32, masters copied back)
  zenflow-hostsum  (optional) zenflow with accumulate_on_device false: window sums on the host
  zenflow-offload  (optional) zenflow with topk 0, update_interval 1: ZeRO-Offload through zenflow

Measured per row, after --warmup steps (the zenflow rows and DeepSpeed's ZenFlow: two windows,
which include compilation and DeepSpeed's worker start; else 3):
  step time   over --steps steps (the zenflow rows and DeepSpeed's ZenFlow: a select interval,
              so that the mean is over a whole select cycle: any select_interval consecutive
              steps of the schedule hold one select boundary and every window close of a cycle;
              else 16), each step waiting for its work on the current stream as a training loop
              that reads its loss does (copies on a side stream may run on into the next step):
              median of the steps' wall clock (min, max in the JSON), mean = the whole span's
              wall clock (its last copies waited for) / steps;
  idle        the device-idle (stall) fraction over --profile-steps further steps, measured with
              torch.profiler (CUDA activity only; zenflow: a whole select cycle, else 4 steps):
              1 - (union of the intervals in which a kernel or
              memset ran) / (wall time of those steps). Copies do not count as busy: a GPU whose
              SMs wait for a transfer or for the host is stalled. The profiler adds a little
              host overhead, so this errs towards idle; it is the same for every row;
  fwd+bwd     CUDA events around forward + backward on the current stream, as a share of the
              step's wall time (the events' span also contains any gaps inside fwd + bwd);
  bytes/step  host<->device traffic per step: zenflow from stats() (d2h_bytes + h2d_bytes);
              DeepSpeed analytic ("~": bf16 gradients to the host and bf16 weights back, 2 x 2
              bytes per parameter per step); and, for every row, measured from the profiler's
              memcpy records (HtoD + DtoH bytes over the profiled steps).
  syncs/step  zenflow: the times a step waited for the device or read a value it computed
              (stats()["device_syncs"] over the timed steps); n/a for the peers.
Each row writes DIR/bench_<row>.json as soon as it is timed and again after profiling, then
DIR/bench.md (the table of every row present so far), so a run cut short still reports. On a
GPU the zenflow rows also keep the last thing they do: a chrome trace of --trace-steps (2)
ordinary steps in the middle of a window, CPU and CUDA activity with the bench:: and zenflow::
ranges, in DIR/trace_<row>.json.gz (open it in Perfetto), to read the device's gaps where the
lease ran.
"""

import argparse
import gzip
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEERS = ("zenflow", "ds-offload", "ds-zenflow", "adamw", "zenflow-hostsum", "zenflow-offload")
DEFAULT_PEERS = "zenflow,ds-offload,ds-zenflow,adamw"
HYPER = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
# The zenflow rows' phases are profiled over at most this many steps (every operation on the
# host recorded: slow for a long cycle).
PHASE_STEPS = 16
# zenflow's counters recorded for every timed step, to split a slow one.
STEP_COUNTERS = ("host_after_sync_s", "optimizer_wait_s", "device_syncs", "hand_over_s")


def _args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--quick", action="store_true", help="tiny model, few steps (smoke)")
    parser.add_argument("--out", default=None, help="results directory (runs/bench_gpu_step)")
    parser.add_argument("--peers", default=DEFAULT_PEERS, help=f"comma-separated, from {PEERS}")
    parser.add_argument("--layers", type=int, default=None, help="GPT layers (24)")
    parser.add_argument("--width", type=int, default=None, help="model width (1024)")
    parser.add_argument("--heads", type=int, default=None, help="attention heads (16)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (512)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (8)")
    parser.add_argument("--vocab", type=int, default=None, help="vocabulary (50304)")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="cuda: bf16")
    parser.add_argument("--update-interval", type=int, default=None, help="zenflow rows (8)")
    parser.add_argument("--select-interval", type=int, default=None, help="zenflow rows (64)")
    parser.add_argument(
        "--warmup", type=int, default=None, help="zenflow rows and ds-zenflow 2 windows, else 3"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="timed steps (zenflow rows a select interval, 16)"
    )
    parser.add_argument(
        "--profile-steps", type=int, default=None, help="zenflow a select interval, else 4"
    )
    parser.add_argument(
        "--trace-steps", type=int, default=None, help="zenflow rows on a GPU: a kept trace (2)"
    )
    parser.add_argument(
        "--pt-reserved-cores-perc",
        type=float,
        default=None,
        help="zenflow rows and ds-zenflow: the cores kept from the CPU pool (0.5, both's default)",
    )
    parser.add_argument(
        "--no-bind-cores",
        action="store_true",
        help="zenflow rows: the CPU pool's workers on any core (bind_cores False), not pinned "
        "to the cores --pt-reserved-cores-perc leaves them",
    )
    parser.add_argument(
        "--inner",
        choices=("inductor", "eager"),
        default=None,
        help="inductor (default): zenflow over Inductor, adamw's model by Inductor; eager: "
        'zenflow options={"inner": "eager"}, adamw aot_eager (--quick)',
    )
    parser.add_argument(
        "--step-backend",
        choices=("auto", "inductor", "eager"),
        default=None,
        help="zenflow rows' device update (ZenFlowAdamW's step_backend): auto (default: eager on "
        "a GPU), inductor; eager with --inner eager",
    )
    parser.add_argument(
        "--ds-torch-adam",
        action="store_true",
        help="DeepSpeed: torch's Adam on the CPU instead of DeepSpeedCPUAdam (no JIT build)",
    )
    parser.add_argument("--peer-timeout", type=float, default=None, help="seconds per row")
    parser.add_argument("--summarize", action="store_true", help="only rewrite the table")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quick = dict(layers=2, width=64, heads=2, seq=32, batch=2, vocab=256, steps=8, inner="eager")
    quick |= dict(update_interval=4, select_interval=8)
    full = dict(layers=24, width=1024, heads=16, seq=512, batch=8, vocab=50304, inner="inductor")
    full |= dict(update_interval=8, select_interval=64)
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.out is None:
        args.out = str(ROOT / "runs" / "bench_gpu_step")
    return args


def _zenflow_settings(args) -> dict:
    """zenflow's settings for the zenflow rows and DeepSpeed's ZenFlow."""
    settings = dict(
        topk_ratio=0.1,
        update_interval=args.update_interval,
        select_interval=args.select_interval,
        overlap_step=True,
    )
    if args.pt_reserved_cores_perc is not None:
        settings["pt_reserved_cores_perc"] = args.pt_reserved_cores_perc
    return settings


def _runs_cycles(peer: str) -> bool:
    """A row whose steps follow zenflow's schedule (its mean is taken over a select cycle)."""
    return "zenflow" in peer


def _param_count(args) -> int:
    w = args.width
    block = 2 * 2 * w + (3 * w * w + 3 * w) + (w * w + w) + (4 * w * w + 4 * w) + (4 * w * w + w)
    return args.vocab * w + args.seq * w + args.layers * block + 2 * w


# The worker: one row, in its own process.


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step_done(device) -> None:
    """Wait for the step's work on the current stream, as a training loop that reads its loss
    does; copies on other streams (zenflow's copy stream) may run on into the next step."""
    import torch

    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class _Runner:
    """A row's training step in its halves: ``forward`` (the loss), ``backward``, and
    ``optimizer_step``."""

    def forward_backward(self, x, y):
        loss = self.forward(x, y)
        self.backward(loss)
        return loss


class _ZenFlow(_Runner):
    def __init__(self, peer, model, args):
        import torch

        import zenflow

        settings = _zenflow_settings(args)
        if peer == "zenflow-hostsum":
            settings["accumulate_on_device"] = False
        if peer == "zenflow-offload":
            settings = dict(topk_ratio=0.0, update_interval=1, select_interval=1)
        if args.no_bind_cores:
            settings["bind_cores"] = False
        # The default step backend (eager on a GPU, Inductor on the CPU), unless asked for or
        # the whole run is eager (--inner eager: debugging, and the CPU smoke run).
        step_backend = args.step_backend or ("auto" if args.inner == "inductor" else "eager")
        self.opt = zenflow.ZenFlowAdamW(
            model.parameters(), **HYPER, step_backend=step_backend, **settings
        )
        self.settings = {
            **settings,
            "step_backend": self.opt.step_backend,
            "cpu_pool_cpus": self.opt.stats()["cpu_pool_cpus"],
        }
        self.model = torch.compile(model, backend="zenflow", options={"inner": args.inner})

    def forward(self, x, y):
        return self.model(x, y)[1]

    def backward(self, loss):
        loss.backward()

    def optimizer_step(self):
        self.opt.step()
        self.opt.zero_grad()

    def counters(self) -> dict:
        return self.opt.stats()

    def analytic_bytes_per_step(self, params: int, element_size: int):
        return None


class _AdamW(_Runner):
    """No offload: everything on the device; fp32 masters when the model is 16-bit."""

    def __init__(self, peer, model, args):
        import torch

        self.settings = dict(fused=True, fp32_masters=True)
        self.module = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.mixed = any(p.dtype != torch.float32 for p in self.params)
        self.masters = [p.detach().float().clone() for p in self.params] if self.mixed else None
        self.opt = torch.optim.AdamW(self.masters or self.params, **HYPER, fused=True)
        backend = "inductor" if args.inner == "inductor" else "aot_eager"
        self.model = torch.compile(model, backend=backend)

    def forward(self, x, y):
        return self.model(x, y)[1]

    def backward(self, loss):
        loss.backward()

    def optimizer_step(self):
        import torch

        if self.mixed:
            for m, p in zip(self.masters, self.params, strict=True):
                m.grad = p.grad.float()
                p.grad = None
        self.opt.step()
        if self.mixed:
            with torch.no_grad():
                for p, m in zip(self.params, self.masters, strict=True):
                    p.copy_(m)
        self.opt.zero_grad(set_to_none=True)
        self.module.zero_grad(set_to_none=True)

    def counters(self) -> dict:
        return {}

    def analytic_bytes_per_step(self, params: int, element_size: int):
        return 0


class _DeepSpeed(_Runner):
    def __init__(self, peer, model, args):
        import torch

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        for key, value in dict(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
        ).items():
            os.environ.setdefault(key, value)
        import deepspeed

        cuda = next(model.parameters()).device.type == "cuda"
        optimizer = dict(HYPER, betas=list(HYPER["betas"]))
        if args.ds_torch_adam:
            optimizer["torch_adam"] = True
        zero = {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": cuda},
            "overlap_comm": cuda,
            "contiguous_gradients": True,
        }
        if peer == "ds-zenflow":
            zero["zenflow"] = dict(_zenflow_settings(args), select_strategy="step")
        self.peer = peer
        bf16 = next(model.parameters()).dtype == torch.bfloat16
        self.settings = dict(zero_optimization=zero, bf16=bf16, torch_adam=args.ds_torch_adam)
        config = {
            "train_micro_batch_size_per_gpu": args.batch,
            "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": optimizer},
            "zero_optimization": zero,
            "bf16": {"enabled": bf16},
            "steps_per_print": 10**9,
        }
        self.engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )

    def forward(self, x, y):
        return self.engine(x, y)[1]

    def backward(self, loss):
        self.engine.backward(loss)

    def optimizer_step(self):
        self.engine.step()

    def counters(self) -> dict:
        return {}

    def analytic_bytes_per_step(self, params: int, element_size: int):
        # ZeRO-Offload: every gradient to the host, every updated weight back, each step.
        # DeepSpeed's ZenFlow: every gradient down each step, the unselected weights back once
        # per window (the selected ones are updated on the device).
        if self.peer == "ds-zenflow":
            schedule = self.settings["zero_optimization"]["zenflow"]
            up = (1 - schedule["topk_ratio"]) / schedule["update_interval"]
            return (1 + up) * params * element_size
        return 2 * params * element_size


def _union_seconds(intervals) -> float:
    total, end = 0.0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total / 1e6  # trace timestamps are microseconds


def _step_kind(before: dict, after: dict) -> str | None:
    """What a zenflow step did, from its counters: "reselect" (it moved the selection),
    "window close" (it ran a CPU update), "inside a window"; None for rows without counters."""
    if not after:
        return None
    if after["reselections"] > before["reselections"]:
        return "reselect"
    if after["cpu_updates"] > before["cpu_updates"]:
        return "window close"
    return "inside a window"


def _by_kind(record: dict) -> str:
    """Median step time per kind of step, e.g. "inside a window 180.2 ms (10), ..."."""
    times: dict[str, list[float]] = {}
    for kind, t in zip(record.get("step_kinds") or [], record["step_times_s"], strict=False):
        if kind is not None:
            times.setdefault(kind, []).append(t)
    return ", ".join(
        f"{kind} {1000 * statistics.median(ts):.1f} ms ({len(ts)})" for kind, ts in times.items()
    )


def _profile(runner, batches, device, steps: int) -> dict:
    """Device-busy time and copies over ``steps`` steps, from a torch.profiler trace."""
    from torch.profiler import ProfilerActivity, profile

    _sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _sync(device)
        started = time.perf_counter()
        for i in range(steps):
            runner.forward_backward(*batches[i % len(batches)])
            runner.optimizer_step()
        _sync(device)
        wall = time.perf_counter() - started
    events = _trace_events(prof)
    kernels = _kernel_intervals(events)
    copies = [e for e in events if "memcpy" in e["cat"].lower()]
    copy_intervals = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in copies]

    def moved(kind: str):
        chosen = [e for e in copies if kind in e.get("name", "")]
        if any("bytes" not in e.get("args", {}) for e in chosen):
            return None
        return sum(int(e["args"]["bytes"]) for e in chosen) / steps

    busy = _union_seconds(kernels)
    return dict(
        steps=steps,
        wall_s=wall,
        kernel_events=len(kernels),
        kernel_busy_s=busy,
        idle_fraction=max(0.0, 1.0 - busy / wall) if kernels else None,
        copy_busy_s=_union_seconds(copy_intervals),
        h2d_bytes_per_step=moved("HtoD"),
        d2h_bytes_per_step=moved("DtoH"),
    )


def _trace_events(prof) -> list[dict]:
    """A profile's timed events (chrome trace, timestamps in microseconds)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    return [e for e in events if "dur" in e and "ts" in e and isinstance(e.get("cat"), str)]


def _kernel_intervals(events: list[dict]) -> list[tuple[float, float]]:
    """When the device computed: kernels and memsets (Kineto's categories "kernel" and
    "gpu_memset"; older: "Kernel", "Memset"). Copies do not count: a device whose SMs wait
    for a transfer is stalled."""
    return [
        (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        for e in events
        if e["cat"].lower() == "kernel" or "memset" in e["cat"].lower()
    ]


def _idle_by_range(kernels, ranges, span) -> dict[str, float]:
    """The device's idle time within ``span`` (start, end), split by the host range opened last
    among those open at each moment ("no range" where none is): what the host was doing while
    the device waited. ``kernels``: the device's busy intervals (start, end); ``ranges``:
    profiler ranges (start, end, name), nested as record_function nests them (a range that
    ends inside a later one stops counting when it ends). Times in the units given."""
    gaps, cursor = [], span[0]
    for start, end in sorted(kernels):
        if start > cursor:
            gaps.append((cursor, min(start, span[1])))
        cursor = max(cursor, end)
        if cursor >= span[1]:
            break
    if cursor < span[1]:
        gaps.append((cursor, span[1]))
    gaps = [(a, b) for a, b in gaps if b > a]
    opened = sorted((r for r in ranges if r[1] > r[0]), key=lambda r: (r[0], -r[1]))
    points = sorted(
        {t for r in opened for t in r[:2] if span[0] < t < span[1]}
        | {t for gap in gaps for t in gap}
        | set(span)
    )
    idle: dict[str, float] = {}
    stack, next_range, next_gap = [], 0, 0
    for a, b in zip(points, points[1:], strict=False):
        while stack and stack[-1][1] <= a:
            stack.pop()
        while next_range < len(opened) and opened[next_range][0] <= a:
            if opened[next_range][1] > a:
                stack.append(opened[next_range])
            next_range += 1
        while next_gap < len(gaps) and gaps[next_gap][1] <= a:
            next_gap += 1
        if next_gap < len(gaps) and gaps[next_gap][0] <= a:
            name = stack[-1][2] if stack else "no range"
            idle[name] = idle.get(name, 0.0) + (b - a)
    return idle


def _idle_split(events: list[dict], steps: int) -> dict[str, float]:
    """Device-idle milliseconds per step by the innermost ``bench::`` or ``zenflow::`` range
    open on the host (``_idle_by_range``), over the span of those ranges in a trace."""
    # Every thread's ranges: a GPU's backward runs on autograd's device thread, whose zenflow
    # operations (the hand-over of each weight's gradient, "cpu_op" events) fall inside the
    # training thread's bench::forward_backward.
    ranges = [
        (float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"])
        for e in events
        if e["name"].startswith(("bench::", "zenflow::"))
        and e["cat"] in ("user_annotation", "cpu_op")
    ]
    span = (min(r[0] for r in ranges), max(r[1] for r in ranges))
    idle = _idle_by_range(_kernel_intervals(events), ranges, span)
    return {name: us / 1000 / steps for name, us in idle.items()}


def _traced_steps(runner, batches, device, steps: int):
    """``steps`` steps under torch.profiler with CPU (and device) activity, each half of a step
    in its range (``bench::forward_backward``, ``bench::step``); returns the profile."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    _sync(device)
    with profile(activities=activities) as prof:
        for i in range(steps):
            with record_function("bench::forward_backward"):
                runner.forward_backward(*batches[i % len(batches)])
            with record_function("bench::step"):
                runner.optimizer_step()
        _sync(device)
    return prof


def _keep_trace(runner, batches, device, steps: int, out: Path, peer: str, skip: int = 0) -> str:
    """A chrome trace of ``steps`` steps (``_traced_steps``) after ``skip`` untraced ones,
    gzipped into ``out``; returns its file name."""
    for i in range(skip):
        runner.forward_backward(*batches[i % len(batches)])
        runner.optimizer_step()
    prof = _traced_steps(runner, batches, device, steps)
    name = f"trace_{peer}.json.gz"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path, "rb") as f, gzip.open(out / name, "wb") as kept:
            shutil.copyfileobj(f, kept)
    return name


def _phases(runner, batches, device, steps: int) -> dict:
    """zenflow's step phases over ``steps`` further steps, a separate trace with CPU activity
    (which slows the host, so it stays out of the idle measurement): ``host_ms`` per step in
    each ``zenflow::`` profiler range, and on a GPU ``device_idle_ms`` per step by the host range
    open while the device idled (``bench::forward_backward`` and ``bench::step`` around the
    step's two halves, zenflow's ranges inside them)."""
    prof = _traced_steps(runner, batches, device, steps)
    phases = dict(
        host_ms={
            event.key: event.cpu_time_total / 1000 / steps
            for event in prof.key_averages()
            if event.key.startswith("zenflow::")
        }
    )
    if device.type == "cuda":
        try:
            phases["device_idle_ms"] = _idle_split(_trace_events(prof), steps)
        except Exception as error:  # a diagnostic: the row's timings stand without it
            phases["device_idle_error"] = f"{type(error).__name__}: {error}"
    return phases


def _write_json(path: Path, record: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)


def _check_zenflow_did_its_work(settings: dict, counted: dict, steps: int) -> None:
    """A zenflow row whose timed steps moved nothing or skipped its CPU updates or reselections
    timed something else (say, an op Inductor dropped from the backward): it fails."""
    expected = dict(cpu_updates=steps // settings["update_interval"], reselections=0)
    if settings["topk_ratio"] > 0:
        expected["reselections"] = steps // settings["select_interval"]
    seen = {key: counted.get(key, 0) for key in expected}
    if counted.get("d2h_bytes", 0) <= 0 or seen != expected:
        raise RuntimeError(
            f"the timed steps did not do zenflow's work: d2h_bytes {counted.get('d2h_bytes', 0)} "
            f"(expected > 0), {seen} (expected {expected})"
        )


def _worker(args, peer: str) -> int:
    started = time.perf_counter()
    out = Path(args.out)
    path = out / f"bench_{peer}.json"
    record = dict(peer=peer, status="starting", device=args.device, quick=args.quick)
    try:
        import torch

        sys.path.insert(0, str(ROOT / "examples"))
        from gpt_model import GPT, GPTConfig

        device = torch.device(args.device)
        if device.type == "cuda":
            if device.index is None:  # torch.cuda.set_device wants an index
                device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(device)
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
        record.update(
            torch=torch.__version__,
            python=platform.python_version(),
            gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            dtype=args.dtype,
            model=dict(
                layers=args.layers,
                width=args.width,
                heads=args.heads,
                seq=args.seq,
                batch=args.batch,
                vocab=args.vocab,
            ),
        )
        torch.manual_seed(0)
        config = GPTConfig(
            vocab_size=args.vocab,
            block_size=args.seq,
            n_layer=args.layers,
            n_head=args.heads,
            n_embd=args.width,
        )
        model = GPT(config).to(device=device, dtype=dtype)
        params = sum(p.numel() for p in model.parameters())
        element_size = next(model.parameters()).element_size()
        record["params"] = params
        g = torch.Generator().manual_seed(1)
        batches = []
        for _ in range(4):
            tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
            batches.append((tokens[:, :-1].to(device), tokens[:, 1:].to(device)))
        kind = _DeepSpeed if peer.startswith("ds-") else _AdamW if peer == "adamw" else _ZenFlow
        runner = kind(peer, model, args)
        record["settings"] = runner.settings
        warmup = args.warmup
        if warmup is None:
            # DeepSpeed's ZenFlow starts its CPU optimizer's worker at its first window close
            # (seconds on the CPU): two windows keep that out of the timed steps, as for ours.
            warmup = 2 * args.update_interval if _runs_cycles(peer) else 3
        steps = args.steps
        if steps is None:
            steps = args.select_interval if _runs_cycles(peer) else 16
        record.update(status="compiling and warming up", built_s=time.perf_counter() - started)
        _write_json(path, record)
        print(f"[{peer}] {params / 1e6:.1f}M parameters, set up in {record['built_s']:.1f}s")
        warmup_times = record["warmup_times_s"] = []
        # zenflow's rows: each step's stack samples and collector pauses, to explain a slow one.
        samples = None
        if isinstance(runner, _ZenFlow):
            from stack_samples import StepSamples  # beside this script, which runs as a file

            samples = StepSamples()
        warmup_samples = record["warmup_samples"] = []
        for i in range(warmup):
            t0 = time.perf_counter()
            if samples:
                samples.begin()
            runner.forward_backward(*batches[i % len(batches)])
            runner.optimizer_step()
            _sync(device)
            warmup_times.append(time.perf_counter() - t0)
            if samples:
                warmup_samples.append(samples.end())
            print(f"[{peer}] warm-up step {i + 1}/{warmup}: {warmup_times[-1]:.2f}s", flush=True)
            _write_json(path, record)
        record.update(status="warmed up", setup_s=time.perf_counter() - started, warmup=warmup)
        _write_json(path, record)
        print(f"[{peer}] set up, compiled and warmed up in {record['setup_s']:.1f}s", flush=True)

        before = runner.counters()
        times, spans, losses, kinds, per_step, host = [], [], [], [], [], []
        _sync(device)
        span_start = time.perf_counter()
        for i in range(steps):
            counted = runner.counters()
            x, y = batches[(warmup + i) % len(batches)]
            if device.type == "cuda":
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
            t0 = time.perf_counter()
            if samples:
                samples.begin()
            if device.type == "cuda":
                begin.record()
            loss = runner.forward(x, y)
            t1 = time.perf_counter()
            runner.backward(loss)
            t2 = time.perf_counter()
            if device.type == "cuda":
                end.record()
            runner.optimizer_step()
            t3 = time.perf_counter()
            _step_done(device)
            times.append(time.perf_counter() - t0)
            host.append((t1 - t0, t2 - t1, t3 - t2))
            if device.type == "cuda":
                spans.append(begin.elapsed_time(end) / 1000)
            losses.append(float(loss.detach().float()))
            stepped = runner.counters()
            kinds.append(_step_kind(counted, stepped))
            per_step.append({k: stepped[k] - counted[k] for k in STEP_COUNTERS if k in stepped})
            if samples:
                per_step[-1].update(samples.end())
        _sync(device)
        span = time.perf_counter() - span_start
        if samples:
            samples.close()
        after = runner.counters()
        delta = {k: after[k] - before.get(k, 0) for k in after if isinstance(after[k], int | float)}
        moved = delta.get("d2h_bytes", 0) + delta.get("h2d_bytes", 0)
        analytic = runner.analytic_bytes_per_step(params, element_size)
        record.update(
            status="timed",
            steps=steps,
            step_times_s=times,
            median_s=statistics.median(times),
            mean_s=span / steps,
            min_s=min(times),
            max_s=max(times),
            fwd_bwd_share=(
                statistics.fmean(s / t for s, t in zip(spans, times, strict=True))
                if spans
                else None
            ),
            losses=losses,
            step_kinds=kinds,
            fwd_bwd_s=spans,
            host_s=host,
            step_counters=per_step,
            counters=delta,
            bytes_per_step=moved / steps if after else analytic,
            bytes_per_step_source="stats" if after else "analytic",
            peak_memory_gb=(
                torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
            ),
        )
        _write_json(path, record)
        print(
            f"[{peer}] median step {1000 * record['median_s']:.1f} ms over {steps} steps",
            flush=True,
        )
        if isinstance(runner, _ZenFlow):
            _check_zenflow_did_its_work(runner.settings, delta, steps)
        # The row's ratio stands from here, also if the profiling below is cut short.
        record["timings_valid"] = True
        _write_json(path, record)

        profile_steps = args.profile_steps
        if profile_steps is None:
            profile_steps = args.select_interval if isinstance(runner, _ZenFlow) else 4
        if device.type == "cuda" and profile_steps > 0:
            record["profile"] = _profile(runner, batches, device, profile_steps)
            idle = record["profile"]["idle_fraction"]
            print(f"[{peer}] device idle over {profile_steps} profiled steps: {idle}", flush=True)
        # zenflow's phases, and AdamW's for the idle split to compare with (DeepSpeed's steps
        # are too long to trace with CPU activity inside their stages' limits).
        if (runner.counters() or isinstance(runner, _AdamW)) and profile_steps > 0:
            phase_steps = min(profile_steps, PHASE_STEPS)
            record["phases"] = _phases(runner, batches, device, phase_steps)
            _write_json(path, record)
        trace_steps = args.trace_steps
        if trace_steps is None:
            trace_steps = 2 if isinstance(runner, _ZenFlow) and device.type == "cuda" else 0
        if trace_steps > 0:
            # zenflow: steps in the middle of a window (the rows above end on a window close),
            # away from the closes and from the CPU pool's pass that follows each.
            skip = args.update_interval // 2 if isinstance(runner, _ZenFlow) else 0
            record["trace"] = _keep_trace(runner, batches, device, trace_steps, out, peer, skip)
        record.update(status="done", total_s=time.perf_counter() - started)
        _write_json(path, record)
        return 0
    except Exception as error:
        traceback.print_exc()
        record.update(status="failed", error=f"{type(error).__name__}: {error}"[:2000])
        record["total_s"] = time.perf_counter() - started
        _write_json(path, record)
        return 1


# The parent: run the rows, then the table.


def _mb(n) -> str:
    if n is None:
        return "n/a"
    return f"{n / 2**20:.0f} MB" if n >= 2**20 or n == 0 else f"{n / 2**10:.1f} KB"


def _by_size(ms: dict[str, float]) -> str:
    """Largest first, one decimal: "name 1.2, other 0.4"."""
    return ", ".join(
        f"{key} {value:.1f}" for key, value in sorted(ms.items(), key=lambda kv: -kv[1])
    )


def _slowest_steps(name: str, record: dict, count: int = 3) -> str:
    """The row's slowest timed steps, each split into what the host knows of it: a slow step
    inside a window is not explained by the step's mean, and a GPU lease is too short to find
    it again."""
    times = record.get("step_times_s") or []
    kinds = record.get("step_kinds") or []
    spans = record.get("fwd_bwd_s") or []
    counted = record.get("step_counters") or []
    parts = []
    for i in sorted(range(len(times)), key=times.__getitem__, reverse=True)[:count]:
        kind = kinds[i] if i < len(kinds) and kinds[i] else None
        part = f"#{i}" + (f" ({kind})" if kind else "") + f" {1000 * times[i]:.1f} ms"
        details = []
        if i < len(spans):
            details.append(f"forward+backward {1000 * spans[i]:.1f} ms")
        step_counted = counted[i] if i < len(counted) else {}
        for key, label in (
            ("host_after_sync_s", "host after the sync"),
            ("optimizer_wait_s", "waiting for the CPU pool"),
        ):
            if key in step_counted:
                details.append(f"{label} {1000 * step_counted[key]:.1f} ms")
        if "device_syncs" in step_counted:
            details.append(f"{step_counted['device_syncs']} syncs")
        details += _sampled(step_counted)
        parts.append(part + (f": {', '.join(details)}" if details else ""))
    text = f"{name} slowest timed steps: " + "; ".join(parts)
    warmup = record.get("warmup_times_s") or []
    sampled = record.get("warmup_samples") or []
    # The first warm-up step compiles; the others show what only the first windows do.
    slow = sorted(range(1, len(warmup)), key=warmup.__getitem__, reverse=True)[:count]
    if slow and sampled:
        text += f"\n{name} slowest warm-up steps (of {len(warmup)}): " + "; ".join(
            f"#{i} {1000 * warmup[i]:.1f} ms"
            + (f": {', '.join(_sampled(sampled[i]))}" if i < len(sampled) else "")
            for i in slow
        )
    return text


def _host_split(name: str, record: dict) -> str | None:
    """The host's time in each part of a step, unprofiled (the profiler's own cost per
    operation is larger than many of the operations): medians over the steps inside a window
    for a zenflow row, over every timed step otherwise. A part whose host time exceeds what the
    device spends on it is where the device waits."""
    host = record.get("host_s") or []
    if not host:
        return None
    kinds = record.get("step_kinds") or []
    chosen = [i for i, kind in enumerate(kinds) if kind == "inside a window"]
    which = f"the {len(chosen)} steps inside a window"
    if not chosen:
        chosen, which = list(range(len(host))), f"{len(host)} steps"
    forward, backward, step = (
        1000 * statistics.median(host[i][part] for i in chosen) for part in range(3)
    )
    text = (
        f"{name} host ms per step, unprofiled (medians over {which}): forward {forward:.1f}, "
        f"backward {backward:.1f}, optimizer step {step:.1f}"
    )
    counted = record.get("step_counters") or []
    if len(counted) == len(host) and all("hand_over_s" in counted[i] for i in chosen):
        # What zenflow adds to the compiled backward's host time; the rest of it is the graph's
        # own work, which AdamW's row runs as well.
        hand_overs = 1000 * statistics.median(counted[i]["hand_over_s"] for i in chosen)
        text += f" (of the backward, zenflow's gradient hand-overs {hand_overs:.1f})"
    spans = record.get("fwd_bwd_s") or []
    if len(spans) == len(host):
        device = 1000 * statistics.median(spans[i] for i in chosen)
        text += f"; forward+backward on the device's clock {device:.1f}"
    return text


def _sampled(step: dict) -> list[str]:
    """A step's collector pauses and most sampled places (``stack_samples.StepSamples``)."""
    if "gc_s" not in step:
        return []
    found = [f"garbage collection {1000 * step['gc_s']:.1f} ms"]
    if step.get("samples"):
        found.append(
            f"{step['samples']} stack samples: "
            + " | ".join(f"{count}x {place}" for place, count in step["frames"])
        )
    return found


def _zenflow_work(name: str, record: dict) -> str:
    """A zenflow row's CPU work over its timed steps, and whether the CPU's pass per window
    bounds the step: the pass runs beside the window's steps, so a pass longer than the
    window's time on the device makes the training thread wait for it at the next boundary,
    whatever the device does (the env stage's host memory bandwidth tells why)."""
    counted = record["counters"]
    text = f"{name} over the timed steps: " + ", ".join(
        f"{key} {counted[key]:.3f}" if isinstance(counted[key], float) else f"{key} {counted[key]}"
        for key in (
            "cpu_updates",
            "reselections",
            "optimizer_wait_s",
            "cpu_adam_s",
            "cpu_accumulate_s",
        )
        if key in counted
    )
    after_sync = counted.get("host_after_sync_s")
    if after_sync is not None and record.get("steps") and record.get("mean_s"):
        per_step = after_sync / record["steps"]
        text += (
            f"; host time in step() after the step's synchronization {1000 * per_step:.1f} ms "
            f"per step ({100 * per_step / record['mean_s']:.0f}% of the mean step: the device "
            "waits for the host about that long)"
        )
    interval = (record.get("settings") or {}).get("update_interval")
    if counted.get("cpu_updates") and interval and record.get("mean_s"):
        cpu_pass = counted.get("cpu_adam_s", 0.0) / counted["cpu_updates"]
        window = interval * record["mean_s"]
        verdict = "the host bounds the step" if cpu_pass > window else "within the window"
        text += (
            f"; CPU pass per window {1000 * cpu_pass:.0f} ms against the window's "
            f"{1000 * window:.0f} ms (update_interval x mean step): {verdict}"
        )
    return text


def _summarize(args) -> str:
    out = Path(args.out)
    records = {}
    for name in PEERS:
        path = out / f"bench_{name}.json"
        if path.exists():
            records[name] = json.loads(path.read_text())
    zenflow_row = records.get("zenflow", {})
    ours = zenflow_row.get("mean_s") if zenflow_row.get("timings_valid") else None
    first = next(iter(records.values()), {})
    lines = [
        "# bench_gpu_step: one GPT training step, zenflow vs DeepSpeed ZeRO-Offload vs no offload",
        "",
        f"device: {first.get('gpu') or first.get('device')}, torch {first.get('torch')}, "
        f"python {first.get('python')}, {first.get('dtype')}; model {first.get('model')}, "
        f"{(first.get('params') or 0) / 1e6:.1f}M parameters",
        "",
    ]
    schedule = next(
        (
            r["settings"]
            for name, r in records.items()
            if name.startswith("zenflow") and r.get("settings")
        ),
        None,
    )
    if schedule:
        lines += [f"zenflow rows: {schedule}", ""]
    lines += [
        "| row | status | median step | mean | device idle | fwd+bwd share | bytes/step "
        "| bytes/step (profiler) | syncs/step | peak GPU mem | setup | row / zenflow |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in records.items():
        median = r.get("median_s")
        prof = r.get("profile") or {}
        idle = prof.get("idle_fraction")
        measured = None
        if (
            prof.get("h2d_bytes_per_step") is not None
            and prof.get("d2h_bytes_per_step") is not None
        ):
            measured = prof["h2d_bytes_per_step"] + prof["d2h_bytes_per_step"]
        moved = r.get("bytes_per_step")
        marker = "~" if r.get("bytes_per_step_source") == "analytic" and moved else ""
        share = r.get("fwd_bwd_share")
        mem = r.get("peak_memory_gb")
        syncs = (r.get("counters") or {}).get("device_syncs")
        status = r.get("status", "?")
        if status == "failed":
            status = f"failed: {r.get('error', '')[:120]}"
        lines.append(
            "| "
            + " | ".join(
                [
                    name,
                    status,
                    f"{1000 * median:.1f} ms" if median else "n/a",
                    f"{1000 * r['mean_s']:.1f} ms" if r.get("mean_s") else "n/a",
                    f"{100 * idle:.0f}%" if idle is not None else "n/a",
                    f"{100 * share:.0f}%" if share is not None else "n/a",
                    marker + _mb(moved) if moved is not None else "n/a",
                    _mb(measured),
                    f"{syncs / r['steps']:.2f}" if syncs is not None and r.get("steps") else "n/a",
                    f"{mem:.1f} GB" if mem is not None else "n/a",
                    f"{r['setup_s']:.0f}s" if r.get("setup_s") else "n/a",
                    f"{r['mean_s'] / ours:.2f}x"
                    if ours and r.get("timings_valid") and r.get("mean_s")
                    else "n/a",
                ]
            )
            + " |"
        )
    for name, r in records.items():
        about = []
        if r.get("step_kinds") and _by_kind(r):
            about.append(f"{name} median step by kind (count): {_by_kind(r)}")
        phases = r.get("phases") or {}
        if phases.get("host_ms"):
            about.append(
                f"{name} host ms per step by phase (profiled, nested): "
                + _by_size(phases["host_ms"])
            )
        if phases.get("device_idle_ms"):
            about.append(
                f"{name} device idle ms per step by the host range open at the time (profiled "
                "with CPU activity, innermost range): " + _by_size(phases["device_idle_ms"])
            )
        if phases.get("device_idle_error"):
            about.append(f"{name} device idle by host range failed: {phases['device_idle_error']}")
        if r.get("step_times_s"):
            about.append(_slowest_steps(name, r))
        if _host_split(name, r):
            about.append(_host_split(name, r))
        lines += [""] + about if about else []
    for name, r in records.items():
        if name.startswith("zenflow") and r.get("counters"):
            lines += ["", _zenflow_work(name, r)]
    lines += [
        "",
        "median step: wall clock per step (its current stream waited for, as a training loop "
        "reading its loss does), after warm-up; mean: the timed span (every copy waited for at "
        "its end) / steps. device idle: 1 - union of "
        "kernel time / wall time over the profiled steps (torch.profiler). fwd+bwd share: CUDA "
        "events around forward + backward / step wall time. bytes/step: zenflow stats(), '~' "
        "analytic (ZeRO-Offload: bf16 grads down + bf16 weights up; DeepSpeed ZenFlow: grads down, "
        "unselected weights up once per window); profiler: memcpy HtoD + DtoH. "
        "row / zenflow: the row's mean step over zenflow's, both over whole select cycles (above "
        "1: zenflow is faster); a row whose timed steps did not finish, or did not do zenflow's "
        "work, claims none (one cut short while profiling keeps its ratio).",
    ]
    text = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.md").write_text(text)
    return text


def main() -> int:
    args = _args()
    if args.dtype is None:
        args.dtype = "bf16" if args.device == "cuda" else "fp32"
    if args.worker:
        return _worker(args, args.worker)
    if args.summarize:
        print(_summarize(args))
        return 0
    if args.device == "auto":
        import torch

        if not torch.cuda.is_available():
            print(
                "bench_gpu_step: no CUDA device here, nothing to measure (benchmarks/gpu_check.sh "
                "runs it on a GPU machine; --device cpu --quick is a smoke run of the code)"
            )
            return 0
        args.device = "cuda"
        args.dtype = args.dtype or "bf16"
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; known: {', '.join(PEERS)}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    print(
        f"# bench_gpu_step on {args.device} ({args.dtype}): rows {', '.join(peers)}; GPT "
        f"{args.layers} layers x {args.width}, seq {args.seq}, batch {args.batch}, vocab "
        f"{args.vocab} (~{_param_count(args) / 1e6:.0f}M parameters); results in {args.out}",
        flush=True,
    )
    status = 0
    forwarded = [a for a in sys.argv[1:] if a]
    for peer in peers:
        cmd = [sys.executable, os.path.abspath(__file__), *forwarded]
        cmd += ["--device", args.device, "--dtype", args.dtype, "--worker", peer]
        started = time.perf_counter()
        try:
            rc = subprocess.run(cmd, timeout=args.peer_timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
            path = Path(args.out) / f"bench_{peer}.json"
            record = json.loads(path.read_text()) if path.exists() else dict(peer=peer)
            if record.get("status") != "done":
                record["status"] = f"cut at {args.peer_timeout:.0f}s after '{record.get('status')}'"
                _write_json(path, record)
        print(f"[{peer}] exit {rc} after {time.perf_counter() - started:.1f}s", flush=True)
        status = status or (rc != 0)
        print(_summarize(args), flush=True)
    return int(status)


if __name__ == "__main__":
    # Each line reaches a pipe or a log file when printed, not at exit: rows of a long run.
    sys.stdout.reconfigure(line_buffering=True)
    sys.exit(main())
