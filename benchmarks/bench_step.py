"""zenflow's training step against its peers, side by side in one run.

    .venv/bin/python benchmarks/bench_step.py [--quick] [--steps 24] [--regime both]
        [--width 1024] [--blocks 2] [--classes 2048] [--small-batch 4] [--large-batch 64]
        [--ranges]

Rows (same model, data, hyperparameters, gradient_accumulation_steps 1):
  zenflow            torch.compile(backend="zenflow") + ZenFlowAdamW(topk 0.1, update_interval 4,
                     select_interval 8, overlap_step=True)
  zenflow offload    the same with topk 0, update_interval 1, select_interval 1 (ZeRO-Offload
                     behaviour through zenflow)
  ds zero-offload    DeepSpeed ZeRO stage 2, offload_optimizer cpu (DeepSpeedCPUAdam), eager model
  ds zenflow         DeepSpeed's own ZenFlow (zero_optimization.zenflow, same topk / update /
                     select, overlap_step true), eager model
  torch adamw fused  torch.optim.AdamW(fused=True), no offload, model compiled with Inductor
                     (fused is the faster of fused / foreach on CPU here; foreach: --peers)

Model: an MLP of residual blocks (Linear width -> 4 width, GELU, Linear 4 width -> width) and a
Linear classifier head, cross-entropy on synthetic data whose input features have very different
scales (so column importance is concentrated, as ZenFlow assumes). Regimes: "optimizer-bound"
(a few rows per batch: fine-tuning with tiny batches) and "compute-heavy" (many rows).

Every peer runs in its own process (DeepSpeed needs torch.distributed and spawns a process of
its own). The processes start, compile and warm up (one select cycle), then the parent asks them
in turn for blocks of steps (one select cycle each), round robin, so that machine noise hits all
rows alike. Reported: median step time; mean step time (over whole select cycles: the
throughput, window-closing and reselecting steps included); optimizer share (zenflow:
stats()["optimizer_wait_s"] / total; every row also shows step() / total, where step() is
opt.step() + zero_grad() for torch and zenflow, engine.step() for DeepSpeed); bytes moved
host<->device per step (zenflow: from stats(); DeepSpeed: analytic estimate, marked "~"); mean
loss over the last select cycle; ratios = zenflow's median (mean) step time / the row's. "best
block" is the lowest of a row's per-block medians (one block = one select cycle): on a shared
machine, where another job can land on some blocks and not others, its ratio is the steadier one.
The zenflow row's steps are then shown by their position in the select cycle (medians of the
whole step and of ``step()``): with this schedule, position 3 closes a window and position 7 is
the select boundary (which also closes one).
With --ranges, each zenflow row then runs one more select cycle under torch.profiler and prints
its host time per step in each ``zenflow::`` range (write_selected and write_unselected are the
write-backs into the row-major parameters).
"""

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time

CYCLE = 8  # select_interval: warm-up and every timed block are whole select cycles
HYPER = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
ZENFLOW = dict(topk_ratio=0.1, update_interval=4, select_interval=CYCLE)
PEERS = (
    "zenflow",
    "zenflow offload",
    "ds zero-offload",
    "ds zenflow",
    "torch adamw fused",
    "torch adamw foreach",
)
MARK = "@@bench "


def _args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model and few steps (smoke)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per row (24)")
    parser.add_argument(
        "--regime",
        choices=("optimizer-bound", "compute-heavy", "both"),
        default=None,
        help="both (default; --quick: optimizer-bound)",
    )
    parser.add_argument("--width", type=int, default=None, help="model width (1024)")
    parser.add_argument("--blocks", type=int, default=None, help="residual MLP blocks (2)")
    parser.add_argument("--classes", type=int, default=None, help="classifier outputs (2048)")
    parser.add_argument("--small-batch", type=int, default=None, help="rows, optimizer-bound (4)")
    parser.add_argument("--large-batch", type=int, default=None, help="rows, compute-heavy (64)")
    parser.add_argument(
        "--peers",
        default=None,
        help="comma-separated, from: "
        + ", ".join(PEERS)
        + " (default: all but foreach; --quick: zenflow, ds zero-offload, torch adamw fused)",
    )
    parser.add_argument(
        "--inner",
        choices=("inductor", "eager"),
        default=None,
        help="inductor (default): zenflow over Inductor, torch rows compiled by Inductor; eager: "
        'zenflow options={"inner": "eager"}, torch rows aot_eager (--quick)',
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads per process")
    parser.add_argument(
        "--ranges",
        action="store_true",
        help="zenflow rows: host time per step in each zenflow:: profiler range (one more cycle)",
    )
    parser.add_argument(
        "--setup-timeout", type=float, default=None, help="seconds for all workers to be ready"
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quick = dict(
        steps=CYCLE,
        width=64,
        blocks=1,
        classes=32,
        small_batch=2,
        large_batch=32,
        inner="eager",
        regime="optimizer-bound",
        peers="zenflow,ds zero-offload,torch adamw fused",
        setup_timeout=600.0,
    )
    full = dict(
        steps=3 * CYCLE,
        width=1024,
        blocks=2,
        classes=2048,
        small_batch=4,
        large_batch=64,
        inner="inductor",
        regime="both",
        peers=",".join(PEERS[:-1]),
        setup_timeout=900.0,
    )
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.threads is None:
        args.threads = os.cpu_count() or 1
    args.steps = max(CYCLE, -(-args.steps // CYCLE) * CYCLE)
    return args


# The worker: one peer, one regime, in its own process.


def build_model(width: int, blocks: int, classes: int):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(width, 4 * width)
            self.out = nn.Linear(4 * width, width)

        def forward(self, x):
            return x + self.out(nn.functional.gelu(self.fc(x)))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.Sequential(*(Block() for _ in range(blocks)))
            self.head = nn.Linear(width, classes)

        def forward(self, x, y):
            return nn.functional.cross_entropy(self.head(self.blocks(x)), y)

    torch.manual_seed(0)
    return Net()


def _batch(step: int, rows: int, width: int, classes: int):
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    scale = torch.logspace(0, -2, width)  # feature scales 1 .. 0.01: importance is concentrated
    x = torch.randn(rows, width, generator=g) * scale
    y = torch.randint(0, classes, (rows,), generator=g)
    return x, y


class _Torch:
    """zenflow rows and torch AdamW rows: model compiled, optimizer stepped by hand."""

    def __init__(self, peer: str, model, inner: str):
        import torch

        import zenflow

        if peer.startswith("zenflow"):
            self.model = torch.compile(model, backend="zenflow", options={"inner": inner})
            settings = dict(ZENFLOW, overlap_step=True)
            if peer == "zenflow offload":
                settings = dict(topk_ratio=0.0, update_interval=1, select_interval=1)
            self.opt = zenflow.ZenFlowAdamW(model.parameters(), **HYPER, **settings)
        else:
            self.model = torch.compile(
                model, backend="inductor" if inner == "inductor" else "aot_eager"
            )
            variant = dict(fused=True) if peer.endswith("fused") else dict(foreach=True)
            self.opt = torch.optim.AdamW(model.parameters(), **HYPER, **variant)

    def step(self, x, y):
        loss = self.model(x, y)
        loss.backward()
        started = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad()
        return loss.detach(), time.perf_counter() - started

    def counters(self) -> dict:
        stats = getattr(self.opt, "stats", None)
        return stats() if stats else {}


class _DeepSpeed:
    def __init__(self, peer: str, model, rows: int):
        import deepspeed

        zero = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False}}
        if peer == "ds zenflow":
            zero["zenflow"] = dict(ZENFLOW, select_strategy="step", overlap_step=True)
        config = {
            "train_micro_batch_size_per_gpu": rows,
            "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": dict(HYPER, betas=list(HYPER["betas"]))},
            "zero_optimization": zero,
            "steps_per_print": 10**9,
        }
        self.engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )

    def step(self, x, y):
        loss = self.engine(x, y)
        self.engine.backward(loss)
        started = time.perf_counter()
        self.engine.step()
        return loss.detach(), time.perf_counter() - started

    def counters(self) -> dict:
        return {}


def _send(message: dict) -> None:
    sys.stdout.write(MARK + json.dumps(message) + "\n")
    sys.stdout.flush()


def _worker(args) -> None:
    spec = json.loads(args.worker)
    peer, rows = spec["peer"], spec["rows"]
    import torch

    torch.set_num_threads(args.threads)
    model = build_model(args.width, args.blocks, args.classes)
    params = sum(p.numel() for p in model.parameters())
    runner = (
        _DeepSpeed(peer, model, rows) if peer.startswith("ds ") else _Torch(peer, model, args.inner)
    )
    step_index = 0

    def run(n: int) -> dict:
        nonlocal step_index
        before = runner.counters()
        times, step_times, losses = [], [], []
        for _ in range(n):
            x, y = _batch(step_index, rows, args.width, args.classes)
            started = time.perf_counter()
            loss, in_step = runner.step(x, y)
            loss = float(loss)
            times.append(time.perf_counter() - started)
            step_times.append(in_step)
            losses.append(loss)
            step_index += 1
        after = runner.counters()
        delta = {k: after[k] - before.get(k, 0) for k in after if isinstance(after[k], int | float)}
        return dict(times=times, step_times=step_times, losses=losses, counters=delta)

    run(CYCLE)  # compile, first selection, one whole select cycle
    _send(dict(ready=True, params=params))
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("quit"):
            break
        if command.get("ranges"):
            _send(dict(ranges=_profiled_ranges(run, command["ranges"])))
            continue
        _send(run(command["steps"]))


def _profiled_ranges(run, steps: int) -> dict[str, float]:
    """Host milliseconds per step in each ``zenflow::`` profiler range over ``steps`` steps."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run(steps)
    return {
        event.key: event.cpu_time_total / 1000 / steps
        for event in prof.key_averages()
        if event.key.startswith("zenflow::")
    }


# The parent: start the workers, drive them round robin, print the table.


class _Peer:
    def __init__(self, args, peer: str, rows: int, port: int, log_dir: str):
        self.peer = peer
        env = dict(os.environ)
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            OMP_NUM_THREADS=str(args.threads),
        )
        self.log_path = os.path.join(log_dir, f"{peer.replace(' ', '_')}_{rows}.log")
        self.log = open(self.log_path, "w")  # noqa: SIM115
        argv = [a for a in sys.argv[1:] if a]
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), *argv]
            + ["--worker", json.dumps(dict(peer=peer, rows=rows))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=env,
            text=True,
        )
        self.error: str | None = None
        self.times, self.step_times, self.losses = [], [], []
        self.block_medians: list[float] = []
        self.counters: dict = {}
        self.ranges: dict[str, float] = {}
        self.params = 0

    def receive(self) -> dict | None:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK) :])
            self.log.write(line)
        self.log.flush()
        with open(self.log_path) as f:
            lines = [line.strip() for line in f.readlines() if line.strip()]
        errors = [line for line in lines if "Error" in line or "Exception" in line]
        tail = (errors or lines or ["no output"])[-1]
        self.error = f"exited {self.proc.wait()}: {tail}"
        return None

    def wait_ready(self, timeout: float) -> None:
        # A worker that never answers (say, a DeepSpeed JIT build waiting on a stale lock in
        # ~/.cache/torch_extensions) is killed, and its row says so, instead of hanging the run.
        # The limit is generous: killing a worker in the middle of a JIT build leaves such a lock.
        timer = threading.Timer(timeout, self.proc.kill)
        timer.start()
        message = self.receive()
        timer.cancel()
        if message is not None:
            self.params = message["params"]
        elif self.proc.returncode in (-9, 137):
            self.error = f"no answer within {timeout:.0f}s of setup (killed)"

    def run(self, steps: int) -> None:
        if self.error:
            return
        try:
            self.proc.stdin.write(json.dumps(dict(steps=steps)) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass
        result = self.receive()
        if result is None:
            return
        self.times += result["times"]
        self.block_medians.append(statistics.median(result["times"]))
        self.step_times += result["step_times"]
        self.losses += result["losses"]
        for k, v in result["counters"].items():
            self.counters[k] = self.counters.get(k, 0) + v

    def profile_ranges(self, steps: int) -> None:
        if self.error:
            return
        self.proc.stdin.write(json.dumps(dict(ranges=steps)) + "\n")
        self.proc.stdin.flush()
        result = self.receive()
        if result is not None:
            self.ranges = result["ranges"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps(dict(quit=True)) + "\n")
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def _not_runnable(peer: str) -> str | None:
    if peer.startswith("ds ") and importlib.util.find_spec("deepspeed") is None:
        return "not runnable here: deepspeed is not installed"
    return None


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def _bytes_per_step(peer: str, p: _Peer, n: int) -> str:
    model_bytes = 4 * p.params
    if peer.startswith("zenflow"):
        moved = p.counters.get("d2h_bytes", 0) + p.counters.get("h2d_bytes", 0)
        return _fmt_bytes(moved / n)
    if peer == "ds zero-offload":
        return "~" + _fmt_bytes(2 * model_bytes)  # fp32 grads down, fp32 params up, every step
    if peer == "ds zenflow":
        # full fp32 gradient down every step, fp32 params up once per update_interval
        return "~" + _fmt_bytes(model_bytes * (1 + 1 / ZENFLOW["update_interval"]))
    return "0 B"


def _regime(args, name: str, rows: int, peers: list[str], log_dir: str, port: int) -> None:
    print(f"\n## {name}: batch {rows} rows", flush=True)
    started = time.perf_counter()
    running: list[_Peer] = []
    skipped: dict[str, str] = {}
    for i, peer in enumerate(peers):
        reason = _not_runnable(peer)
        if reason:
            skipped[peer] = reason
            continue
        running.append(_Peer(args, peer, rows, port + i, log_dir))
    deadline = time.perf_counter() + args.setup_timeout
    for p in running:  # they start, compile and warm up concurrently: nothing is timed yet
        p.wait_ready(max(1.0, deadline - time.perf_counter()))
    setup = time.perf_counter() - started
    blocks = args.steps // CYCLE
    for b in range(blocks):
        order = running if b % 2 == 0 else running[::-1]
        for p in order:
            p.run(CYCLE)
    if args.ranges:
        for p in running:
            if p.peer.startswith("zenflow"):
                p.profile_ranges(CYCLE)
    for p in running:
        p.close()

    by_name = {p.peer: p for p in running}
    ours = by_name.get("zenflow")
    ours_ok = ours is not None and not ours.error and ours.times
    ours_median = statistics.median(ours.times) if ours_ok else None
    ours_best = min(ours.block_medians) if ours_ok else None
    ours_mean = statistics.fmean(ours.times) if ours_ok else None
    header = (
        f"{'row':<20} {'median step':>11} {'mean step':>9} {'best block':>10} {'opt wait':>8} "
        f"{'step()':>7} {'bytes/step':>11} {'loss':>8} {'zenflow / row':>13} {'(means)':>8} "
        f"{'(best blocks)':>13}"
    )
    print(header)
    print("-" * len(header))
    for peer in peers:
        if peer in skipped:
            print(f"{peer:<20} {skipped[peer]}")
            continue
        p = by_name[peer]
        if p.error or not p.times:
            print(f"{peer:<20} not runnable here: {p.error} (log: {p.log_path})")
            continue
        median = statistics.median(p.times)
        total = sum(p.times)
        if peer.startswith("zenflow"):
            wait = f"{100 * p.counters.get('optimizer_wait_s', 0.0) / total:.0f}%"
        else:
            wait = f"{100 * sum(p.step_times) / total:.0f}%"
        step_share = f"{100 * sum(p.step_times) / total:.0f}%"
        loss = statistics.fmean(p.losses[-CYCLE:])
        best = min(p.block_medians)
        ratio = f"{ours_median / median:.2f}x" if ours_median else "n/a"
        best_ratio = f"{ours_best / best:.2f}x" if ours_best else "n/a"
        mean = statistics.fmean(p.times)
        mean_ratio = f"{ours_mean / mean:.2f}x" if ours_mean else "n/a"
        print(
            f"{peer:<20} {1000 * median:>9.1f}ms {1000 * mean:>7.1f}ms {1000 * best:>8.1f}ms "
            f"{wait:>8} {step_share:>7} {_bytes_per_step(peer, p, len(p.times)):>11} "
            f"{loss:>8.4f} {ratio:>13} {mean_ratio:>8} {best_ratio:>13}"
        )
    if ours and not ours.error:
        c = ours.counters
        print(
            f"zenflow stats over the timed steps: cpu_updates {c.get('cpu_updates', 0)}, "
            f"reselections {c.get('reselections', 0)}, cpu_adam_s {c.get('cpu_adam_s', 0):.3f}, "
            f"cpu_accumulate_s {c.get('cpu_accumulate_s', 0):.3f}, "
            f"optimizer_wait_s {c.get('optimizer_wait_s', 0):.3f}"
        )
    if ours_ok:
        print(f"zenflow {_by_cycle_position(ours)}")
    for p in running:
        if p.ranges:
            ranges = ", ".join(f"{k} {v:.2f}" for k, v in sorted(p.ranges.items()))
            print(f"{p.peer} host ms per step by profiler range ({CYCLE} profiled steps): {ranges}")
    print(f"({len(running)} processes, setup {setup:.0f}s, {args.steps} timed steps each)")


def _by_cycle_position(p: "_Peer") -> str:
    """Median whole step and ``step()`` at each position of the select cycle (the warm-up and
    every block are whole cycles, so step i of the timed ones is at position i % CYCLE): where
    a row's mean departs from its median."""
    cells = []
    for position in range(CYCLE):
        totals = p.times[position::CYCLE]
        in_step = p.step_times[position::CYCLE]
        cells.append(
            f"{position}: {1000 * statistics.median(totals):.1f}/"
            f"{1000 * statistics.median(in_step):.1f}"
        )
    return "ms by position in the select cycle (median step/step()): " + ", ".join(cells)


def main() -> None:
    args = _args()
    if args.worker:
        _worker(args)
        return
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        raise SystemExit(f"unknown peers {unknown}; known: {', '.join(PEERS)}")
    print("# bench_step: zenflow vs peers, one training step (fwd + bwd + optimizer)")
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {importlib.metadata.version('torch')}, "
        f"{args.threads} threads per process, python {platform.python_version()}"
    )
    w = args.width
    params = args.blocks * (8 * w * w + 5 * w) + (w + 1) * args.classes  # as build_model
    print(
        f"model: {args.blocks} residual MLP blocks of width {args.width} (x4 hidden) + head "
        f"{args.classes}: {params / 1e6:.1f}M fp32 parameters; lr {HYPER['lr']}, "
        f"topk {ZENFLOW['topk_ratio']}, update_interval {ZENFLOW['update_interval']}, "
        f"select_interval {ZENFLOW['select_interval']}; median of {args.steps} steps after "
        f"{CYCLE} warm-up steps"
    )
    print("opt wait: zenflow stats()['optimizer_wait_s'] / total; peers: step() / total")
    print("bytes/step: zenflow from stats(); '~' = analytic estimate for DeepSpeed")
    regimes = []
    if args.regime in ("optimizer-bound", "both"):
        regimes.append(("optimizer-bound", args.small_batch))
    if args.regime in ("compute-heavy", "both"):
        regimes.append(("compute-heavy", args.large_batch))
    port = 29500 + os.getpid() % 1000 * 20
    log_dir = tempfile.mkdtemp(prefix="bench_step_")
    print(f"worker logs: {log_dir}")
    for i, (name, rows) in enumerate(regimes):
        _regime(args, name, rows, peers, log_dir, port + 10 * i)


if __name__ == "__main__":
    # Each line reaches a pipe or a log file when printed, not at exit: rows of a long run.
    sys.stdout.reconfigure(line_buffering=True)
    main()
