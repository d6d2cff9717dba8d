"""A transformers model trained with ZenFlowAdamW saves as one trained with any optimizer: its
parameters keep PyTorch's layout (contiguous, natural strides) in eager, compiled and engine
runs, through reselections, an overlapped update and a checkpoint load, so ``save_pretrained``
and safetensors take them as they are."""

import pytest
import safetensors.torch
import torch
import transformers

import zenflow

SETTINGS = dict(topk_ratio=0.25, update_interval=2, select_interval=4, overlap_step=True)


def gpt2() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    return transformers.GPT2LMHeadModel(config)


def batches(steps: int):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 64, (4, 16), generator=g) for _ in range(steps)]


def train_with_the_optimizer(compiled: bool) -> transformers.GPT2LMHeadModel:
    model = gpt2()
    opt = zenflow.ZenFlowAdamW(model.parameters(), lr=1e-2, step_backend="eager", **SETTINGS)
    forward = (
        torch.compile(model, backend="zenflow", options={"inner": "eager"}) if compiled else model
    )
    for ids in batches(6):
        opt.zero_grad()
        forward(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    assert opt.stats()["reselections"] == 2 and opt.stats()["updates_in_flight"] == 1
    return model


def engine_config() -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu"},
            "zenflow": SETTINGS,
        },
    }


def train_with_the_engine(tmp_path) -> transformers.GPT2LMHeadModel:
    """Trained, saved, and loaded into a new engine, which trains on."""
    engines = []
    for _ in range(2):
        engine, *_ = zenflow.initialize(model=gpt2(), config=engine_config())
        engine.compile(options={"inner": "eager"})
        engines.append(engine)
    first, resumed = engines
    data = batches(6)
    for ids in data[:3]:
        first.backward(first(input_ids=ids, labels=ids).loss)
        first.step()
    first.save_checkpoint(tmp_path / "ckpt")
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert all(p.is_contiguous() for p in resumed.module.parameters())
    for ids in data[3:]:
        resumed.backward(resumed(input_ids=ids, labels=ids).loss)
        resumed.step()
    return resumed.module


@pytest.mark.parametrize("run", ["eager", "compiled", "engine"])
def test_a_trained_model_saves_with_save_pretrained_and_safetensors(run, tmp_path):
    if run == "engine":
        model = train_with_the_engine(tmp_path)
    else:
        model = train_with_the_optimizer(compiled=run == "compiled")
    for name, p in model.named_parameters():
        assert p.is_contiguous(), name
        assert p.view(-1).numel() == p.numel()
    model.save_pretrained(tmp_path / "pretrained")  # safetensors, tied weights and all
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "pretrained")
    saved, again = model.state_dict(), loaded.state_dict()
    assert saved.keys() == again.keys()
    assert all(torch.equal(saved[name], again[name]) for name in saved)
    path = tmp_path / "weights.safetensors"
    safetensors.torch.save_file(dict(model.named_parameters()), path)
    for name, value in safetensors.torch.load_file(path).items():
        assert torch.equal(value, dict(model.named_parameters())[name])
