"""ZenFlowAdamW against the oracle (``zenflow.reference``) over random combinations of its
settings and of how a training loop drives it (``tests/oracle_draws.py``): topk_ratio from 0
to 1, fixed and "auto" update intervals, select intervals of one to three windows, overlap on
and off, warm-up rounds, clipping, weight decay, device-side sums or offload, a compiled or an
eager model (an MLP, one whose gradients arrive as factors, a GPT whose LM head is its
embedding), one or two micro-batches, and a step whose gradient is NaN (skipped); and over two
ranks, ZeRO-1 or 2; through ``zenflow.initialize`` with the draw as a DeepSpeed config; and a
checkpoint taken at a random step resumes as the straight run. The tests elsewhere pin each of
these on its own; here they meet in combinations nobody picked. Each draw trains a tiny model
for 8 to 20 steps."""

import random

import pytest
import torch
import torch.multiprocessing as mp
from torch.testing import assert_close

from tests.oracle_draws import (
    draw,
    engine_draw,
    train_engine,
    train_engine_oracle,
    train_oracle,
    train_zenflow,
    two_rank_worker,
)
from tests.ports import free_port

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

ONE_RANK_DRAWS = 40
GPT_DRAWS = 8
TWO_RANK_DRAWS = 16
RESUMED_DRAWS = 16
ENGINE_DRAWS = 16


def close(actual, expected, described: str) -> None:
    assert_close(actual, expected, rtol=2e-5, atol=2e-6, msg=lambda m: f"{described}: {m}")


@pytest.mark.parametrize(
    "seed, model",
    [(seed, None) for seed in range(ONE_RANK_DRAWS)]
    + [(seed, "gpt") for seed in range(500, 500 + GPT_DRAWS)],
    ids=lambda value: str(value),
)
def test_a_random_combination_equals_the_oracle_after_every_step(seed, model):
    """``model`` "gpt": a small GPT whose LM head is its token embedding, so that one weight
    takes both a matmul's gradient and a lookup's."""
    described = f"seed {seed}: {draw(seed, model=model)}"
    oracle_steps = []
    oracle_model, oracle = train_oracle(
        seed, each_step=lambda m, step: oracle_steps.append(_params(m)), model_name=model
    )

    def same_as_the_oracle(model, step):
        close(_params(model), oracle_steps[step], f"{described}, step {step}")

    trained, opt = train_zenflow(seed, each_step=same_as_the_oracle, model_name=model)
    close(_params(trained), _params(oracle_model), f"{described}, after flush()")
    assert opt.stats()["skipped_steps"] == oracle.skipped_steps, described


def test_random_combinations_over_two_ranks_equal_the_oracle(tmp_path):
    """Each rank trains on its half of every batch (the NaN in one rank's half only): the
    final parameters equal the oracle's on the whole batch."""
    seeds = list(range(1000, 1000 + TWO_RANK_DRAWS))
    mp.spawn(two_rank_worker, args=(2, free_port(), str(tmp_path), seeds), nprocs=2)
    results = torch.load(tmp_path / "sweep.pt")
    for seed in seeds:
        described = f"seed {seed}: {draw(seed, world_size=2)}"
        assert not isinstance(results[seed], str), f"{described}: {results[seed]}"
        params, skipped = results[seed]
        oracle_model, oracle = train_oracle(seed, world_size=2)
        close(params, _params(oracle_model), described)
        assert skipped == oracle.skipped_steps, described


@pytest.mark.parametrize("seed", range(2000, 2000 + RESUMED_DRAWS))
def test_a_random_combination_resumes_from_a_checkpoint_at_a_random_step_as_the_straight_run(
    seed,
):
    """Saved between two steps (model and optimizer state dicts, in memory), loaded into a new
    model and optimizer built from other weights: the run goes on bitwise as if never
    stopped, whatever was pending (an open window, an overlapped update, a selection)."""
    _, _, loop = draw(seed)
    save_at = random.Random(seed).randint(1, loop["steps"] - 1)
    described = f"seed {seed}, saved before step {save_at}: {draw(seed)}"
    straight, straight_opt = train_zenflow(seed)
    first, first_opt = train_zenflow(seed, stop_at=save_at)
    saved = ({k: v.clone() for k, v in first.state_dict().items()}, first_opt.state_dict())
    torch._dynamo.reset()
    resumed, resumed_opt = train_zenflow(seed, resume=(*saved, save_at))
    for mine, theirs in zip(_params(resumed), _params(straight), strict=True):
        assert torch.equal(mine, theirs), described
    counted = ("steps", "cpu_updates", "reselections", "skipped_steps")
    assert [resumed_opt.stats()[c] for c in counted] == [
        straight_opt.stats()[c] for c in counted
    ], described


@pytest.mark.parametrize("seed", range(3000, 3000 + ENGINE_DRAWS))
def test_a_random_deepspeed_config_trains_as_the_oracle(seed):
    """The draw as a DeepSpeed config (its micro-batches as gradient accumulation, its
    clipping as gradient_clipping, ZeRO-1 or 2), through ``zenflow.initialize``: the engine's
    model ends as the oracle's."""
    described = f"seed {seed}: {engine_draw(seed)}"
    engine = train_engine(seed)
    oracle_model = train_engine_oracle(seed)
    close(_params(engine.module), _params(oracle_model), described)


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]
