"""zenflow.initialize and its engine: numerics against oracles, precision, checkpoints, export."""

import argparse
import json
import os
import re
import socket
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import zenflow
from tests import engine_worker
from tests.snapshots import assert_bitwise_equal, snapshot
from zenflow.adamw import PlainAdamW
from zenflow.optimizer import ZenFlowAdamW
from zenflow.reference import ReferenceZenFlowAdamW
from zenflow.runtime.state_schema import saved_weights

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The engine puts the model on the GPU when there is one; inputs and baselines follow it.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ADAMW = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.01}
ZENFLOW = {"topk_ratio": 0.25, "update_interval": 2, "select_interval": 4}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def config(zero: dict, accumulation: int = 2, clipping: float = 0.5, **extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": accumulation,
        "optimizer": {"type": "AdamW", "params": dict(ADAMW)},
        "gradient_clipping": clipping,
        "zero_optimization": zero,
        **extra,
    }


def zenflow_zero(**settings) -> dict:
    block = {**ZENFLOW, **settings}
    return {"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": block}


def batch(i: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(i)
    x = torch.randn(4, 8, generator=generator)
    y = torch.randn(4, 4, generator=generator)
    return x.to(DEVICE, dtype), y.to(DEVICE, dtype)


def train(engine, steps: int, start: int = 0, dtype=torch.float32) -> None:
    accumulation = engine.gradient_accumulation_steps()
    for step in range(start, start + steps):
        for micro in range(accumulation):
            x, y = batch(step * accumulation + micro, dtype)
            engine.backward(F.mse_loss(engine(x), y))
            engine.step()


def train_by_hand(model, optimizer, steps: int, accumulation: int, clipping=0.0, start=0):
    for step in range(start, start + steps):
        for micro in range(accumulation):
            x, y = batch(step * accumulation + micro)
            (F.mse_loss(model(x), y) / accumulation).backward()
        if clipping:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clipping)
        optimizer.step()
        optimizer.zero_grad()


def test_zenflow_config_equals_reference_with_accumulation_and_clipping():
    engine, optimizer, loader, scheduler = zenflow.initialize(
        model=mlp(), config=config(zenflow_zero())
    )
    assert isinstance(optimizer, ZenFlowAdamW) and optimizer is engine.optimizer
    assert (loader, scheduler) == (None, None)
    assert (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu()) == (8, 4)
    assert engine.gradient_accumulation_steps() == 2
    assert optimizer.max_grad_norm == 0.5
    assert {p.device.type for p in engine.module.parameters()} == {engine.device.type}

    model = mlp().to(DEVICE)
    reference = ReferenceZenFlowAdamW(model.parameters(), **ADAMW, **ZENFLOW, max_grad_norm=0.5)
    for step in range(8):
        train(engine, 1, start=step)
        train_by_hand(model, reference, 1, accumulation=2, start=step)
        for mine, theirs in zip(engine.module.parameters(), model.parameters(), strict=True):
            assert_close(mine, theirs, rtol=1e-5, atol=1e-6, msg=f"step {step}")
    stats = engine.stats()
    assert (stats["global_steps"], stats["micro_steps"], stats["steps"]) == (8, 16, 8)
    assert stats["reselections"] == reference.reselections == 3 and stats["skipped_steps"] == 0


@pytest.mark.parametrize(
    "zero",
    [{"stage": 0}, {"stage": 2, "offload_optimizer": {"device": "cpu"}}],
    ids=["stage0", "offload"],
)
def test_zenflow_less_configs_equal_torch_adamw(zero):
    engine, optimizer, _, _ = zenflow.initialize(model=mlp(), config=config(zero))
    if "offload_optimizer" in zero:
        # ZeRO-Offload: every column on the host, one CPU update per step.
        assert isinstance(optimizer, ZenFlowAdamW)
        assert (optimizer.settings.topk_ratio, optimizer.settings.update_interval) == (0.0, 1)
    else:
        assert type(optimizer) is PlainAdamW and isinstance(optimizer, torch.optim.AdamW)
    model = mlp().to(DEVICE)
    baseline = torch.optim.AdamW(model.parameters(), **ADAMW)
    train(engine, 5)
    train_by_hand(model, baseline, 5, accumulation=2, clipping=0.5)
    for mine, theirs in zip(engine.module.parameters(), model.parameters(), strict=True):
        assert_close(mine, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kernel", ["fused", "foreach"])
def test_plain_adamw_takes_torch_kernel_choice_from_the_config(kernel):
    settings = config({"stage": 0})
    settings["optimizer"]["params"][kernel] = True
    engine, optimizer, _, _ = zenflow.initialize(model=mlp(), config=settings)
    assert all(group[kernel] for group in optimizer.param_groups)
    model = mlp().to(DEVICE)
    baseline = torch.optim.AdamW(model.parameters(), **ADAMW, **{kernel: True})
    train(engine, 3)
    train_by_hand(model, baseline, 3, accumulation=2, clipping=0.5)
    for mine, theirs in zip(engine.module.parameters(), model.parameters(), strict=True):
        assert_close(mine, theirs, rtol=1e-5, atol=1e-6)


def test_fused_and_foreach_together_are_refused():
    settings = config({"stage": 0})
    settings["optimizer"]["params"].update(fused=True, foreach=True)
    with pytest.raises(zenflow.ConfigError, match="optimizer.params.fused: true with foreach"):
        zenflow.initialize(model=mlp(), config=settings)


def test_warmup_lr_from_the_config_steps_per_global_step_like_deepspeed():
    from deepspeed.runtime.lr_schedules import WarmupLR

    params = {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 4}
    schedule = {"type": "WarmupLR", "params": params}
    engine, _, _, scheduler = zenflow.initialize(
        model=mlp(), config=config(zenflow_zero(), scheduler=schedule)
    )
    assert isinstance(scheduler, WarmupLR) and scheduler is engine.lr_scheduler
    expected = WarmupLR(torch.optim.AdamW(mlp().parameters(), lr=1.0), **params)
    for step in range(6):
        assert engine.get_lr() == pytest.approx(expected.get_lr()), f"step {step}"
        x, y = batch(step)
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
        # Not at the accumulation boundary: the schedule has not moved.
        assert engine.get_lr() == pytest.approx(expected.get_lr())
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
        expected.step()
    assert engine.global_steps == 6


def fp16_engine(lr_scheduler=None):
    fp16 = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1, "loss_scale_window": 100}
    engine, *_ = zenflow.initialize(
        model=mlp(), config=config(zenflow_zero(), fp16=fp16), lr_scheduler=lr_scheduler
    )
    return engine


def fp16_step(engine, i: int, overflow: bool = False) -> None:
    for micro in range(2):
        x, y = batch(2 * i + micro, torch.float16)
        if overflow:
            x[0, 0] = float("inf")
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()


def test_fp16_overflow_skips_the_step_and_halves_the_scale():
    def schedule(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.9**step)

    engine = fp16_engine(schedule)
    assert next(engine.module.parameters()).dtype == torch.float16
    assert engine.stats()["loss_scale"] == 256.0
    fp16_step(engine, 0)
    params = [p.clone() for p in engine.module.parameters()]
    optimizer_state = snapshot(engine.optimizer.state_dict())
    lr = engine.get_lr()

    fp16_step(engine, 1, overflow=True)
    stats = engine.stats()
    assert (stats["skipped_steps"], stats["global_steps"], stats["steps"]) == (1, 2, 1)
    assert stats["loss_scale"] == 128.0
    assert engine.get_lr() == lr  # the schedule did not advance
    assert stats["window_steps"] == 1  # the skip does not count toward update_interval
    for before, after in zip(params, engine.module.parameters(), strict=True):
        assert torch.equal(before, after)
    assert_bitwise_equal(optimizer_state, snapshot(engine.optimizer.state_dict()))

    # The next good step closes the window, exactly as a run that never saw the bad batch.
    fp16_step(engine, 2)
    assert engine.stats()["window_steps"] == 0 and engine.stats()["cpu_updates"] == 1
    clean = fp16_engine(schedule)
    fp16_step(clean, 0)
    fp16_step(clean, 2)
    for mine, theirs in zip(engine.module.parameters(), clean.module.parameters(), strict=True):
        assert_close(mine, theirs)


def test_loss_scaler_follows_deepspeed_hysteresis_and_window():
    from zenflow.loss_scaler import LossScaler

    scaler = LossScaler(8.0, dynamic=True, window=2, hysteresis=2, min_scale=2.0)
    scales = []
    for overflow in [True, True, True, False, False, False, True, True, True]:
        scaler.update(overflow)
        scales.append(scaler.scale)
    # The first overflow is absorbed by hysteresis; the scale grows after 2 good steps and
    # refills the hysteresis; it never drops below min_scale.
    assert scales == [8.0, 4.0, 2.0, 2.0, 2.0, 4.0, 4.0, 2.0, 2.0]


@pytest.mark.parametrize("zero", [zenflow_zero(), {"stage": 0}], ids=["zenflow", "stage0"])
def test_bf16_trains_with_fp32_masters(zero):
    engine, optimizer, _, _ = zenflow.initialize(
        model=mlp(), config=config(zero, bf16={"enabled": True})
    )
    assert isinstance(optimizer, ZenFlowAdamW)
    assert all(p.dtype == torch.bfloat16 for p in engine.module.parameters())
    saved = optimizer.state_dict()
    assert all(master.dtype == torch.float32 for master, *_ in saved["vectors"])
    assert all(weight["host"][0].dtype == torch.float32 for weight in saved_weights(saved))
    assert all(weight["device"][0].dtype == torch.float32 for weight in saved_weights(saved))
    x, y = batch(0, torch.bfloat16)
    losses = []
    for _ in range(30):
        for _ in range(2):
            loss = F.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_checkpoint_resumes_bitwise_in_a_fresh_process(tmp_path):
    straight = engine_worker.build()
    engine_worker.train(straight, 0, 20)
    expected = engine_worker.results(straight)

    first = engine_worker.build()
    engine_worker.train(first, 0, 10)
    # Mid-window (2 of 4 steps) with the window closed at step 8 still running on the CPU.
    assert first.stats()["window_steps"] == 2
    first.save_checkpoint(tmp_path, client_state={"epoch": 3})
    saved = torch.load(tmp_path / "global_step10" / "rank0.pt", weights_only=False)
    assert any(weight["pending"] for weight in saved_weights(saved["optimizer"]))
    assert (tmp_path / "latest").read_text() == "global_step10"
    assert sorted(os.listdir(tmp_path / "global_step10")) == ["COMMITTED", "rank0.pt"]

    out = tmp_path / "resumed.pt"
    run = subprocess.run(
        [sys.executable, "-m", "tests.engine_worker", str(tmp_path), str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    resumed = torch.load(out, weights_only=False)
    assert resumed["client_state"] == {"epoch": 3}
    for kind in ("raw", "flushed"):
        for name, value in expected[kind].items():
            assert torch.equal(resumed[kind][name], value), f"{kind} {name}"


def test_load_refuses_uncommitted_and_corrupted_checkpoints(tmp_path):
    engine = engine_worker.build()
    assert engine.load_checkpoint(tmp_path) == (None, None)
    engine_worker.train(engine, 0, 2)
    engine.save_checkpoint(tmp_path, tag="good")
    # A save that died before its commit: latest still names the committed tag.
    (tmp_path / "torn").mkdir()
    (tmp_path / "torn" / "rank0.pt").write_bytes(b"partial")
    path, _ = engine.load_checkpoint(tmp_path)
    assert path == str(tmp_path / "good" / "rank0.pt")
    with pytest.raises(RuntimeError, match=r"tag 'torn' \(.*\) is incomplete"):
        engine.load_checkpoint(tmp_path, tag="torn")
    assert engine.load_checkpoint(tmp_path, tag="missing") == (None, None)

    rank_file = tmp_path / "good" / "rank0.pt"
    rank_file.write_bytes(rank_file.read_bytes()[:1000])
    with pytest.raises(
        RuntimeError, match=f"{re.escape(str(rank_file))} is truncated or corrupted"
    ):
        engine.load_checkpoint(tmp_path, tag="good")

    (tmp_path / "good" / "COMMITTED").write_text(json.dumps({"world_size": 2}))
    with pytest.raises(RuntimeError, match="corrupted \\(no SHA-256 for rank 0"):
        engine.load_checkpoint(tmp_path, tag="good")


def test_save_inside_an_accumulation_window_is_refused(tmp_path):
    engine = engine_worker.build()
    x, y = batch(0)
    engine.backward(F.mse_loss(engine(x), y))
    with pytest.raises(RuntimeError, match="inside a gradient accumulation window"):
        engine.save_checkpoint(tmp_path)
    engine.step()
    with pytest.raises(RuntimeError, match="inside a gradient accumulation window"):
        engine.save_checkpoint(tmp_path)
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_consolidated_fp32_state_dict_loads_into_a_plain_model(precision):
    extra = {"bf16": {"enabled": True}} if precision == "bf16" else {}
    engine, *_ = zenflow.initialize(
        model=mlp(), config=config(zenflow_zero(overlap_step=True), **extra)
    )
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    train(engine, 7, dtype=dtype)  # leaves an overlapped update pending and a window open
    state = engine.consolidated_fp32_state_dict()
    assert all(value.dtype == torch.float32 for value in state.values())
    plain = mlp().to(DEVICE)
    plain.load_state_dict(state)
    x, _ = batch(100)
    if precision == "fp32":
        # Both models' weights are contiguous: the same kernels, the same bits.
        assert torch.equal(plain(x), engine(x))
    else:
        # The masters' exact values: the bf16 weights are them, rounded.
        for name, value in engine.module.state_dict().items():
            assert torch.equal(state[name].to(torch.bfloat16), value)
        assert any(
            not torch.equal(state[n], v.float()) for n, v in engine.module.state_dict().items()
        )


def test_save_16bit_model_writes_bf16_weights(tmp_path):
    engine, *_ = zenflow.initialize(model=mlp(), config=config(zenflow_zero(overlap_step=True)))
    train(engine, 3)
    assert engine.save_16bit_model(tmp_path) is True
    state = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    assert all(value.dtype == torch.bfloat16 for value in state.values())
    assert state.keys() == engine.module.state_dict().keys()
    for name, value in engine.module.state_dict().items():
        assert torch.equal(state[name], value.to(torch.bfloat16))


def test_training_data_gives_the_loader_and_the_epoch_length():
    samples = torch.utils.data.TensorDataset(torch.randn(40, 8), torch.randn(40, 4))
    seen = []

    def collate(items):
        seen.append(len(items))
        return torch.utils.data.default_collate(items)

    zero = zenflow_zero(select_strategy="epoch", select_interval=1)
    engine, optimizer, loader, _ = zenflow.initialize(
        model=mlp(), config=config(zero), training_data=samples, collate_fn=collate
    )
    assert loader is engine.training_dataloader and len(loader) == 10
    # 10 micro-batches, 2 per step: an epoch is 5 optimizer steps, rounded up to update_interval.
    assert optimizer.settings.select_interval_steps == 6
    x, y = next(iter(loader))
    assert x.shape == (4, 8) and seen == [4]


def test_args_deepspeed_config_is_read(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config({"stage": 0})))
    args = argparse.Namespace(deepspeed_config=str(path), local_rank=0)
    engine, *_ = zenflow.initialize(model=mlp(), args=args)
    assert engine.train_batch_size() == 8
    with pytest.raises(ValueError, match="two configs"):
        zenflow.initialize(model=mlp(), args=args, config=config({"stage": 0}))


def test_usage_errors_are_clear():
    engine, *_ = zenflow.initialize(model=mlp(), config=config(zenflow_zero()))
    with pytest.raises(RuntimeError, match=r"step\(\) before any engine.backward\(\)"):
        engine.step()
    x, y = batch(0)
    with torch.no_grad():
        loss = F.mse_loss(engine(x), y)
    with pytest.raises(RuntimeError, match="does not require grad"):
        engine.backward(loss)
    # Two backward passes in one micro-step accumulate, as in PyTorch.
    loss = F.mse_loss(engine(x), y)
    engine.backward(loss, retain_graph=True)
    once = engine.module[0].bias.grad.clone()
    engine.backward(loss)
    assert_close(engine.module[0].bias.grad, 2 * once)


def test_compile_routes_calls_through_the_compiled_module():
    reference, *_ = zenflow.initialize(model=mlp(), config=config(zenflow_zero()))
    engine, *_ = zenflow.initialize(model=mlp(), config=config(zenflow_zero()))
    module = engine.module
    engine.compile(options={"inner": "eager"})
    assert engine.module is module
    assert engine.optimizer.step_backend == "eager"
    train(engine, 2)
    train(reference, 2)
    for mine, theirs in zip(engine.module.parameters(), reference.module.parameters(), strict=True):
        assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    assert engine.module[0].weight.grad is None  # gradients came through the graph


def test_compile_with_inductor_compiles_the_optimizer_step_too():
    engine, *_ = zenflow.initialize(model=mlp(), config=config(zenflow_zero()))
    assert engine.optimizer.step_backend == "eager"  # not compiled: nothing is compiled
    engine.compile()  # compiles lazily: nothing runs here
    assert engine.optimizer.step_backend == "inductor"


def test_checkpoint_holds_loss_scale_and_counters(tmp_path):
    engine = fp16_engine()
    fp16_step(engine, 0)
    fp16_step(engine, 1, overflow=True)
    engine.save_checkpoint(tmp_path, tag="after-overflow")
    resumed = fp16_engine()
    path, client_state = resumed.load_checkpoint(tmp_path)
    assert path == str(tmp_path / "after-overflow" / "rank0.pt") and client_state == {}
    wanted = ("loss_scale", "skipped_steps", "global_steps", "micro_steps", "steps")
    assert {k: resumed.stats()[k] for k in wanted} == {k: engine.stats()[k] for k in wanted}
    assert resumed.stats()["loss_scale"] == 128.0


def test_launcher_environment_initializes_torch_distributed(monkeypatch, tmp_path):
    import torch.distributed as dist

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    launcher = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    for name, value in {**launcher, "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    samples = torch.utils.data.TensorDataset(torch.randn(16, 8), torch.randn(16, 4))
    try:
        engine, _, loader, _ = zenflow.initialize(
            model=mlp(), config=config(zenflow_zero()), training_data=samples
        )
        assert dist.is_initialized()
        assert dist.get_backend() == ("nccl" if torch.cuda.is_available() else "gloo")
        assert isinstance(loader.sampler, torch.utils.data.DistributedSampler)
        for x, y in loader:
            engine.backward(F.mse_loss(engine(x.to(DEVICE)), y.to(DEVICE)))
            engine.step()
        engine.save_checkpoint(tmp_path)  # the barriers run
        assert (tmp_path / "global_step2" / "COMMITTED").exists()
    finally:
        dist.destroy_process_group()


def test_model_parameters_as_param_groups():
    model = mlp()
    biases = [p for p in model.parameters() if p.dim() == 1]
    weights = [p for p in model.parameters() if p.dim() == 2]
    groups = [{"params": weights}, {"params": biases, "lr": 0.0}]
    engine, optimizer, _, _ = zenflow.initialize(
        model=model, model_parameters=groups, config=config(zenflow_zero())
    )
    before = [p.clone() for p in biases + weights]
    train(engine, 2)
    assert engine.get_lr() == [ADAMW["lr"], 0.0]
    # lr 0 still decays nothing and moves nothing; the weights do train.
    assert all(torch.equal(b, p) for b, p in zip(before[:2], biases, strict=True))
    assert not any(torch.equal(b, p) for b, p in zip(before[2:], weights, strict=True))


def _fp32_parameters_rank(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    from tests.distributed_worker import train as train_ranks

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        settings = dict(lr=1e-2, topk_ratio=0.25, update_interval=2, select_interval=4)
        model, optimizer = train_ranks(2, rank, {**settings, "overlap_step": True})
        values = optimizer.fp32_parameters()
        matches = [torch.equal(values[p], p.detach()) for p in model.parameters()]
        torch.save(matches, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_fp32_parameters_gathers_every_ranks_host_rows(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    torch.multiprocessing.spawn(
        _fp32_parameters_rank, args=(port, str(tmp_path)), nprocs=2, join=True
    )
    for rank in range(2):
        matches = torch.load(tmp_path / f"rank{rank}.pt")
        assert matches and all(matches), f"rank {rank}: {matches}"


def test_adaptive_update_interval_from_the_config():
    zero = zenflow_zero(update_interval="auto", auto_ratio=0.5)
    engine, optimizer, _, _ = zenflow.initialize(model=mlp(), config=config(zero))
    assert optimizer.settings.update_interval == "auto"
    assert optimizer.settings.auto_ratio == 0.5  # the config's, not the default
    train(engine, 4)
    assert engine.stats()["steps"] == 4


def test_zenflow_extensions_from_the_config_reach_the_optimizer():
    zero = zenflow_zero(
        accumulate_on_device=True,
        update_interval="auto",
        min_update_interval=2,
        max_update_interval=5,
    )
    engine, optimizer, _, _ = zenflow.initialize(model=mlp(), config=config(zero))
    assert optimizer.settings.accumulate_on_device
    settings = optimizer.settings
    assert (settings.min_update_interval, settings.max_update_interval) == (2, 5)
    train(engine, 6)
    assert optimizer.stats()["cpu_updates"] >= 1
