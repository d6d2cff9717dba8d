"""transformers.Trainer, unmodified, with ZenFlowAdamW as its optimizer: its clipping sees the
true global gradient norm (the owned weights' ``.grad`` is a ``StagedGradient``) and scales the
staged rows; its LR schedule, gradient accumulation, evaluation and checkpoints work as with
torch's AdamW. Models are transformers GPT-2s built from a config, dropout off."""

import pytest
import torch
import transformers

import zenflow
from zenflow.integrations.transformers import ZenFlowCallback

SETTINGS = dict(topk_ratio=0.25, update_interval=2, select_interval=4, overlap_step=True)
SAMPLES, LENGTH, VOCAB = 24, 16, 64


@pytest.fixture(autouse=True)
def fresh_dynamo():
    # Each test compiles new models; without a reset, dynamo's recompile limit would make
    # later tests run eagerly.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def gpt2() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=LENGTH,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


def dataset(samples: int = SAMPLES) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (samples, LENGTH), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def arguments(tmp_path, **overrides) -> transformers.TrainingArguments:
    values = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        max_steps=6,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )
    values.update(overrides)
    return transformers.TrainingArguments(**values)


def zenflow_adamw(model, **extra) -> zenflow.ZenFlowAdamW:
    """The optimizer of every zenflow run here (no weight decay: Trainer's default)."""
    return zenflow.ZenFlowAdamW(
        model.parameters(), lr=1e-2, weight_decay=0.0, step_backend="eager", **SETTINGS, **extra
    )


class SeesTheGradients(transformers.TrainerCallback):
    """Records the type of an owned weight's ``.grad`` just before each optimizer step."""

    def __init__(self, weight: torch.nn.Parameter):
        self.weight, self.kinds = weight, []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.kinds.append(type(self.weight.grad))


def zenflow_trainer(tmp_path, compiled=True, eval_dataset=None, **overrides):
    model = gpt2()
    opt = zenflow_adamw(model)
    if compiled:
        model.compile(backend="zenflow", options={"inner": "eager"})
    watch = SeesTheGradients(model.transformer.h[0].mlp.c_fc.weight)
    trainer = transformers.Trainer(
        model=model,
        args=arguments(tmp_path, **overrides),
        train_dataset=dataset(),
        eval_dataset=eval_dataset,
        optimizers=(opt, None),
        callbacks=[ZenFlowCallback(), watch],
    )
    return trainer, opt, watch


def grad_norms(trainer) -> list[float]:
    return [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]


def parameters(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_trained_alike(model, like, atol: float) -> None:
    """Parameters equal up to ``atol``, for runs whose sums differ in order only. The largest
    differences are in the attention key biases, whose gradient is rounding noise (softmax
    ignores them) that Adam normalizes; a clip or micro-batch missed moves weights by ~1e-3."""
    want, got = parameters(like), parameters(model)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=atol, msg=name)


@pytest.mark.parametrize("run", ["compiled", "eager", "compiled, bf16 autocast"])
def test_the_logged_grad_norm_is_the_true_global_norm(run, tmp_path):
    precision = dict(bf16=True) if "bf16" in run else {}
    torch_model = gpt2()
    reference = transformers.Trainer(
        model=torch_model,
        args=arguments(tmp_path, max_steps=1, **precision),
        train_dataset=dataset(),
        optimizers=(torch.optim.AdamW(torch_model.parameters(), lr=1e-2, weight_decay=0.0), None),
    )
    reference.train()
    compiled = run.startswith("compiled")
    trainer, _, watch = zenflow_trainer(tmp_path, compiled=compiled, max_steps=1, **precision)
    trainer.train()
    assert watch.kinds == [zenflow.StagedGradient if compiled else torch.Tensor]
    (want,), (got,) = grad_norms(reference), grad_norms(trainer)
    assert want > 1.0  # the default max_grad_norm clips
    assert got == pytest.approx(want, rel=1e-5)


def test_trainer_clips_the_owned_weights_as_the_optimizer_would(tmp_path):
    """Trainer's clipping (torch's clip_grad_norm_ over .grad) gives the parameters that
    ZenFlowAdamW clipping by itself (max_grad_norm, Trainer's off) gives: the clip
    coefficient reached the staged rows, not only the 1-D parameters' .grad."""
    by_trainer, _, watch = zenflow_trainer(tmp_path / "trainer")
    by_trainer.train()
    assert set(watch.kinds) == {zenflow.StagedGradient}
    assert max(grad_norms(by_trainer)) > 1.0  # it clipped
    model = gpt2()
    opt = zenflow_adamw(model, max_grad_norm=1.0)
    model.compile(backend="zenflow", options={"inner": "eager"})
    by_optimizer = transformers.Trainer(
        model=model,
        args=arguments(tmp_path / "optimizer", max_grad_norm=0.0),
        train_dataset=dataset(),
        optimizers=(opt, None),
        callbacks=[ZenFlowCallback()],
    )
    by_optimizer.train()
    assert_trained_alike(by_trainer.model, by_optimizer.model, atol=5e-5)


def test_resuming_from_a_checkpoint_continues_the_straight_run(tmp_path):
    straight, *_ = zenflow_trainer(tmp_path / "straight", save_strategy="steps", save_steps=3)
    straight.train()
    checkpoint = tmp_path / "straight" / "out" / "checkpoint-3"
    assert (checkpoint / "optimizer.pt").exists()
    resumed, opt, _ = zenflow_trainer(tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert opt.stats()["steps"] == 6
    want, got = parameters(straight.model), parameters(resumed.model)
    assert all(torch.equal(got[name], want[name]) for name in want)


def test_gradient_accumulation_equals_the_larger_batch(tmp_path):
    whole, *_ = zenflow_trainer(tmp_path / "whole")
    whole.train()
    accumulated, *_ = zenflow_trainer(
        tmp_path / "accumulated", per_device_train_batch_size=2, gradient_accumulation_steps=2
    )
    accumulated.train()
    assert_trained_alike(accumulated.model, whole.model, atol=5e-5)


def test_evaluation_between_steps_changes_nothing(tmp_path):
    plain, *_ = zenflow_trainer(tmp_path / "plain")
    plain.train()
    evaluated, *_ = zenflow_trainer(
        tmp_path / "evaluated", eval_dataset=dataset(8), eval_strategy="steps", eval_steps=2
    )
    evaluated.train()
    assert sum("eval_loss" in entry for entry in evaluated.state.log_history) == 3
    want, got = parameters(plain.model), parameters(evaluated.model)
    assert all(torch.equal(got[name], want[name]) for name in want)


def test_training_ends_flushed(tmp_path):
    trainer, opt, _ = zenflow_trainer(tmp_path, max_steps=5)
    trainer.train()
    assert opt.stats()["window_steps"] == 0 and opt.stats()["updates_in_flight"] == 0
    fp32 = opt.fp32_parameters()
    assert all(torch.equal(p, fp32[p]) for p in trainer.model.parameters())


def test_the_callback_says_when_the_optimizer_is_not_zenflows(tmp_path):
    model = gpt2()
    trainer = transformers.Trainer(
        model=model,
        args=arguments(tmp_path, max_steps=1),
        train_dataset=dataset(),
        optimizers=(torch.optim.AdamW(model.parameters()), None),
        callbacks=[ZenFlowCallback()],
    )
    with pytest.raises(TypeError, match="AdamW, not a ZenFlowAdamW"):
        trainer.train()
