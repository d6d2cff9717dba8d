"""ZenFlowAdamW against the oracle (``zenflow.reference``) over random combinations of its
settings and of how a training loop drives it: topk_ratio from 0 to 1, fixed and "auto" update
intervals, select intervals of one to three windows, overlap on and off, warm-up rounds,
clipping, weight decay, device-side sums or offload, a compiled or an eager model, one or two
micro-batches, and a step whose gradient is NaN (skipped). The tests elsewhere pin each of
these on its own; here they meet in combinations nobody picked. Each draw trains a tiny model
for 8 to 20 steps; its parameters equal the oracle's after every step and after ``flush()``."""

import random

import pytest
import torch
from torch.testing import assert_close

from tests.models import batches, build, loss_of
from zenflow.optimizer import ZenFlowAdamW
from zenflow.reference import ReferenceZenFlowAdamW

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

DRAWS = 40


def draw(seed: int) -> tuple[dict, dict, dict]:
    """The settings both optimizers take, those only ZenFlowAdamW takes, and the loop's."""
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
    runtime = dict(
        offload=offload,
        accumulate_on_device=not offload and rng.random() < 0.5,
        nonfinite="skip",
    )
    loop = dict(
        model=rng.choice(["mlp", "wide", "mlp_nobias"]),
        compiled=rng.random() < 0.4,
        micro_batches=rng.choice([1, 1, 2]),
        steps=rng.randint(8, 20),
        nan_at=rng.choice([None, None, rng.randint(0, 7)]),
    )
    return settings, runtime, loop


def backward(name: str, model, inputs, targets, micro_batches: int) -> None:
    if micro_batches == 1:
        loss_of(name, model, inputs, targets).backward()
        return
    half = inputs.shape[0] // 2
    for x, y in ((inputs[:half], targets[:half]), (inputs[half:], targets[half:])):
        (loss_of(name, model, x, y) / 2).backward()


@pytest.mark.parametrize("seed", range(DRAWS))
def test_a_random_combination_equals_the_oracle(seed):
    settings, runtime, loop = draw(seed)
    described = f"seed {seed}: {settings}, {runtime}, {loop}"
    data_name = "mlp" if loop["model"] == "mlp_nobias" else loop["model"]
    model, oracle_model = build(loop["model"]), build(loop["model"])
    opt = ZenFlowAdamW(model.parameters(), step_backend="eager", **settings, **runtime)
    oracle = ReferenceZenFlowAdamW(oracle_model.parameters(), **settings)
    forward = model
    if loop["compiled"]:
        forward = torch.compile(model, backend="zenflow", options={"inner": "eager"})
    for step, (inputs, targets) in enumerate(batches(data_name, loop["steps"], seed=seed)):
        if step == loop["nan_at"]:
            inputs = inputs.clone()
            inputs[0, 0] = float("nan")
        for m, o in ((forward, opt), (oracle_model, oracle)):
            o.zero_grad()
            backward(data_name, m, inputs, targets, loop["micro_batches"])
            o.step()
        assert_close(
            list(model.parameters()),
            list(oracle_model.parameters()),
            rtol=2e-5,
            atol=2e-6,
            msg=lambda m, step=step: f"{described}, step {step}: {m}",
        )
    opt.flush()
    oracle.flush()
    assert_close(
        list(model.parameters()),
        list(oracle_model.parameters()),
        rtol=2e-5,
        atol=2e-6,
        msg=lambda m: f"{described}, after flush(): {m}",
    )
    skipped = 0 if loop["nan_at"] is None else 1
    assert opt.stats()["skipped_steps"] == oracle.skipped_steps == skipped, described
