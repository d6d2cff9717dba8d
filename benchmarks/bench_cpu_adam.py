"""zenflow's C++ CPU AdamW against DeepSpeedCPUAdam and torch.optim.AdamW, side by side.

    .venv/bin/python benchmarks/bench_cpu_adam.py [--sizes 10M,50M] [--threads 2] [--reps 5]
                                                  [--no-deepspeed] [--quick]

Two cases per size:
  adamw     one fp32 AdamW step (read p, g, m, v; write p, m, v: 28 bytes per element);
  boundary  ZenFlow's update boundary: acc += g_last (bf16); AdamW with acc / n; acc = 0;
            bf16 copy of p (36 bytes per element). zenflow does it in one fused pass; the peers
            in separate passes with their own ops (torch fused folds / n into its step).
Each round times every implementation once, in turn (after a short pause), so machine noise
hits all of them alike; the table shows the best and the median round. Gelem/s and GB/s = the
case's elements and bytes per element over the median time (the same bytes for every row, so
GB/s compares work done, not traffic). "vs best peer" = the best peer's median / this row's
median. Thread counts are pinned equal: torch.set_num_threads, OMP_NUM_THREADS (DeepSpeed's
kernels) and zenflow's pool (``CPUAdamW(threads=)``) all get --threads. "copy" is torch's copy_ of the same number of bytes.
"""

import argparse
import os
import platform
import statistics
import sys
import time
import warnings


def _parse_count(text: str) -> int:
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1].upper(), 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def _args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10M,50M", help="comma-separated element counts")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=7, help="timed rounds per case")
    parser.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeedCPUAdam")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 1M elements, 2 rounds, no DeepSpeed"
    )
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.reps, args.no_deepspeed = "1M", 2, True
    return args


ARGS = _args()
# DeepSpeed's kernel threads with OpenMP: fix its thread count before anything loads libgomp.
os.environ.setdefault("OMP_NUM_THREADS", str(ARGS.threads))

import torch  # noqa: E402

from zenflow.cpu_adamw import CPUAdamW  # noqa: E402
from zenflow.runtime import cpu_adam  # noqa: E402

HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
N_ACCUMULATED = 4
SETTLE_S = 0.02


def _deepspeed_adam():
    if ARGS.no_deepspeed:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            DeepSpeedCPUAdam([torch.zeros(1, requires_grad=True)])  # JIT-builds on first use
        return DeepSpeedCPUAdam
    except Exception as e:  # a missing compiler or an old DeepSpeed: leave it out, say why
        print(f"DeepSpeedCPUAdam unavailable ({type(e).__name__}: {e})", file=sys.stderr)
        return None


def _param(numel):
    p = torch.randn(numel).requires_grad_()
    p.grad = torch.randn(numel) * 1e-2
    return p


def adamw_case(numel, ds_adam):
    """name -> callable doing one fp32 AdamW step, each on its own parameter and state."""
    cases = {}
    p = _param(numel)
    opt = CPUAdamW([p], **HYPER, threads=ARGS.threads)
    cases["zenflow.CPUAdamW"] = opt.step
    if ds_adam is not None:
        p = _param(numel)
        cases["DeepSpeedCPUAdam"] = ds_adam([p], adamw_mode=True, **HYPER).step
    for kind in ("fused", "foreach"):
        p = _param(numel)
        cases[f"torch AdamW {kind}"] = torch.optim.AdamW([p], **{kind: True}, **HYPER).step
    return cases, 28


def boundary_case(numel, ds_adam):
    """name -> callable doing one ZenFlow boundary: acc += g_last; AdamW(acc / n); acc = 0;
    out = bf16(p)."""
    cases = {}
    last_grad = (torch.randn(numel) * 1e-2).to(torch.bfloat16)
    hyper = dict(HYPER)
    beta1, beta2 = hyper.pop("betas")

    def buffers():
        p = torch.randn(numel).requires_grad_()
        acc = torch.randn(numel) * 1e-2
        return p, acc, torch.empty(numel, dtype=torch.bfloat16)

    p, acc, out = buffers()
    m, v = torch.zeros(numel), torch.zeros(numel)

    def fused():
        cpu_adam.boundary_adamw_step(
            [p.detach()], [acc], [last_grad], [m], [v], n=N_ACCUMULATED,
            beta1=beta1, beta2=beta2, steps=5, out=[out], **hyper,
        )  # fmt: skip

    cases["zenflow fused boundary"] = fused

    def multi_pass(opt, p, acc, out, scale_in_step=False):
        def run():
            acc.add_(last_grad)
            if not scale_in_step:
                acc.div_(N_ACCUMULATED)
            p.grad = acc
            opt.step()
            out.copy_(p.detach())
            acc.zero_()

        return run

    p, acc, out = buffers()
    opt = CPUAdamW([p], **HYPER, threads=ARGS.threads)
    cases["zenflow CPUAdamW, 4 passes"] = multi_pass(opt, p, acc, out)
    if ds_adam is not None:
        p, acc, out = buffers()
        opt = ds_adam([p], adamw_mode=True, **HYPER)
        cases["DeepSpeedCPUAdam, 5 passes"] = multi_pass(opt, p, acc, out)
    p, acc, out = buffers()
    opt = torch.optim.AdamW([p], fused=True, **HYPER)
    opt.grad_scale = torch.tensor(float(N_ACCUMULATED))  # fused AdamW divides by it in-pass
    cases["torch AdamW fused, 4 passes"] = multi_pass(opt, p, acc, out, scale_in_step=True)
    p, acc, out = buffers()
    opt = torch.optim.AdamW([p], foreach=True, **HYPER)
    cases["torch AdamW foreach, 5 passes"] = multi_pass(opt, p, acc, out)
    return cases, 36


def measure(cases, reps):
    for fn in cases.values():  # state allocation, first-touch page faults
        fn()
        fn()
    times = {name: [] for name in cases}
    for _ in range(reps):
        for name, fn in cases.items():
            # torch's and DeepSpeed's OpenMP threads spin for a while after each op; the pause
            # lets them sleep, so that no implementation pays for its predecessor's spinning.
            time.sleep(SETTLE_S)
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def copy_case(numel, bytes_per_elem):
    floats = numel * bytes_per_elem // 8  # read and write half the bytes each
    src, dst = torch.randn(floats), torch.empty(floats)
    return lambda: dst.copy_(src)


def table(title, numel, bytes_per_elem, times):
    best = {name: min(t) for name, t in times.items()}
    median = {name: statistics.median(t) for name, t in times.items()}
    peers = [m for name, m in median.items() if not name.startswith(("zenflow", "copy"))]
    best_peer = min(peers) if peers else float("nan")
    header = f"| {'implementation':<32} | best ms | median ms | Gelem/s |  GB/s | vs best peer |"
    lines = [f"{title}, {numel / 1e6:g}M elements, {bytes_per_elem} B/element", "", header]
    lines.append("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for name in times:
        b = best[name]
        lines.append(
            f"| {name:<32} | {b * 1e3:7.2f} | {median[name] * 1e3:9.2f} "
            f"| {numel / median[name] / 1e9:7.3f} | {numel * bytes_per_elem / median[name] / 1e9:5.1f} "
            f"| {best_peer / median[name]:11.2f}x |"
        )
    return "\n".join(lines)


def main():
    torch.set_num_threads(ARGS.threads)
    cpu_adam.set_num_threads(ARGS.threads)
    ds_adam = _deepspeed_adam()
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    print(
        f"{cpu}; {ARGS.threads} threads; zenflow ISA {cpu_adam.isa()}; torch {torch.__version__}"
        f" (CPU capability {torch.backends.cpu.get_cpu_capability()}); "
        f"deepspeed {'absent' if ds_adam is None else __import__('deepspeed').__version__}"
    )
    print(f"command: {' '.join([os.path.basename(sys.executable)] + sys.argv)}\n")
    for numel in (_parse_count(s) for s in ARGS.sizes.split(",")):
        for title, build in (("fp32 AdamW step", adamw_case), ("ZenFlow boundary", boundary_case)):
            cases, bytes_per_elem = build(numel, ds_adam)
            cases["copy (same bytes)"] = copy_case(numel, bytes_per_elem)
            times = measure(cases, ARGS.reps)
            print(table(title, numel, bytes_per_elem, times), "\n", flush=True)
            del cases


if __name__ == "__main__":
    # Each line reaches a pipe or a log file when printed, not at exit: rows of a long run.
    sys.stdout.reconfigure(line_buffering=True)
    main()
