"""Does the CPU pool's pass slow the training thread? Its cost per operation beside the pass.

    .venv/bin/python benchmarks/bench_contention.py [--device auto] [--mb 256] [--ops 4000]
        [--reserved 0.5[,0.875...]] [--quick]

On a GPU machine the training thread spends a step launching kernels with Python between them:
its speed is the speed of the core it runs on. An overlapped window's CPU update is a pass over
the optimizer state at the host's memory bandwidth, on the pool's threads, beside it. This
times on the training thread a tiny operation on the device, dispatched ``--ops`` times (the
host's time per launch; the device's work is nothing), and a plain Python loop, three ways:
with the pool idle; and for each share of the cores kept from the pool (``--reserved``,
``pt_reserved_cores_perc``) with the pool running AdamW passes back to back over ``--mb`` MiB of
fp32 parameters (and as much again of gradients and of each moment), its workers pinned as
``bind_cores`` pins them (the physical cores the share leaves the pool,
``zenflow.runtime.core_binding``), and unpinned. The pool runs at the niceness and thread count
an optimizer gives its overlapped updates. Per way: microseconds per
operation and per loop step (medians of five rounds), and the pool's rate over the passes of
all five (GB/s of state read and written, by arithmetic: 16 bytes read and 12 written per
parameter). Where pinning cannot split the cores (one core, or none allowed), it says so and
times the other two.
"""

import argparse
import json
import math
import statistics
import sys
import time

import torch

from zenflow.runtime import core_binding, cpu_adam
from zenflow.runtime.cpu_jobs import BACKGROUND_NICE, CPUJobs

ROUNDS = 5
BYTES_PER_PARAMETER = 28  # read: parameter, gradient, two moments; written: all but the gradient


def _args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--mb", type=int, default=None, help="MiB of fp32 parameters (256)")
    parser.add_argument("--ops", type=int, default=None, help="operations per round (4000)")
    parser.add_argument(
        "--reserved",
        default="0.5",
        help="pt_reserved_cores_perc, or several comma-separated (0.5, the default)",
    )
    parser.add_argument("--quick", action="store_true", help="8 MiB, 400 operations (smoke)")
    args = parser.parse_args(argv)
    args.mb = args.mb or (8 if args.quick else 256)
    args.ops = args.ops or (400 if args.quick else 4000)
    args.reserved = [float(share) for share in args.reserved.split(",")]
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


class _Passes:
    """AdamW passes over one buffer of state kept queued on the pool while a way is timed, the
    time one pass takes with the pool as it is set now (``time_one``), and the rate of the
    passes that ran since the last ``rate``."""

    def __init__(self, mb: int):
        n = mb * 2**20 // 4
        self.parameters = n
        self.state = [torch.zeros(n) for _ in range(4)]
        self.handles: list[cpu_adam.CPUAdamHandle] = []
        self._done: list[float] = []  # seconds of each pass finished since the last rate()

    def submit(self, count: int) -> None:
        params, grads, exp_avgs, exp_avg_sqs = ([t] for t in self.state)
        for _ in range(count):
            self.handles.append(
                cpu_adam.submit_adamw_step(
                    params, grads, exp_avgs, exp_avg_sqs,
                    lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, steps=1,
                )
            )  # fmt: skip

    def finish(self) -> None:
        """Wait for every pass queued."""
        for handle in self.handles:
            handle.wait()
            self._done.append(handle.seconds())
        self.handles = []

    def time_one(self) -> float:
        """Seconds of one pass (the pool's threads started and the state's pages touched by
        one before it)."""
        self.submit(2)
        self.finish()
        seconds = self._done[-1]
        self._done = []
        return seconds

    def rate(self) -> float:
        """GB/s of the passes finished since the last call."""
        done, self._done = self._done, []
        return len(done) * self.parameters * BYTES_PER_PARAMETER / sum(done) / 1e9


def _launches_us(x: torch.Tensor, ops: int) -> float:
    started = time.perf_counter()
    for _ in range(ops):
        x.add_(1.0)
    elapsed = time.perf_counter() - started
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)
    return elapsed / ops * 1e6


def _python_us(steps: int) -> float:
    table: dict[int, int] = {}
    started = time.perf_counter()
    for i in range(steps):
        table[i & 255] = table.get(i & 255, 0) + i
    return (time.perf_counter() - started) / steps * 1e6


def _way(name: str, x: torch.Tensor, ops: int, passes: _Passes | None) -> dict:
    launches, python = [], []
    # Enough passes queued to outlast each round (at up to 40 us per launch, four times over).
    queued = 0 if passes is None else max(2, math.ceil(4 * ops * 40e-6 / passes.time_one()))
    for _ in range(ROUNDS):
        if passes is not None:
            passes.submit(queued)
        launches.append(_launches_us(x, ops))
        python.append(_python_us(ops * 10))
        if passes is not None:
            passes.finish()
    rate = passes.rate() if passes is not None else None
    row = dict(
        way=name,
        launch_us=statistics.median(launches),
        python_us=statistics.median(python),
        pool_gb_s=rate,
    )
    pool = f"{rate:.1f} GB/s" if rate is not None else "idle"
    print(f"{name:28s}{row['launch_us']:15.2f}{row['python_us']:15.3f}{pool:>12s}", flush=True)
    return row


def main(argv=None) -> None:
    args = _args(argv)
    device = torch.device(args.device)
    x = torch.zeros(1, device=device)
    allowed = core_binding.allowed_cpus()
    print("# bench_contention: the training thread's cost per operation beside the CPU pool")
    print(
        f"device {device}; {len(allowed)} CPUs allowed, physical cores "
        f"{core_binding.physical_cores(allowed)}; the pool at niceness {BACKGROUND_NICE}; "
        f"{args.mb} MiB of fp32 parameters per pass; pt_reserved_cores_perc {args.reserved}"
    )
    passes = _Passes(args.mb)
    _launches_us(x, args.ops)  # warm: the kernel loaded, the allocator's block cached
    header = f"{'way':28s}{'us per launch':>15s}{'us per Python':>15s}{'pool':>12s}"
    print(header + "\n" + "-" * len(header))
    rows = [_way("pool idle", x, args.ops, None)]
    for share in args.reserved:
        # The pool as an optimizer sets it for its overlapped updates, pinned and not.
        pinned, unpinned = (
            CPUJobs(core_binding.place_pool(share, bind), {}) for bind in (True, False)
        )
        ways = [unpinned]
        if pinned.place.cpus is not None:
            ways.insert(0, pinned)
        else:
            print(f"({share}: pinning cannot split these cores, no pinned row)")
        for jobs in ways:
            jobs.background()
            place = jobs.place
            name = f"{share} {'pinned' if place.cpus else 'unpinned'}, threads {place.threads}"
            row = _way(name, x, args.ops, passes)
            rows.append(dict(row, share=share, threads=place.threads, cpus=list(place.cpus or ())))
    cpu_adam.set_worker_cpus(None)
    print(json.dumps(dict(device=str(device), rows=rows)))


if __name__ == "__main__":
    # Each line reaches a pipe or a log file when printed, not at exit: rows of a long run.
    sys.stdout.reconfigure(line_buffering=True)
    main()
