"""What the zenflow backend adds to a compiled backward, and what the optimizer step costs.

    .venv/bin/python benchmarks/bench_compile_overhead.py [--quick] [--iters 40]
        [--vocab 4096] [--width 256] [--layers 2] [--heads 4] [--seq 128] [--batch 4]
    .venv/bin/python benchmarks/bench_compile_overhead.py --hand-over-only [--device cuda]

A GPT-style model (token + position embeddings, pre-LN blocks with
F.scaled_dot_product_attention, LM head tied to the token embedding) is compiled twice, in one
process: with backend "inductor", and with backend "zenflow" plus a ZenFlowAdamW (step_backend
"eager") that owns its weights, so the zenflow backward hands each weight's gradient to the
runtime, which forms its rows straight into its host blocks, in natural order (or, for a
batch far smaller than the weight, keeps the gradient's two factors and leaves the product to
``step()``: try ``--batch 1 --seq 32``). Per-column importance is taken in ``step()`` from the
staged rows, so select steps and update_interval "auto" run the same backward. A third model,
compiled with Inductor as well, is the control. Forward passes are not timed; each iteration
runs one backward pass of each model on the same batch, in an order that rotates (noise hits
all alike), and ``opt.zero_grad()`` (zenflow) / ``model.zero_grad()`` (inductor) discards the
gradients between passes. Table 1: median backward time, median minor page faults per
backward (Inductor's gradients are allocated anew each pass; past a size the allocator maps
fresh pages for them, while zenflow stages into host blocks it keeps), and the ratio as the
median over iterations of each pass divided by the Inductor pass of the same iteration (this
shared VM's speed drifts by more than the difference measured, over seconds), for zenflow
before the first selection (k = 0: every column goes to the host, in its natural order) and
after it (k = 10 % of each weight's columns stay), and for the control, whose ratio is what
the method reads between two identical backends.

Table 2: the zenflow optimizer's ``step()`` (topk 0.1, update_interval 4, select_interval 8,
overlap_step) over select cycles after a first warm-up cycle, by kind of step: ordinary (device
update + host accumulate); update (overlapped): the window closes, the previous window's CPU
AdamW is waited for and applied and this one's is submitted to run in the background; select
boundary: the same, then stats()["reselections"] changes: top-k is chosen from the step's
importance, the entering columns take the window's update on the device and per-column state
migrates between host and device.

Table 3: the host time zenflow adds per weight to a backward pass, where compute is negligible
(24 linear layers 64x64, 64 rows, after a selection; zenflow with inner "eager" against
aot_eager, alternating, medians): the op's dispatch and the runtime's bookkeeping per weight,
the cost that makes a GPU's backward host-bound when it is large against the kernels.
``--hand-over-only`` measures this table alone, on ``--device`` (on a GPU the gradients take the
copy stream to pinned host buffers; host time, the launch queue drained before each pass).
"""

import argparse
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

import zenflow

# The model users run: examples/gpt_model.py (pre-LN blocks, SDPA attention, tied LM head).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from gpt_model import GPT, GPTConfig  # noqa: E402

SETTINGS = dict(topk_ratio=0.1, update_interval=4, select_interval=8, overlap_step=True)


def _args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, no Inductor (smoke)")
    parser.add_argument("--iters", type=int, default=None, help="timed backward passes (150)")
    parser.add_argument("--cycles", type=int, default=None, help="select cycles stepped (4)")
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument(
        "--inner",
        choices=("inductor", "eager"),
        default=None,
        help="inductor (default) compares zenflow+Inductor with Inductor; eager compares "
        'zenflow options={"inner": "eager"} with aot_eager (no Inductor; --quick)',
    )
    parser.add_argument(
        "--hand-over-only", action="store_true", help="only the host time added per weight"
    )
    parser.add_argument("--device", default="cpu", help="for --hand-over-only: cpu or cuda")
    args = parser.parse_args(argv)
    quick = dict(
        iters=5, cycles=2, vocab=64, width=32, layers=1, heads=2, seq=16, batch=2, inner="eager"
    )
    full = dict(iters=150, cycles=4, vocab=4096, width=256, layers=2, heads=4, seq=128, batch=4)
    full["inner"] = "inductor"
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def _model(args) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=args.vocab,
        block_size=args.seq,
        n_layer=args.layers,
        n_head=args.heads,
        n_embd=args.width,
    )
    return GPT(config)


def _batch(args, step: int):
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def _timed_backward(model, batch, faults: list[int] | None = None) -> float:
    """Seconds of ``loss.backward()``; appends to ``faults`` the minor page faults it took (a
    fresh allocation's first touch of each page: gradients allocated anew every pass)."""
    _, loss = model(*batch)
    faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    started = time.perf_counter()
    loss.backward()
    elapsed = time.perf_counter() - started
    if faults is not None:
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before)
    return elapsed


def _warm_up_compilation(backend: str) -> None:
    """Compile and run a throwaway model first: the first compile in a process also pays
    torch.compile's one-time setup (imports, CPU ISA probes, pattern tables, ~3 s here), which
    would otherwise land on whichever of the two measured compiles runs first."""
    model = torch.nn.Linear(4, 4)
    torch.compile(model, backend=backend)(torch.randn(2, 4)).sum().backward()


def main() -> None:
    args = _args()
    print("# bench_compile_overhead: zenflow backend vs Inductor, backward and optimizer step")
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, python {platform.python_version()}"
    )
    if args.hand_over_only:
        _hand_over_cost(args, torch.device(args.device))
        return
    zf_model, ref_model, control_model = _model(args), _model(args), _model(args)
    params = sum(p.numel() for p in zf_model.parameters())
    print(
        f"model: GPT, vocab {args.vocab}, width {args.width}, {args.layers} layers, "
        f"{args.heads} heads, seq {args.seq}, batch {args.batch}: {params / 1e6:.2f}M parameters "
        f"(LM head tied)"
    )
    if args.inner == "inductor":
        zf_compiled = torch.compile(zf_model, backend="zenflow")
        ref_compiled = torch.compile(ref_model, backend="inductor")
        control_compiled = torch.compile(control_model, backend="inductor")
        names = ("zenflow", "inductor")
    else:
        zf_compiled = torch.compile(zf_model, backend="zenflow", options={"inner": "eager"})
        ref_compiled = torch.compile(ref_model, backend="aot_eager")
        control_compiled = torch.compile(control_model, backend="aot_eager")
        names = ("zenflow (inner eager)", "aot_eager")
    opt = zenflow.ZenFlowAdamW(zf_model.parameters(), lr=1e-4, step_backend="eager", **SETTINGS)

    _warm_up_compilation(names[1])
    started = time.perf_counter()
    for i in range(2):  # compile, then one more for any recompilation
        _timed_backward(zf_compiled, _batch(args, i))
        opt.zero_grad()
    zf_compile = time.perf_counter() - started
    started = time.perf_counter()
    for i in range(2):
        _timed_backward(ref_compiled, _batch(args, i))
        ref_model.zero_grad(set_to_none=True)
    ref_compile = time.perf_counter() - started
    for i in range(2):
        _timed_backward(control_compiled, _batch(args, i))
        control_model.zero_grad(set_to_none=True)

    def interleaved(first_batch: int) -> list[tuple[list[float], list[int]]]:
        """Backward times and page faults of zenflow, Inductor and a second Inductor model (the
        control: what this method reads between two identical backends), each pass's position
        in the iteration rotating."""
        runs = [
            (zf_compiled, opt.zero_grad),  # discards the staged gradient: nothing is stepped
            (ref_compiled, lambda: ref_model.zero_grad(set_to_none=True)),
            (control_compiled, lambda: control_model.zero_grad(set_to_none=True)),
        ]
        measured = {model: ([], []) for model, _ in runs}
        for i in range(args.iters):
            batch = _batch(args, first_batch + i)
            for model, discard in runs[i % 3 :] + runs[: i % 3]:
                times, faults = measured[model]
                times.append(_timed_backward(model, batch, faults))
                discard()
        return [measured[model] for model, _ in runs]

    before_selection = interleaved(0)

    # The optimizer step, by kind, over whole select cycles; backward with k > 0 as well.
    kinds: dict[str, list[float]] = {
        "ordinary": [],
        "update (overlapped)": [],
        "select boundary": [],
    }
    selected_backward = []
    cycle = SETTINGS["select_interval"]
    for i in range(args.cycles * cycle):
        batch = _batch(args, 100 + i)
        selected_backward.append(_timed_backward(zf_compiled, batch))
        reselections = opt.stats()["reselections"]
        started = time.perf_counter()
        opt.step()
        elapsed = time.perf_counter() - started
        opt.zero_grad()
        if i < cycle and args.cycles > 1:
            continue  # the first cycle warms up (first selection, variants, allocations)
        if opt.stats()["reselections"] != reselections:
            kinds["select boundary"].append(elapsed)
        elif (i + 1) % SETTINGS["update_interval"] == 0:
            kinds["update (overlapped)"].append(elapsed)
        else:
            kinds["ordinary"].append(elapsed)
    stats = opt.stats()
    after_selection = interleaved(1000)

    print(f"\n## backward, median of {args.iters}, interleaved with {names[1]}")
    (zf_k0, zf_k0_faults), (ref_k0, ref_k0_faults), (control_k0, control_k0_faults) = (
        before_selection
    )
    (zf_k, zf_k_faults), (ref_k, ref_k_faults), (control_k, control_k_faults) = after_selection
    ref, ref_faults = ref_k0 + ref_k, ref_k0_faults + ref_k_faults
    rows = (
        (
            f"{names[0]}, k = 0 (no selection yet)",
            zf_k0,
            zf_k0_faults,
            ref_k0,
            f"{zf_compile:.1f}s",
        ),
        (
            f"{names[0]}, k = {stats['selected_fraction']:.0%} selected",
            zf_k,
            zf_k_faults,
            ref_k,
            "",
        ),
        (
            f"{names[1]}, a second model (control)",
            control_k0 + control_k,
            control_k0_faults + control_k_faults,
            ref,
            "",
        ),
        (names[1], ref, ref_faults, ref, f"{ref_compile:.1f}s"),
    )
    w = max(len(row[0]) for row in rows)
    header = (
        f"{'backend':<{w}} {'backward':>10} {'min':>10} {'page faults':>12} {'first 2 iters':>14} "
        f"{'ratio':>7}"
    )
    print(header)
    print("-" * len(header))
    for name, times, faults, ref_times, first in rows:
        ratio = statistics.median(t / r for t, r in zip(times, ref_times, strict=True))
        print(
            f"{name:<{w}} {1000 * statistics.median(times):>8.2f}ms "
            f"{1000 * min(times):>8.2f}ms {statistics.median(faults):>12.0f} {first:>14} "
            f"{ratio:>6.2f}x"
        )
    print(
        f"(ratio: median over iterations of a pass / the {names[1]} pass of the same iteration; "
        "the control reads what this method reads between two identical backends; page faults: "
        "median minor faults per backward, a fresh allocation's first touch of its pages)"
    )
    print(
        f"\n## ZenFlowAdamW.step() (step_backend eager, topk {SETTINGS['topk_ratio']}, "
        f"update_interval {SETTINGS['update_interval']}, select_interval "
        f"{SETTINGS['select_interval']}, overlap_step), {args.cycles} select cycles"
    )
    header = f"{'step kind':<24} {'count':>5} {'median':>10} {'max':>10} {'vs ordinary':>12}"
    print(header)
    print("-" * len(header))
    ordinary = statistics.median(kinds["ordinary"])
    for kind, times in kinds.items():
        if not times:
            print(f"{kind:<24} {0:>5} {'n/a':>10}")
            continue
        median = statistics.median(times)
        print(
            f"{kind:<24} {len(times):>5} {1000 * median:>8.2f}ms {1000 * max(times):>8.2f}ms "
            f"{median / ordinary:>11.2f}x"
        )
    # Importance is taken in step() from the staged rows (the same read that gives the norm).
    print("select steps, update_interval auto: same backward as above (importance in step())")
    print(
        f"stats: reselections {stats['reselections']}, cpu_updates {stats['cpu_updates']}, "
        f"optimizer_wait_s {stats['optimizer_wait_s']:.3f}, cpu_adam_s {stats['cpu_adam_s']:.3f}"
    )
    opt.flush()
    _hand_over_cost(args, torch.device("cpu"))


def _hand_over_cost(args, device: torch.device, layers: int = 24, width: int = 64) -> None:
    iters = 50 if args.quick else 300
    torch.manual_seed(0)

    def stack() -> torch.nn.Sequential:
        layer = [torch.nn.Linear(width, width, device=device) for _ in range(layers)]
        return torch.nn.Sequential(*layer)

    zf_model, ref_model = stack(), stack()
    opt = zenflow.ZenFlowAdamW(zf_model.parameters(), lr=1e-4, step_backend="eager", **SETTINGS)
    zf = torch.compile(zf_model, backend="zenflow", options={"inner": "eager"})
    ref = torch.compile(ref_model, backend="aot_eager")
    x = torch.randn(64, width, device=device)

    def backward(model) -> float:
        loss = model(x).square().mean()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        loss.backward()
        return time.perf_counter() - started

    for _ in range(2 * SETTINGS["select_interval"]):  # compile, select, settle
        backward(zf)
        opt.step()
        opt.zero_grad()
        backward(ref)
    zf_times, ref_times = [], []
    for _ in range(iters):
        zf_times.append(backward(zf))
        opt.zero_grad()
        ref_times.append(backward(ref))
        ref_model.zero_grad(set_to_none=True)
    added = statistics.median(zf_times) - statistics.median(ref_times)
    print(
        f"\n## host time added per weight ({layers} linear layers {width}x{width}, {x.shape[0]} "
        f"rows, {device.type}, median of {iters} backward passes): {1e6 * added / layers:.0f} us "
        f"(zenflow inner eager {1e3 * statistics.median(zf_times):.2f} ms, aot_eager "
        f"{1e3 * statistics.median(ref_times):.2f} ms)"
    )


if __name__ == "__main__":
    # Each line reaches a pipe or a log file when printed, not at exit: rows of a long run.
    sys.stdout.reconfigure(line_buffering=True)
    main()
