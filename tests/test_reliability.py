"""Failures a days-long run meets: non-finite gradients, a failing CPU AdamW worker, corrupted
checkpoint files, misuse. Each gets a clear exception or a documented skip, and nothing that was
committed before is lost."""

import hashlib
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zenflow
from tests import engine_worker
from tests.models import batches, build, loss_of
from tests.snapshots import assert_bitwise_equal, snapshot
from zenflow.cpu_adamw import CPUAdamW
from zenflow.optimizer import NonFiniteGradientError, ZenFlowAdamW
from zenflow.runtime import checkpoint, cpu_adam

# Windows close every 2 steps, in the background with overlap_step except at select boundaries.
SETTINGS = dict(lr=1e-2, topk_ratio=0.25, update_interval=2, select_interval=8)


@pytest.fixture(autouse=True)
def no_injected_failure_left():
    yield
    cpu_adam._inject_failure_for_tests(0)


# Non-finite gradients.


def train_steps(model, opt, data):
    for inputs, targets in data:
        opt.zero_grad()
        loss_of("mlp", model, inputs, targets).backward()
        opt.step()


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("bad", ["weight-nan", "bias-inf"])
@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_nonfinite_gradient_commits_nothing(policy, bad, overlap):
    data = batches("mlp", 8)
    model = build("mlp")
    opt = ZenFlowAdamW(
        model.parameters(), step_backend="eager", nonfinite=policy, overlap_step=overlap, **SETTINGS
    )
    # Step 5: mid-window, with the window closed at step 4 still running in overlap mode.
    train_steps(model, opt, data[:5])
    assert opt.stats()["window_steps"] == 1 and opt.stats()["updates_in_flight"] == overlap
    state = snapshot(opt.state_dict())
    params = snapshot(list(model.parameters()))

    opt.zero_grad()
    loss_of("mlp", model, *data[5]).backward()
    weight, bias = model[0].weight, model[0].bias
    if bad == "weight-nan":
        weight.grad[3, 1] = float("nan")
    else:
        bias.grad[0] = float("inf")
    if policy == "raise":
        with pytest.raises(NonFiniteGradientError, match="step 6 is (nan|inf).*nothing was"):
            opt.step()
    else:
        opt.step()
        assert opt.last_step_skipped and opt.stats()["skipped_steps"] == 1
    assert_bitwise_equal(state, snapshot(opt.state_dict()))
    assert_bitwise_equal(params, snapshot(list(model.parameters())))
    assert opt.stats()["steps"] == 5

    # Training goes on as if the bad batch never came.
    train_steps(model, opt, data[6:])
    clean = build("mlp")
    clean_opt = ZenFlowAdamW(
        clean.parameters(), step_backend="eager", overlap_step=overlap, **SETTINGS
    )
    train_steps(clean, clean_opt, data[:5] + data[6:])
    opt.flush()
    clean_opt.flush()
    assert_bitwise_equal(snapshot(list(clean.parameters())), snapshot(list(model.parameters())))


def engine_config(zero: dict, **extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": zero,
        **extra,
    }


ZENFLOW_ZERO = {
    "stage": 2,
    "offload_optimizer": {"device": "cpu"},
    "zenflow": {"topk_ratio": 0.25, "update_interval": 2, "select_interval": 8},
}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def engine_step(engine, i: int, dtype=torch.float32, poison: bool = False) -> None:
    for micro in range(2):
        generator = torch.Generator().manual_seed(2 * i + micro)
        x = torch.randn(4, 8, generator=generator).to(engine.device, dtype)
        y = torch.randn(4, 4, generator=generator).to(engine.device, dtype)
        if poison:
            x[0, 0] = float("inf")
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()


@pytest.mark.parametrize(
    "precision, zero",
    [
        ("bf16", ZENFLOW_ZERO),
        ("fp32", ZENFLOW_ZERO),
        ("fp32", {"stage": 0}),  # torch.optim.AdamW
        ("bf16", {"stage": 0}),  # ZenFlowAdamW with every column on the device
    ],
    ids=["bf16-zenflow", "fp32-zenflow", "fp32-torch-adamw", "bf16-no-offload"],
)
@pytest.mark.parametrize("policy", [None, "skip"])
def test_engine_nonfinite_policy_for_bf16_and_fp32(precision, zero, policy):
    extra = {"bf16": {"enabled": True}} if precision == "bf16" else {}
    if policy is not None:
        extra["nonfinite_gradients"] = policy
    engine, optimizer, *_ = zenflow.initialize(model=mlp(), config=engine_config(zero, **extra))
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    for i in range(3):
        engine_step(engine, i, dtype)
    state = snapshot(optimizer.state_dict())
    params = snapshot(list(engine.module.parameters()))

    if policy is None:  # the default for bf16 and fp32
        with pytest.raises(zenflow.NonFiniteGradientError, match="step 4 is (nan|inf)"):
            engine_step(engine, 3, dtype, poison=True)
        assert engine.stats()["global_steps"] == 3
    else:
        engine_step(engine, 3, dtype, poison=True)
        stats = engine.stats()
        assert (stats["skipped_steps"], stats["global_steps"]) == (1, 4)
    assert_bitwise_equal(state, snapshot(optimizer.state_dict()))
    assert_bitwise_equal(params, snapshot(list(engine.module.parameters())))
    engine_step(engine, 4, dtype)  # the engine is still usable: the window was dropped
    assert not all(
        torch.equal(a, b) for a, b in zip(params, engine.module.parameters(), strict=True)
    )


def test_nonfinite_raise_is_refused_with_fp16():
    config = engine_config(ZENFLOW_ZERO, fp16={"enabled": True}, nonfinite_gradients="raise")
    with pytest.raises(zenflow.config.ConfigError, match=r"^nonfinite_gradients: .*fp16"):
        zenflow.initialize(model=mlp(), config=config)
    with pytest.raises(zenflow.config.ConfigError, match="nonfinite_gradients"):
        zenflow.initialize(
            model=mlp(), config=engine_config(ZENFLOW_ZERO, nonfinite_gradients="ignore")
        )
    with pytest.raises(ValueError, match="nonfinite must be"):
        ZenFlowAdamW(mlp().parameters(), nonfinite="ignore")


# A failing CPU AdamW worker.


def overlap_engine(overlap: bool):
    zero = {**ZENFLOW_ZERO, "zenflow": {**ZENFLOW_ZERO["zenflow"], "overlap_step": overlap}}
    engine, *_ = zenflow.initialize(model=mlp(), config=engine_config(zero))
    return engine


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_worker_failure_stops_the_engine_until_reloaded(tmp_path, overlap):
    engine = overlap_engine(overlap)
    for i in range(3):
        engine_step(engine, i)
    engine.save_checkpoint(tmp_path)
    checkpoint_bytes = (tmp_path / "global_step3" / "rank0.pt").read_bytes()

    cpu_adam._inject_failure_for_tests(1)
    failed_at = None
    for i in range(3, 9):
        try:
            engine_step(engine, i)
        except cpu_adam.CPUAdamError as error:
            assert "injected failure" in str(error)
            failed_at = i
            break
    # Windows close at steps 4, 6, 8 (1-based); overlap finds out one window later.
    assert failed_at == (5 if overlap else 3)
    assert isinstance(engine.optimizer.failure, cpu_adam.CPUAdamError)

    for attempt in (
        lambda: engine_step(engine, 10),
        lambda: engine.save_checkpoint(tmp_path, tag="after-failure"),
        engine.flush,
    ):
        with pytest.raises(RuntimeError, match=r"injected failure.*reload from a checkpoint"):
            attempt()
    assert not (tmp_path / "after-failure" / "COMMITTED").exists()
    assert (tmp_path / "latest").read_text() == "global_step3"
    assert (tmp_path / "global_step3" / "rank0.pt").read_bytes() == checkpoint_bytes

    # Reloading clears the failure; training resumes exactly as a fresh engine would.
    engine.load_checkpoint(tmp_path)
    assert engine.optimizer.failure is None
    fresh = overlap_engine(overlap)
    fresh.load_checkpoint(tmp_path)
    for i in range(3, 8):
        engine_step(engine, i)
        engine_step(fresh, i)
    engine.flush()
    fresh.flush()
    assert_bitwise_equal(
        snapshot(list(fresh.module.parameters())), snapshot(list(engine.module.parameters()))
    )


def test_worker_failure_in_flush_is_remembered():
    model = build("mlp")
    opt = ZenFlowAdamW(model.parameters(), step_backend="eager", **SETTINGS)
    train_steps(model, opt, batches("mlp", 3))
    cpu_adam._inject_failure_for_tests(1)
    with pytest.raises(cpu_adam.CPUAdamError, match="injected failure"):
        opt.flush()
    with pytest.raises(RuntimeError, match="earlier step failed.*injected failure"):
        train_steps(model, opt, batches("mlp", 1))
    with pytest.raises(RuntimeError, match="earlier step failed"):
        opt.state_dict()


def test_a_failed_window_sum_stops_the_optimizer():
    # Overlapped: a failed update would surface a window later; the sum fails sooner. A step
    # collects a queued sum once the pool has finished it, and waits for it once another one
    # queues behind it: at step 4 if the pool is done by then, at step 6 at the latest (step 4
    # folds its rows into the window's update, step 5 queues its sum).
    model = build("mlp")
    opt = ZenFlowAdamW(model.parameters(), step_backend="eager", overlap_step=True, **SETTINGS)
    data = batches("mlp", 6)
    train_steps(model, opt, data[:2])  # windows of 2: the first closes at step 2
    cpu_adam._inject_failure_for_tests(1)
    train_steps(model, opt, data[2:3])  # step 3's sum is queued on the pool, and fails there
    with pytest.raises(cpu_adam.CPUAdamError, match="injected failure"):
        train_steps(model, opt, data[3:6])
    with pytest.raises(RuntimeError, match="earlier step failed.*injected failure"):
        opt.flush()


@pytest.mark.parametrize("failing", ["job", "submission"])
def test_a_failed_update_submitted_off_the_training_thread_stops_the_optimizer(
    monkeypatch, failing
):
    """Device-side sums, overlapped: the copy stream's host thread submits a window's CPU
    update once the shipped sums land. A job that fails there, or a submission that raises,
    surfaces when the update is applied, a window later, and stops the optimizer."""
    model = build("mlp")
    opt = ZenFlowAdamW(
        model.parameters(),
        step_backend="eager",
        overlap_step=True,
        accumulate_on_device=True,
        **SETTINGS,
    )
    data = batches("mlp", 6)
    train_steps(model, opt, data[:1])
    if failing == "job":
        cpu_adam._inject_failure_for_tests(1)  # the job of the window closing at step 2
        message = "injected failure"
    else:

        def refused(*args, **kwargs):
            raise ValueError("refused by the test")

        monkeypatch.setattr(cpu_adam, "submit_adamw_step", refused)
        message = "not submitted.*refused by the test"
    with pytest.raises(cpu_adam.CPUAdamError, match=message):
        train_steps(model, opt, data[1:6])
    assert opt.stats()["steps"] == 4  # found failed when applied, at the close of step 4
    with pytest.raises(RuntimeError, match="earlier step failed"):
        opt.flush()


def test_failure_with_two_param_groups_reloads_exactly():
    def optimizer(model):
        groups = [{"params": model[0].parameters()}, {"params": model[2].parameters()}]
        return ZenFlowAdamW(groups, step_backend="eager", overlap_step=True, **SETTINGS)

    data = batches("mlp", 12)
    model = build("mlp")
    opt = optimizer(model)
    train_steps(model, opt, data[:3])
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved = opt.state_dict()
    cpu_adam._inject_failure_for_tests(1)  # group 0's job of the window closing at step 4
    with pytest.raises(cpu_adam.CPUAdamError, match="injected failure"):
        train_steps(model, opt, data[3:8])
    opt.load_state_dict(saved)  # group 1's job may still be running: waited for, not applied
    model.load_state_dict(saved_model)
    assert opt.failure is None
    fresh = build("mlp", seed=1)
    fresh.load_state_dict(saved_model)
    fresh_opt = optimizer(fresh)
    fresh_opt.load_state_dict(saved)
    train_steps(model, opt, data[3:])
    train_steps(fresh, fresh_opt, data[3:])
    opt.flush()
    fresh_opt.flush()
    assert_bitwise_equal(snapshot(list(fresh.parameters())), snapshot(list(model.parameters())))


# Corrupted checkpoint files.


def test_corrupted_checkpoint_files_are_named(tmp_path):
    engine = engine_worker.build()
    engine_worker.train(engine, 0, 2)
    engine.save_checkpoint(tmp_path, tag="good")
    engine.save_checkpoint(tmp_path, tag="flipped")
    rank_file = tmp_path / "flipped" / "rank0.pt"
    data = bytearray(rank_file.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside tensor data: torch.load alone would not notice
    rank_file.write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match=f"{rank_file} is truncated or corrupted: its SHA-256"):
        engine.load_checkpoint(tmp_path, tag="flipped")

    marker = tmp_path / "good" / "COMMITTED"
    committed = marker.read_bytes()
    for garbage in (b"\x00\xff garbage", b"[1, 2]", b'{"world_size": 1}'):
        marker.write_bytes(garbage)
        with pytest.raises(RuntimeError, match=f"marker {marker} is corrupted"):
            engine.load_checkpoint(tmp_path, tag="good")
    marker.write_bytes(committed)
    path, _ = engine.load_checkpoint(tmp_path, tag="good")
    assert path == str(tmp_path / "good" / "rank0.pt")

    (tmp_path / "latest").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(RuntimeError, match=f"{tmp_path / 'latest'} is corrupted"):
        engine.load_checkpoint(tmp_path)
    (tmp_path / "good" / "rank0.pt").unlink()
    with pytest.raises(RuntimeError, match="rank0.pt is missing although tag 'good'"):
        engine.load_checkpoint(tmp_path, tag="good")


class ClientObject:
    """A client_state entry of the user's own class (not plain data)."""

    def __init__(self, value):
        self.value = value


class _RunsCodeWhenUnpickled:
    """What a crafted checkpoint file would hold: unpickling it creates a file."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _commit_as_is(rank_file) -> None:
    """Record ``rank_file``'s digest in its tag's marker, as a forger who rewrote both would."""
    marker = rank_file.parent / checkpoint.MARKER
    committed = json.loads(marker.read_text())
    committed["sha256"][0] = hashlib.sha256(rank_file.read_bytes()).hexdigest()
    marker.write_text(json.dumps(committed))


def test_a_crafted_pickle_in_a_rank_file_is_refused_without_running(tmp_path):
    engine = engine_worker.build()
    engine_worker.train(engine, 0, 2)
    engine.save_checkpoint(tmp_path, tag="crafted")
    rank_file = tmp_path / "crafted" / "rank0.pt"
    ran = tmp_path / "code-ran"
    state = torch.load(rank_file, weights_only=True)
    state["client_state"] = {"payload": _RunsCodeWhenUnpickled(str(ran))}
    torch.save(state, rank_file)
    _commit_as_is(rank_file)
    with pytest.raises(RuntimeError, match="objects other than tensors and plain values"):
        engine.load_checkpoint(tmp_path, tag="crafted")
    assert not ran.exists()


def test_a_client_state_of_other_objects_loads_only_from_a_trusted_file(tmp_path):
    engine = engine_worker.build()
    engine_worker.train(engine, 0, 2)
    engine.save_checkpoint(tmp_path, client_state={"plain": [1, 2.5, "x"]})
    assert engine.load_checkpoint(tmp_path)[1] == {"plain": [1, 2.5, "x"]}
    engine.save_checkpoint(tmp_path, client_state={"mine": ClientObject(7)})
    with pytest.raises(RuntimeError, match="client_state_from_trusted_file=True"):
        engine.load_checkpoint(tmp_path)
    _, client_state = engine.load_checkpoint(tmp_path, client_state_from_trusted_file=True)
    assert client_state["mine"].value == 7


# Misuse.


def test_step_without_backward_is_refused():
    model = build("mlp")
    opt = ZenFlowAdamW(model.parameters(), step_backend="eager", **SETTINGS)
    with pytest.raises(RuntimeError, match=r"step\(\) without gradients.*backward\(\)"):
        opt.step()
    train_steps(model, opt, batches("mlp", 1))
    opt.zero_grad()
    with pytest.raises(RuntimeError, match=r"step\(\) without gradients"):
        opt.step()
    assert opt.stats()["steps"] == 1


def test_two_step_async_calls_without_wait_are_refused():
    p = torch.randn(1000, requires_grad=True)
    opt = CPUAdamW([p])
    p.grad = torch.randn(1000)
    handle = opt.step_async()
    for call in (opt.step_async, opt.step):
        with pytest.raises(RuntimeError, match=r"previous step_async\(\) is in flight.*wait\(\)"):
            call()
    handle.wait()
    before = p.detach().clone()
    opt.step_async().wait()
    assert not torch.equal(before, p)

    cpu_adam._inject_failure_for_tests(1)
    with pytest.raises(cpu_adam.CPUAdamError):
        opt.step_async().wait()
    opt.step()  # a failure raised by wait() is not raised a second time


def test_parameters_on_mixed_devices_are_refused():
    on_cpu = nn.Parameter(torch.randn(4, 3))
    on_meta = nn.Parameter(torch.randn(5, device="meta"))
    with pytest.raises(ValueError, match=r"one device; found .* on cpu, .* on meta"):
        ZenFlowAdamW([on_cpu, on_meta], step_backend="eager")
    with pytest.raises(ValueError, match="is on meta"):
        CPUAdamW([on_cpu, on_meta])


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_parameter_replaced_after_initialize_is_refused(compiled):
    engine, *_ = zenflow.initialize(model=mlp(), config=engine_config(ZENFLOW_ZERO))
    if compiled:
        engine.compile(options={"inner": "eager"})
    engine_step(engine, 0)
    engine.module[2].weight = nn.Parameter(torch.randn(4, 16, device=engine.device))
    with pytest.raises(RuntimeError, match=r"parameter '2.weight' was replaced"):
        engine_step(engine, 1)


def test_a_1d_parameter_given_new_memory_of_its_shape_is_updated_there():
    """``p.data = p.data.clone()`` between steps (memory of the same shape and dtype, as
    ``module.to(other).to(back)`` leaves it): the device update writes into the new memory,
    and training goes on as it would have without the change."""
    data = batches("mlp", 6)
    models = [build("mlp"), build("mlp")]
    opts = [ZenFlowAdamW(m.parameters(), step_backend="eager", **SETTINGS) for m in models]
    for model, opt in zip(models, opts, strict=True):
        train_steps(model, opt, data[:3])
    moved = models[1][0].bias
    moved.data = moved.data.clone()
    for model, opt in zip(models, opts, strict=True):
        train_steps(model, opt, data[3:])
    assert_bitwise_equal(snapshot(models[1].state_dict()), snapshot(models[0].state_dict()))
    assert not torch.equal(models[1][0].bias, build("mlp")[0].bias)


def test_parameter_resized_in_place_is_refused():
    model = build("mlp")
    opt = ZenFlowAdamW(model.parameters(), step_backend="eager", **SETTINGS)
    train_steps(model, opt, batches("mlp", 1))
    model[2].weight.data = torch.randn(3, 20)
    with pytest.raises(RuntimeError, match=r"changed shape to \[3, 20\].*16 columns"):
        opt.step()
    model[2].weight.data = torch.randn(3, 16)
    model[2].bias.data = torch.randn(5)
    with pytest.raises(RuntimeError, match=r"changed shape to \[5\].*3 elements"):
        opt.step()
