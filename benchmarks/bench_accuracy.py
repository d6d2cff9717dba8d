"""What ZenFlow's split costs in loss: AdamW, zenflow and DeepSpeed's ZenFlow, side by side.

    .venv/bin/python benchmarks/bench_accuracy.py [--quick] [--tasks fine-tune,char-lm,classify]
        [--peers zenflow,ds-zenflow] [--out-dir runs]

Three tasks, each trained for a fixed number of steps from the same weights on the same batches
by every row, then scored by its mean loss on held-out batches:

* ``fine-tune``: the main job's (examples/finetune_gpt.py: its model, its cached pre-training
  on stdlib code, fine-tuning on pydoc's prose topics, its hyperparameters);
* ``char-lm``: a small byte-level GPT trained from scratch on the docstrings of the
  interpreter's built-in (C) modules, text the main job does not use;
* ``classify``: which of four stdlib packages a 64-byte snippet of source comes from, a
  classification head fine-tuned with a small GPT pre-trained on stdlib code.

Rows: ``adamw`` (torch.optim.AdamW, the reference), and for every point of the grid (topk_ratio
0.1 / 0.2, update_interval 2 / 4 / 8, overlap_step off / on; select_interval 16, steps
counted; no warm-up) ``zenflow`` (ZenFlowAdamW on the eager model) and ``ds-zenflow``
(DeepSpeed's ZeRO stage 2 with CPU offload and its ``zenflow`` block, one worker process per
task beside this one: it needs torch.distributed). Every run clips the gradient norm at 1.0. A zenflow run is flushed
before it is scored; DeepSpeed's ZenFlow has no flush: its pending overlapped update is not
applied (what a user evaluating it sees).

Prints, per task, each row's held-out loss as a ratio to AdamW's, and writes the numbers to
``runs/bench_accuracy.json`` and a plot of the ratios to ``runs/bench_accuracy.png``. The default
grid took 23 minutes on a 2-core CPU (steps: fine-tune 100, char-lm 200, classify 120);
``--quick`` (tiny models, 12 steps, one grid point) under a minute.
"""

import argparse
import importlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
import finetune_gpt as demo  # noqa: E402
from gpt_model import GPT, GPTConfig  # noqa: E402
from text_data import BatchSampler, topics_prose_bytes, train_val_split  # noqa: E402

SELECT_INTERVAL = 16
CLIP = 1.0
GRID = [
    dict(topk_ratio=topk, update_interval=interval, overlap_step=overlap)
    for topk, interval, overlap in itertools.product((0.1, 0.2), (2, 4, 8), (False, True))
]
QUICK_GRID = [dict(topk_ratio=0.1, update_interval=4, overlap_step=True)]
PEERS = ("zenflow", "ds-zenflow")
CLASSIFY_PACKAGES = ("asyncio", "email", "unittest", "xml")


class LanguageModel(nn.Module):
    """A GPT whose forward returns the loss (what DeepSpeed's engine expects)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.gpt = GPT(config)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.gpt(x, y)[1]

    def param_groups(self, weight_decay: float) -> list[dict]:
        return self.gpt.param_groups(weight_decay)


class SnippetClassifier(nn.Module):
    """A GPT's mean final hidden state, then a linear head over the classes."""

    def __init__(self, config: GPTConfig, classes: int):
        super().__init__()
        self.gpt = GPT(config)
        self.head = nn.Linear(config.n_embd, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        gpt = self.gpt
        h = gpt.wte(x) + gpt.wpe(torch.arange(x.shape[1]))
        for block in gpt.blocks:
            h = block(h)
        return F.cross_entropy(self.head(gpt.ln_f(h).mean(1)), y)

    def param_groups(self, weight_decay: float) -> list[dict]:
        groups = self.gpt.param_groups(weight_decay)
        groups[0]["params"].append(self.head.weight)
        groups[1]["params"].append(self.head.bias)
        return groups


@dataclass
class Task:
    """One task: how to build its model (the same initial weights on every call), its training
    batches (the same sequence on every call), its held-out batches and its hyperparameters."""

    name: str
    steps: int
    lr: float
    betas: tuple[float, float]
    weight_decay: float
    batch_size: int
    build: object  # () -> nn.Module with forward(x, y) -> loss and param_groups(weight_decay)
    batches: object  # () -> iterator of (x, y)
    held_out: list


def _lm_batches(tokens, block_size, batch_size, seed):
    def batches():
        sampler = BatchSampler(tokens, block_size, batch_size, seed=seed)
        while True:
            yield sampler.next_batch()

    return batches


def _held_out_lm(tokens, block_size, batch_size, count, seed):
    sampler = BatchSampler(tokens, block_size, batch_size, seed=seed)
    return [sampler.next_batch() for _ in range(count)]


def finetune_task(quick: bool) -> Task:
    """The main job's fine-tuning (its default sizes, or --quick's)."""
    args = demo.parse_args(["--quick"] if quick else [])
    weights = demo.pretrained_weights(args)
    config = demo.model_config(args)
    train, val = train_val_split(topics_prose_bytes())
    hyper = json.loads(demo.RUNS["adamw"].read_text())["optimizer"]["params"]

    def build():
        torch.manual_seed(args.seed)
        model = LanguageModel(config)
        model.gpt.load_state_dict(weights)
        return model

    return Task(
        name="fine-tune",
        steps=12 if quick else 100,
        lr=hyper["lr"],
        betas=tuple(hyper["betas"]),
        weight_decay=hyper["weight_decay"],
        batch_size=args.batch_size,
        build=build,
        batches=_lm_batches(train, args.block_size, args.batch_size, args.seed + 1),
        held_out=_held_out_lm(val, args.block_size, 8, 4 if quick else 32, args.seed),
    )


def builtin_docstrings_bytes() -> bytes:
    """The docstrings of the interpreter's built-in (C) modules and of their functions and
    classes, in sorted order: prose that neither stdlib sources nor pydoc's topics contain."""
    chunks = []
    for name in sorted(sys.builtin_module_names):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        chunks.append(module.__doc__ or "")
        for attribute in sorted(dir(module)):
            member = getattr(module, attribute, None)
            own = getattr(member, "__module__", name) == name
            doc = getattr(member, "__doc__", None)
            if own and callable(member) and isinstance(doc, str):
                chunks.append(doc)
    return "\n\n".join(chunk for chunk in dict.fromkeys(chunks) if chunk).encode("utf-8")


def char_lm_task(quick: bool) -> Task:
    config = GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=32)
    if not quick:
        config = GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=128)
    train, val = train_val_split(builtin_docstrings_bytes())

    def build():
        torch.manual_seed(0)
        return LanguageModel(config)

    return Task(
        name="char-lm",
        steps=12 if quick else 200,
        lr=2e-3,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        batch_size=16,
        build=build,
        batches=_lm_batches(train, config.block_size, 16, seed=1),
        held_out=_held_out_lm(val, config.block_size, 16, 4 if quick else 32, seed=2),
    )


def _package_snippets() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per package: (training tokens, held-out tokens), its sources' head and tail."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for package in CLASSIFY_PACKAGES:
        paths = sorted((root / package).rglob("*.py"))
        data = b"\n".join(p.read_bytes() for p in paths if "test" not in p.parts)
        out.append(train_val_split(data[:400_000]))
    return out


def _classify_batches(parts, block_size, batch_size, seed):
    generator = torch.Generator().manual_seed(seed)
    offsets = torch.arange(block_size)
    while True:
        labels = torch.randint(len(parts), (batch_size,), generator=generator)
        rows = []
        for label in labels.tolist():
            tokens = parts[label]
            start = torch.randint(len(tokens) - block_size, (1,), generator=generator)
            rows.append(tokens[start + offsets])
        yield torch.stack(rows), labels


def classify_task(quick: bool) -> Task:
    flags = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--pretrain-steps", "20"]
    if not quick:
        flags = ["--n-layer", "2", "--n-head", "4", "--n-embd", "128", "--pretrain-steps", "200"]
    args = demo.parse_args([*flags, "--block-size", "64", "--pretrain-batch-size", "16"])
    weights = demo.pretrained_weights(args)
    config = demo.model_config(args)
    parts = _package_snippets()
    train = [t for t, _ in parts]
    val = [v for _, v in parts]
    held_out_stream = _classify_batches(val, args.block_size, 16, seed=2)

    def build():
        torch.manual_seed(0)
        model = SnippetClassifier(config, len(CLASSIFY_PACKAGES))
        model.gpt.load_state_dict(weights)
        return model

    return Task(
        name="classify",
        steps=12 if quick else 120,
        lr=5e-4,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        batch_size=16,
        build=build,
        batches=lambda: _classify_batches(train, args.block_size, 16, seed=1),
        held_out=[next(held_out_stream) for _ in range(4 if quick else 32)],
    )


TASKS = {"fine-tune": finetune_task, "char-lm": char_lm_task, "classify": classify_task}


@torch.no_grad()
def held_out_loss(model: nn.Module, task: Task) -> float:
    model.eval()
    loss = statistics.fmean(model(x, y).item() for x, y in task.held_out)
    model.train()
    return loss


def train_torch(task: Task, settings: dict | None) -> dict:
    """AdamW (``settings`` None) or ZenFlowAdamW with ``settings``, on the eager model."""
    from zenflow import ZenFlowAdamW

    model = task.build()
    hyper = dict(lr=task.lr, betas=task.betas, eps=1e-8)
    groups = model.param_groups(task.weight_decay)
    if settings is None:
        optimizer = torch.optim.AdamW(groups, **hyper)
    else:
        optimizer = ZenFlowAdamW(
            groups,
            **hyper,
            max_grad_norm=CLIP,
            step_backend="eager",  # the same arithmetic as Inductor's loop, without compiles
            select_strategy="step",
            select_interval=SELECT_INTERVAL,
            **settings,
        )
    started, losses = time.perf_counter(), []
    for _, (x, y) in zip(range(task.steps), task.batches(), strict=False):
        loss = model(x, y)
        loss.backward()
        if settings is None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    if settings is not None:
        optimizer.flush()
    return _result(model, task, losses, time.perf_counter() - started)


def _result(model, task, losses, seconds) -> dict:
    return dict(
        loss=held_out_loss(model, task),
        train_loss=statistics.fmean(losses[-10:]),
        seconds=seconds,
    )


def train_deepspeed(task: Task, settings: dict) -> dict:
    """DeepSpeed's own ZenFlow with ``settings`` (this process runs torch.distributed)."""
    import deepspeed

    model = task.build()
    config = {
        "train_micro_batch_size_per_gpu": task.batch_size,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "AdamW",
            "params": dict(
                lr=task.lr, betas=list(task.betas), eps=1e-8, weight_decay=task.weight_decay
            ),
        },
        "gradient_clipping": CLIP,
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": False},
            "zenflow": dict(
                settings,
                select_strategy="step",
                select_interval=SELECT_INTERVAL,
                full_warm_up_rounds=0,
            ),
        },
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.param_groups(task.weight_decay), config=config
    )
    started, losses = time.perf_counter(), []
    for _, (x, y) in zip(range(task.steps), task.batches(), strict=False):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    result = _result(engine.module, task, losses, time.perf_counter() - started)
    engine.destroy()
    return result


def _ds_worker(args) -> None:
    """Run every task's grid with DeepSpeed's ZenFlow; one JSON line per run, appended to
    ``args.ds_results`` as each ends (a run cut short keeps the ones before it)."""
    torch.set_num_threads(args.threads)
    grid = QUICK_GRID if args.quick else GRID
    for name in args.tasks.split(","):
        task = TASKS[name](args.quick)
        for i, settings in enumerate(grid):
            print(f"{name}: ds-zenflow {i + 1}/{len(grid)}", file=sys.stderr, flush=True)
            try:
                result = train_deepspeed(task, settings)
            except Exception as error:  # a failed run is a row that says so, not a lost table
                result = dict(error=f"{type(error).__name__}: {error}"[:300])
            with open(args.ds_results, "a") as results:
                results.write(json.dumps(dict(task=name, settings=settings, **result)) + "\n")


class DeepSpeedRows:
    """The ``ds-zenflow`` rows of every task, from one worker process per task (DeepSpeed needs
    torch.distributed; one rank each), running beside the in-process rows: they share no
    state, and no number they report depends on time."""

    def __init__(self, args):
        self.results_path = args.out_dir / "bench_accuracy_ds.jsonl"
        self.results_path.unlink(missing_ok=True)
        self.log_path = args.out_dir / "bench_accuracy_ds.log"
        self.procs = []
        with open(self.log_path, "w") as log:
            for i, name in enumerate(args.tasks.split(",")):
                env = dict(
                    os.environ,
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(29500 + (os.getpid() + 7 * i) % 1000),
                    RANK="0",
                    WORLD_SIZE="1",
                    LOCAL_RANK="0",
                    OMP_NUM_THREADS=str(args.threads),
                )
                command = [sys.executable, __file__, "--ds-worker", "--tasks", name]
                command += ["--threads", str(args.threads), "--ds-results", str(self.results_path)]
                command += ["--quick"] if args.quick else []
                self.procs.append(subprocess.Popen(command, stdout=log, stderr=log, env=env))

    def collect(self, grid: list[dict]) -> dict[str, list[dict]]:
        """Every task's rows in grid order; runs the workers did not report are failed rows."""
        returncodes = [proc.wait() for proc in self.procs]
        lines = self.results_path.read_text().splitlines() if self.results_path.exists() else []
        tail = self.log_path.read_text().strip().splitlines()[-1:] or ["no output"]
        failure = f"worker exited {max(returncodes)}: {tail[0][:200]} (log: {self.log_path})"
        reported = {}
        for result in map(json.loads, lines):
            reported.setdefault(result.pop("task"), {})[json.dumps(result["settings"])] = result
        return {
            name: [runs.get(json.dumps(s), dict(settings=s, error=failure)) for s in grid]
            for name, runs in reported.items()
        }


def label(settings: dict) -> str:
    overlap = "overlap" if settings["overlap_step"] else "sync"
    return f"topk {settings['topk_ratio']} / every {settings['update_interval']} / {overlap}"


def print_task(name: str, adamw: dict, rows: dict[str, list[dict]]) -> None:
    peers = list(rows)
    print(f"\n## {name}: held-out loss, AdamW {adamw['loss']:.4f}")
    print(f"{'topk / update_interval / overlap':<34}" + "".join(f"{p:>22}" for p in peers))
    grid = [r["settings"] for r in rows[peers[0]]]
    for i, settings in enumerate(grid):
        cells = []
        for peer in peers:
            r = rows[peer][i]
            if "error" in r:
                cells.append("failed")
            else:
                cells.append(f"{r['loss']:.4f} {r['loss'] / adamw['loss']:.3f}x")
        print(f"{label(settings):<34}" + "".join(f"{c:>22}" for c in cells))
    for peer in peers:
        errors = {r["error"] for r in rows[peer] if "error" in r}
        for error in errors:
            print(f"{peer} failed: {error}")


def plot(report: dict, path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6 * len(report), 5))
    axes = fig.subplots(1, len(report), squeeze=False)[0]
    for ax, (name, task) in zip(axes, report.items(), strict=True):
        reference = task["adamw"]["loss"]
        peers = list(task["rows"])
        grid = [r["settings"] for r in task["rows"][peers[0]]]
        width = 0.8 / len(peers)
        for j, peer in enumerate(peers):
            ratios = [
                r["loss"] / reference if "error" not in r else float("nan")
                for r in task["rows"][peer]
            ]
            positions = [i + (j - (len(peers) - 1) / 2) * width for i in range(len(grid))]
            ax.bar(positions, ratios, width, label=peer)
        ax.axhline(1.0, color="black", linewidth=1, label="AdamW")
        ticks = [
            f"{s['topk_ratio']} / {s['update_interval']} {'o' if s['overlap_step'] else 's'}"
            for s in grid
        ]
        ax.set_xticks(range(len(grid)), ticks, fontsize=8, rotation=60)
        ax.set_xlabel("topk_ratio / update_interval, s: sync, o: overlap_step")
        ax.set_ylabel("held-out loss / AdamW's")
        finite = [
            r["loss"] / reference for rows in task["rows"].values() for r in rows if "loss" in r
        ]
        if finite:
            ax.set_ylim(min(0.98, min(finite) - 0.01), max(finite) + 0.01)
        ax.set_title(f"{name} ({task['steps']} steps)")
        ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny tasks, one grid point")
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--peers", default=",".join(PEERS), help="of: " + ",".join(PEERS))
    parser.add_argument(
        "--threads", type=int, default=1, help="per process (this one and DeepSpeed's worker)"
    )
    parser.add_argument("--out-dir", type=Path, default=ROOT / "runs")
    parser.add_argument("--ds-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ds-results", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = set(args.tasks.split(",")) - set(TASKS) | set(args.peers.split(",")) - set(PEERS)
    if unknown:
        parser.error(f"unknown tasks or peers {sorted(unknown)}; tasks: {list(TASKS)}")
    return args


def main() -> None:
    args = parse_args()
    if args.ds_worker:
        _ds_worker(args)
        return
    torch.set_num_threads(args.threads)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    grid = QUICK_GRID if args.quick else GRID
    peers = args.peers.split(",")
    started = time.perf_counter()
    # Built (and pre-trained, cached) before the worker starts, which then loads the caches.
    tasks = [TASKS[name](args.quick) for name in args.tasks.split(",")]
    deepspeed_rows = DeepSpeedRows(args) if "ds-zenflow" in peers else None
    report = {}
    for task in tasks:
        print(f"{task.name}: adamw", file=sys.stderr, flush=True)
        adamw = train_torch(task, None)
        rows = {}
        if "zenflow" in peers:
            rows["zenflow"] = []
            for i, settings in enumerate(grid):
                print(f"{task.name}: zenflow {i + 1}/{len(grid)}", file=sys.stderr, flush=True)
                rows["zenflow"].append(dict(settings=settings, **train_torch(task, settings)))
        report[task.name] = dict(steps=task.steps, adamw=adamw, rows=rows)
        (args.out_dir / "bench_accuracy.json").write_text(json.dumps(report, indent=2) + "\n")
    if deepspeed_rows is not None:
        print("waiting for the ds-zenflow rows", file=sys.stderr, flush=True)
        ds = deepspeed_rows.collect(grid)
        for task in tasks:
            report[task.name]["rows"]["ds-zenflow"] = ds.get(task.name) or [
                dict(settings=s, error=f"not reported (log: {deepspeed_rows.log_path})")
                for s in grid
            ]
    for name, task_report in report.items():
        print_task(name, task_report["adamw"], task_report["rows"])
    print(
        f"\n(select_interval {SELECT_INTERVAL}, clip {CLIP}; loss: mean over held-out batches; "
        f"ratio: over AdamW's; {time.perf_counter() - started:.0f} s in all)"
    )
    (args.out_dir / "bench_accuracy.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.out_dir / "bench_accuracy.png")
    print(f"numbers: {args.out_dir / 'bench_accuracy.json'}")
    print(f"plot: {args.out_dir / 'bench_accuracy.png'}")


if __name__ == "__main__":
    # Each line reaches a pipe or a log file when printed, not at exit: rows of a long run.
    sys.stdout.reconfigure(line_buffering=True)
    main()
