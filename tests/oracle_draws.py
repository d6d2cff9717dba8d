"""Random combinations of ZenFlowAdamW's settings and of the loop that drives it, trained by
ZenFlowAdamW (on one rank or on this rank's share of a data-parallel batch) and by the oracle
(``zenflow.reference``, on the whole batch), for ``tests/test_oracle_sweep.py``.

A draw is three dicts: the settings both optimizers take; those only ZenFlowAdamW takes (the
runtime's: offload, device-side sums, ZeRO stage); and the loop's (the model, compiled or not,
micro-batches, steps, and the step whose batch holds a NaN, which both skip)."""

import os
import random

import torch
import torch.distributed as dist

import zenflow
from tests.models import batches, build, loss_of
from zenflow.optimizer import ZenFlowAdamW
from zenflow.reference import ReferenceZenFlowAdamW


def draw(seed: int, world_size: int = 1, model: str | None = None) -> tuple[dict, dict, dict]:
    """``model``: the model to train (one of tests.models'), drawn where None."""
    rng = random.Random(seed)
    update_interval = rng.choice([1, 2, 3, 4, "auto"])
    settings = dict(
        lr=rng.choice([1e-2, 3e-3]),
        weight_decay=rng.choice([0.0, 0.01]),
        topk_ratio=rng.choice([0.0, 0.1, 0.25, 0.5, 1.0]),
        update_interval=update_interval,
        overlap_step=rng.random() < 0.5,
        full_warm_up_rounds=rng.choice([0, 0, 1, 3]),
        max_grad_norm=rng.choice([None, None, 0.05, 1.0]),
    )
    if update_interval == "auto":
        settings.update(
            min_update_interval=rng.choice([1, 2]),
            max_update_interval=rng.choice([4, 6]),
            select_interval=rng.choice([6, 12]),
        )
    else:
        settings["select_interval"] = update_interval * rng.choice([1, 2, 3])
    offload = rng.random() < 0.25
    runtime = dict(offload=offload, nonfinite="skip")
    if world_size == 1:  # device-side sums take one rank
        runtime["accumulate_on_device"] = not offload and rng.random() < 0.5
    else:
        runtime["zero_stage"] = rng.choice([1, 2])
    drawn = rng.choice(["mlp", "wide", "mlp_nobias"])
    model = drawn if model is None else model
    # The wide model's batches are 2 rows: one per rank, which does not split again.
    one_row_shares = model == "wide" and world_size > 1
    loop = dict(
        model=model,
        compiled=rng.random() < 0.4,
        micro_batches=1 if one_row_shares else rng.choice([1, 1, 2]),
        steps=rng.randint(8, 20),
        nan_at=rng.choice([None, None, rng.randint(0, 7)]),
    )
    if model == "gpt":  # token ids hold no NaN
        loop["nan_at"] = None
    return settings, runtime, loop


def _data(seed: int, loop: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches, the NaN in the first row of step ``nan_at``'s."""
    name = "mlp" if loop["model"] == "mlp_nobias" else loop["model"]
    data = []
    for step, (inputs, targets) in enumerate(batches(name, loop["steps"], seed=seed)):
        if step == loop["nan_at"]:
            inputs = inputs.clone()
            inputs[0, 0] = float("nan")
        data.append((inputs, targets))
    return data


def _backward(loop: dict, model, inputs, targets) -> None:
    """One backward per micro-batch (equal chunks of the batch), each loss divided by their
    number: the batch's mean loss."""
    name = "mlp" if loop["model"] == "mlp_nobias" else loop["model"]
    n = loop["micro_batches"]
    for x, y in zip(inputs.chunk(n), targets.chunk(n), strict=True):
        (loss_of(name, model, x, y) / n).backward()


def train_zenflow(
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    each_step=None,
    stop_at: int | None = None,
    resume: tuple[dict, dict, int] | None = None,
    model_name: str | None = None,
):
    """ZenFlowAdamW trained on this rank's share of every batch of draw ``seed``, flushed at
    the end; ``each_step(model, step)`` after each step. ``stop_at``: return before that step,
    unflushed; ``resume``: (model state, optimizer state, step) to start from, loaded into a
    model built from other weights; ``model_name``: as for ``draw``. Returns the model and the
    optimizer."""
    settings, runtime, loop = draw(seed, world_size, model_name)
    model = build(loop["model"], seed=0 if resume is None else 123)
    opt = ZenFlowAdamW(model.parameters(), step_backend="eager", **settings, **runtime)
    start = 0
    if resume is not None:
        model_state, opt_state, start = resume
        model.load_state_dict(model_state)
        opt.load_state_dict(opt_state)
    forward = model
    if loop["compiled"]:
        forward = torch.compile(model, backend="zenflow", options={"inner": "eager"})
    for step, (inputs, targets) in enumerate(_data(seed, loop)):
        if step < start:
            continue
        if step == stop_at:
            return model, opt
        share = slice(rank * len(inputs) // world_size, (rank + 1) * len(inputs) // world_size)
        opt.zero_grad()
        _backward(loop, forward, inputs[share], targets[share])
        opt.step()
        if each_step is not None:
            each_step(model, step)
    opt.flush()
    return model, opt


def train_oracle(seed: int, world_size: int = 1, each_step=None, model_name: str | None = None):
    """The oracle trained on the whole of every batch of draw ``seed`` (as drawn for
    ``world_size`` ranks), flushed; ``each_step(model, step)`` after each step."""
    settings, _, loop = draw(seed, world_size, model_name)
    model = build(loop["model"])
    oracle = ReferenceZenFlowAdamW(model.parameters(), **settings)
    for step, (inputs, targets) in enumerate(_data(seed, loop)):
        oracle.zero_grad()
        _backward(loop, model, inputs, targets)
        oracle.step()
        if each_step is not None:
            each_step(model, step)
    oracle.flush()
    return model, oracle


def two_rank_worker(rank: int, world_size: int, port: int, out_dir: str, seeds: list[int]):
    """For ``mp.spawn``: trains every draw of ``seeds`` on this rank's share; rank 0 saves
    each draw's final parameters and skipped steps, or the error it raised."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    results = {}
    try:
        for seed in seeds:
            torch._dynamo.reset()
            try:
                model, opt = train_zenflow(seed, rank, world_size)
            except Exception as error:  # reported by the test, with the draw
                results[seed] = repr(error)
                continue
            params = [p.detach().clone() for p in model.parameters()]
            results[seed] = (params, opt.stats()["skipped_steps"])
    finally:
        dist.destroy_process_group()
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "sweep.pt"))


def engine_draw(seed: int) -> tuple[dict, dict]:
    """Draw ``seed`` as a DeepSpeed config for ``zenflow.initialize`` (the micro-batches as
    gradient accumulation, the clipping as gradient_clipping, a ZeRO stage), and its loop; no
    NaN step (the engine raises on one unless told to skip)."""
    settings, runtime, loop = draw(seed)
    rng = random.Random(seed + 1)
    loop = dict(loop, nan_at=None)
    rows = 2 if loop["model"] == "wide" else 8  # a batch's rows (tests.models.batches)
    loop["micro_batches"] = rng.choice([n for n in (1, 2, 4) if rows % n == 0])
    block = {k: v for k, v in settings.items() if k not in ("lr", "weight_decay", "max_grad_norm")}
    block.update(offload=runtime["offload"], accumulate_on_device=runtime["accumulate_on_device"])
    config = {
        "train_micro_batch_size_per_gpu": rows // loop["micro_batches"],
        "gradient_accumulation_steps": loop["micro_batches"],
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": settings["lr"], "weight_decay": settings["weight_decay"]},
        },
        "gradient_clipping": settings["max_grad_norm"] or 0.0,
        "zero_optimization": {
            "stage": rng.choice([1, 2]),
            "offload_optimizer": {"device": "cpu"},
            "zenflow": block,
        },
    }
    return config, loop


def train_engine(seed: int):
    """The engine of ``engine_draw(seed)`` trained on its loop, one ``engine.step()`` per
    micro-batch, flushed. Returns the engine."""
    config, loop = engine_draw(seed)
    engine, *_ = zenflow.initialize(model=build(loop["model"]), config=config)
    if loop["compiled"]:
        engine.compile(options={"inner": "eager"})
    name = "mlp" if loop["model"] == "mlp_nobias" else loop["model"]
    n = loop["micro_batches"]
    for inputs, targets in batches(name, loop["steps"], seed=seed):
        for x, y in zip(inputs.chunk(n), targets.chunk(n), strict=True):
            engine.backward(loss_of(name, engine, x, y))
            engine.step()
    engine.flush()
    return engine


def train_engine_oracle(seed: int):
    """The oracle on the same batches as ``train_engine(seed)``. Returns the model."""
    settings, _, _ = draw(seed)
    _, loop = engine_draw(seed)
    model = build(loop["model"])
    oracle = ReferenceZenFlowAdamW(model.parameters(), **settings)
    name = "mlp" if loop["model"] == "mlp_nobias" else loop["model"]
    for inputs, targets in batches(name, loop["steps"], seed=seed):
        oracle.zero_grad()
        _backward(loop, model, inputs, targets)
        oracle.step()
    oracle.flush()
    return model
