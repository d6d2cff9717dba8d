"""The documentation's examples run as written: each Python example of the README's Quick
start, docs/deepspeed.md's engine example and docs/huggingface.md's Accelerate loop is executed
as it stands, with the names it leaves to the reader (a model, a loader, a dataset, training
arguments) bound to small stand-ins; a document's DeepSpeed JSON block is the config file its
example reads. An example whose API drifts from the library fails here."""

import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.test_huggingface_accelerate import collate
from tests.test_huggingface_trainer import arguments, dataset, gpt2

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def example(heading: str | None, language: str = "python", document: Path = README) -> str:
    """The first ``language`` block under ``document``'s ``heading`` (the whole line, such as
    "### Accelerate"; None: the document's first block)."""
    text = document.read_text()
    start = 0 if heading is None else text.index(f"\n{heading}\n")
    found = re.compile(rf"```{language}\n(.*?)```", re.DOTALL).search(text, start)
    assert found is not None, f"no {language} block under {heading!r} in {document.name}"
    return found.group(1)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def changed(before: list[torch.Tensor], model: torch.nn.Module) -> bool:
    """Every parameter differs from ``before`` (compared in the parameter's dtype: an engine
    may have cast the model)."""
    return all(
        not torch.equal(b.to(p.dtype), p.detach())
        for b, p in zip(before, model.parameters(), strict=True)
    )


def test_the_pytorch_loop_trains_through_a_select_boundary():
    model = mlp()
    before = weights(model)
    g = torch.Generator().manual_seed(1)
    loader = [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(9)]
    names = dict(model=model, loader=loader, loss_fn=F.mse_loss)
    exec(example("### A PyTorch loop: the compiler backend and `ZenFlowAdamW`"), names)
    stats = names["opt"].stats()
    # update_interval 4, select_interval 8: CPU updates of the windows closing at steps 4 and
    # 8 and of the one the final flush() closes (step 9); selections at the first step and at
    # the select boundary (step 8).
    assert (stats["steps"], stats["cpu_updates"], stats["reselections"]) == (9, 3, 2)
    assert changed(before, model)


def test_the_trainer_example_trains(tmp_path):
    model = gpt2()
    before = weights(model)
    names = dict(model=model, args=arguments(tmp_path, max_steps=4), train_set=dataset())
    exec(example("### Hugging Face Trainer"), names)
    trainer = names["trainer"]
    assert trainer.state.global_step == 4
    assert all(math.isfinite(log["loss"]) for log in trainer.state.log_history if "loss" in log)
    assert changed(before, model)


@pytest.mark.parametrize(
    "document, heading, optimizer_steps",
    [
        (README, "### Accelerate", 2),
        (ROOT / "docs" / "huggingface.md", "## Accelerate", 1),  # accumulates 2 batches a step
    ],
    ids=["readme", "guide"],
)
def test_the_accelerate_example_trains_and_saves_its_state(
    document, heading, optimizer_steps, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    model = gpt2()
    before = weights(model)
    loader = torch.utils.data.DataLoader(dataset(8), batch_size=4, collate_fn=collate)
    names = dict(model=model, loader=loader)
    exec(example(heading, document=document), names)
    assert names["opt"].optimizer.stats()["steps"] == optimizer_steps
    assert (tmp_path / "state").is_dir()
    assert changed(before, model)


class LossOfBatch(torch.nn.Module):
    """A model whose forward takes a micro-batch and returns its loss, as the DeepSpeed
    example's ``engine(batch)`` expects."""

    def __init__(self):
        super().__init__()
        self.net = mlp()

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        x, y = batch[:, :8], batch[:, 8:]
        dtype = self.net[0].weight.dtype  # the engine casts the model (bf16), not its inputs
        return F.mse_loss(self.net(x.to(dtype)).float(), y)


def run_deepspeed_example(code: str, config: dict, tmp_path: Path):
    """``code`` run in ``tmp_path`` beside ``config`` as its ds_config.json, on three
    micro-batches of rows of 8 inputs and 4 targets; returns the names it bound."""
    (tmp_path / "ds_config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(2)
    micro = config["train_micro_batch_size_per_gpu"]
    names = dict(model=LossOfBatch(), dataset=list(torch.randn(3 * micro, 12, generator=g)))
    exec(code, names)
    return names


def test_the_deepspeed_example_reads_the_readme_config_and_checkpoints(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = json.loads(example("### A DeepSpeed config: `zenflow.initialize`", "json"))
    code = example("### A DeepSpeed config: `zenflow.initialize`")
    names = run_deepspeed_example(code, config, tmp_path)
    engine = names["engine"]
    assert engine.stats()["global_steps"] == 3
    topk = config["zero_optimization"]["zenflow"]["topk_ratio"]
    assert engine.optimizer.settings.topk_ratio == topk
    assert any((tmp_path / "ckpt").iterdir())
    assert changed(weights(mlp()), engine.module.net)


def test_the_deepspeed_guide_example_resumes_and_exports(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    guide = ROOT / "docs" / "deepspeed.md"
    config = json.loads(example(None, "json", guide))
    names = run_deepspeed_example(example(None, document=guide), config, tmp_path)
    engine = names["engine"]
    assert engine.stats()["global_steps"] == 3 and names["path"] is not None
    exported = list((tmp_path / "export").iterdir())
    assert exported, "save_16bit_model wrote nothing"


def test_the_cpu_optimizer_example_steps_twice():
    g = torch.Generator().manual_seed(3)
    params = [torch.randn(1000, generator=g).requires_grad_() for _ in range(2)]
    for p in params:
        p.grad = torch.randn(1000, generator=g)
    before = [p.detach().clone() for p in params]
    reference = [p.detach().clone().requires_grad_() for p in params]
    for r, p in zip(reference, params, strict=True):
        r.grad = p.grad.clone()
    torch_opt = torch.optim.AdamW(reference, lr=1e-3)
    names = dict(params=params)
    exec(example("### The CPU optimizer on its own"), names)
    torch_opt.step()
    torch_opt.step()
    for b, p, r in zip(before, params, reference, strict=True):
        assert not torch.equal(b, p)
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-6, atol=1e-7)
