"""``.grad`` of a weight the compiled backward stages is a ``StagedGradient``: plain PyTorch
code that reads it (``torch.nn.utils.clip_grad_norm_`` in every form, ``model.zero_grad()``)
gets what it would from a materialized gradient, and anything else a clear error."""

import os

import pytest
import torch
from torch.testing import assert_close

import zenflow
from tests.models import batches, build, loss_of
from tests.ports import free_port
from zenflow.reference import ReferenceZenFlowAdamW

SCHEDULE = dict(topk_ratio=0.25, update_interval=2, select_interval=4)
TOL = dict(rtol=1e-5, atol=1e-6)


def compiled_mlp(**settings):
    model = build("mlp")
    opt = zenflow.ZenFlowAdamW(
        model.parameters(), lr=1e-2, step_backend="eager", **SCHEDULE, **settings
    )
    return model, opt, torch.compile(model, backend="zenflow", options={"inner": "eager"})


@pytest.mark.parametrize("device_sums", [False, True], ids=["host-sums", "device-sums"])
@pytest.mark.parametrize("foreach", [None, True, False])
def test_torch_clip_grad_norm_equals_the_oracle_clipped_by_torch(foreach, device_sums):
    """The oracle keeps ordinary ``.grad``s, which torch clips itself."""
    oracle_model = build("mlp")
    oracle = ReferenceZenFlowAdamW(oracle_model.parameters(), lr=1e-2, **SCHEDULE)
    model, opt, compiled = compiled_mlp(accumulate_on_device=device_sums)
    for inputs, targets in batches("mlp", 6):
        norms = []
        for m, o in ((oracle_model, oracle), (compiled, opt)):
            o.zero_grad()
            loss_of("mlp", m, inputs, targets).backward()
            norms.append(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05, foreach=foreach))
            o.step()
        assert norms[0] > 0.05
        assert_close(norms[1], norms[0], **TOL)
    assert opt.stats()["reselections"] > 0
    assert_close(list(model.parameters()), list(oracle_model.parameters()), **TOL)


def test_the_gradient_reads_as_staged_and_is_consumed_by_the_step():
    model, opt, compiled = compiled_mlp()
    inputs, targets = batches("mlp", 1)[0]
    loss_of("mlp", compiled, inputs, targets).backward()
    weight = model[0].weight
    assert isinstance(weight.grad, zenflow.StagedGradient)
    assert weight.grad.shape == weight.shape and weight.grad.dtype == weight.dtype
    assert "staged by zenflow" in repr(weight.grad)
    assert isinstance(model[0].bias.grad, torch.Tensor)  # 1-D parameters keep theirs
    opt.step()
    assert weight.grad is None


@pytest.mark.parametrize("clear", ["model.zero_grad()", "grad.zero_()"])
def test_clearing_grad_after_a_backward_drops_that_backward(clear):
    """Only the backward after the clear reaches the step, as with ordinary gradients."""
    data = batches("mlp", 2)
    twin, twin_opt, twin_compiled = compiled_mlp()
    loss_of("mlp", twin_compiled, *data[1]).backward()
    twin_opt.step()
    model, opt, compiled = compiled_mlp()
    loss_of("mlp", compiled, *data[0]).backward()
    if clear == "model.zero_grad()":
        model.zero_grad()
    else:
        for p in model.parameters():
            p.grad.zero_()
    loss_of("mlp", compiled, *data[1]).backward()
    opt.step()
    assert all(
        torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters(), strict=True)
    )


def test_an_eager_backward_into_a_staged_gradient_is_refused():
    model, _, compiled = compiled_mlp()
    inputs, targets = batches("mlp", 1)[0]
    loss_of("mlp", compiled, inputs, targets).backward()
    with pytest.raises(RuntimeError, match="run every backward of a step through the compiled"):
        loss_of("mlp", model, inputs, targets).backward()


def test_operations_it_cannot_answer_are_refused_by_name():
    model, _, compiled = compiled_mlp()
    loss_of("mlp", compiled, *batches("mlp", 1)[0]).backward()
    with pytest.raises(RuntimeError, match="clamp_.*supports the 2-norm"):
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.1)
    with pytest.raises(RuntimeError, match="norm of order inf"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm_type="inf")
    with pytest.raises(RuntimeError, match="GradScaler.unscale_.*zenflow.initialize"):
        scaler = torch.amp.GradScaler("cpu")
        scaler.scale(torch.ones(()))  # what scaling the loss does, so that unscale_ runs
        scaler.unscale_(torch.optim.SGD(model.parameters(), lr=0.1))


def _backward_under_ddp(rank: int, port: int, out_dir: str) -> None:
    """One of two gloo ranks: a compiled GPT whose optimizer stages its weights' gradients,
    wrapped in DistributedDataParallel as Trainer wraps a transformers model on several
    processes (``find_unused_parameters`` unless gradient checkpointing is on); writes what
    the backward raised."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model = build("gpt")
        opt = zenflow.ZenFlowAdamW(model.parameters(), lr=1e-2, step_backend="eager", **SCHEDULE)
        model.compile(backend="zenflow", options={"inner": "eager"})
        wrapped = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        try:
            loss_of("gpt", wrapped, *batches("gpt", 1)[0]).backward()
            raised = f"nothing raised; {opt.stats()['steps']} steps"
        except RuntimeError as error:
            raised = str(error)
    finally:
        torch.distributed.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as out:
        out.write(raised)


def test_a_distributed_data_parallel_wrapper_is_refused_with_what_to_do_instead(tmp_path):
    """Its reducer copies each .grad into a bucket: the error names the wrapper and the two
    ways that work (the model unwrapped, zenflow.initialize)."""
    torch.multiprocessing.spawn(
        _backward_under_ddp, args=(free_port(), str(tmp_path)), nprocs=2, join=True
    )
    for rank in range(2):
        raised = (tmp_path / f"rank{rank}.txt").read_text()
        assert "on the .grad of a weight owned by ZenFlowAdamW" in raised
        assert "DistributedDataParallel wrapper" in raised
        assert "leave the model unwrapped, or train data-parallel through zenflow.initialize" in (
            raised
        )


def test_clipping_some_weights_and_not_others_is_refused_at_the_step():
    model, opt, compiled = compiled_mlp()
    loss_of("mlp", compiled, *batches("mlp", 1)[0]).backward()
    torch.nn.utils.clip_grad_norm_(model[0].parameters(), 1e-3)
    with pytest.raises(RuntimeError, match="scaled .* and of others not"):
        opt.step()


def test_a_backward_after_the_norm_was_taken_is_refused():
    model, _, compiled = compiled_mlp()
    inputs, targets = batches("mlp", 1)[0]
    loss_of("mlp", compiled, inputs, targets).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(RuntimeError, match="clip after the step's last backward"):
        loss_of("mlp", compiled, inputs, targets).backward()
