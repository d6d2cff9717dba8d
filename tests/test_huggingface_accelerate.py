"""An Accelerate training loop with ZenFlowAdamW: ``prepare``, ``backward``,
``clip_grad_norm_`` (the true global norm, applied to the staged rows), gradient accumulation,
evaluation between steps, ``save_state``/``load_state``; and ``prepare``'s round trip of the
optimizer's state dict through a device move leaves the host state on the host."""

import accelerate
import accelerate.optimizer
import pytest
import torch
import transformers

from tests.test_huggingface_trainer import (
    assert_trained_alike,
    dataset,
    gpt2,
    parameters,
    zenflow_adamw,
)
from zenflow.runtime.state_schema import saved_weights

STEPS, MAX_NORM = 6, 1.0


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def collate(samples: list[dict]) -> dict:
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}


def loop(
    *,
    zenflow_optimizer=True,
    batch=4,
    accumulate=1,
    evaluate_every=0,
    checkpoint=None,
    save_at=None,
    resume=False,
):
    """Train STEPS optimizer steps (with a checkpoint: saved after step ``save_at``, or
    resumed from there); returns (model, clip norms, optimizer)."""
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=accumulate)
    model = gpt2()
    if zenflow_optimizer:
        opt = zenflow_adamw(model)
        model.compile(backend="zenflow", options={"inner": "eager"})
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=batch, collate_fn=collate)
    schedule = transformers.get_linear_schedule_with_warmup(opt, 0, STEPS)
    model, prepared_opt, loader, schedule = accelerator.prepare(model, opt, loader, schedule)
    start = 0
    if resume:
        accelerator.load_state(checkpoint)
        start = save_at
        loader = accelerator.skip_first_batches(loader, start * accumulate)
    norms = []
    for i, micro_batch in enumerate(loader, start=start * accumulate):
        with accelerator.accumulate(model):
            accelerator.backward(model(**micro_batch).loss)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)))
            prepared_opt.step()
            schedule.step()
            prepared_opt.zero_grad()
        step = (i + 1) // accumulate
        if accelerator.sync_gradients and evaluate_every and step % evaluate_every == 0:
            model.eval()
            with torch.no_grad():
                model(**collate(dataset(4)))
            model.train()
        if accelerator.sync_gradients and step == save_at and not resume:
            accelerator.save_state(checkpoint)
    if zenflow_optimizer:
        opt.flush()
    return model, norms, opt


def test_clip_grad_norm_returns_the_true_global_norm_and_clips_the_staged_rows():
    _, torch_norms, _ = loop(zenflow_optimizer=False)
    model, norms, opt = loop()
    assert torch_norms[0] > MAX_NORM
    assert norms[0] == pytest.approx(torch_norms[0], rel=1e-5)
    assert opt.stats()["steps"] == STEPS and opt.stats()["reselections"] > 0
    # The same run with ZenFlowAdamW clipping itself: the clip reached the staged rows.
    mine = gpt2()
    own = zenflow_adamw(mine, max_grad_norm=MAX_NORM)
    schedule = transformers.get_linear_schedule_with_warmup(own, 0, STEPS)
    compiled = torch.compile(mine, backend="zenflow", options={"inner": "eager"})
    for ids in torch.utils.data.DataLoader(dataset(), batch_size=4, collate_fn=collate):
        compiled(**ids).loss.backward()
        own.step()
        schedule.step()
        own.zero_grad()
    own.flush()
    assert_trained_alike(model, mine, atol=5e-5)


def test_save_state_and_load_state_continue_the_straight_run(tmp_path):
    straight, *_ = loop(checkpoint=tmp_path / "state", save_at=3)
    resumed, _, opt = loop(checkpoint=tmp_path / "state", save_at=3, resume=True)
    assert opt.stats()["steps"] == STEPS
    want, got = parameters(straight), parameters(resumed)
    assert all(torch.equal(got[name], want[name]) for name in want)


def test_gradient_accumulation_equals_the_larger_batch():
    whole, *_ = loop()
    accumulated, *_ = loop(batch=2, accumulate=2)
    assert_trained_alike(accumulated, whole, atol=5e-5)


def test_evaluation_between_steps_changes_nothing():
    plain, *_ = loop()
    evaluated, *_ = loop(evaluate_every=2)
    want, got = parameters(plain), parameters(evaluated)
    assert all(torch.equal(got[name], want[name]) for name in want)


def test_moving_the_state_dict_to_a_device_leaves_the_host_state_where_it_is():
    """What ``AcceleratedOptimizer`` does to the state dict on a GPU, with "meta" standing in
    for the device: the weights' host state (masters, moments, window sums) is not moved; the
    rest (the 1-D parameters' state) is, and the moved dict loads."""
    model, _, opt = loop()
    state = opt.state_dict()
    moved = accelerate.optimizer.move_to_device(state, torch.device("meta"))
    held, kept = saved_weights(state), saved_weights(moved)
    assert kept is held
    host_tensors = [t for weight in held for t in weight["host"]]
    assert all(t.device.type == "cpu" for t in host_tensors)
    assert all(t.device.type == "meta" for vector in moved["vectors"] for t in vector)
    fresh = zenflow_adamw(gpt2())
    fresh.load_state_dict(accelerate.optimizer.move_to_device(state, torch.device("cpu")))
    assert fresh.stats()["steps"] == STEPS
