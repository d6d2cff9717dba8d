"""The CUDA paths: copy streams, pinned host state, compiled training, NCCL with one rank.

Every test here carries the ``cuda`` marker. ``make test`` deselects them (``-m "not cuda"``):
they are not skipped on a CPU machine, they are not collected for the run at all.
``benchmarks/gpu_check.sh`` runs them on a GPU machine (``python -m pytest -m cuda``). Run on a
machine without CUDA, they fail (loudly) rather than skip.

Placement the runtime promises, checked along the way: host state (fp32 master, moments, step
counts of the unselected columns) on the CPU, pinned when the parameter is on CUDA; device
state (selected columns, 1-D parameters) on the parameter's device, or on the CPU with
``offload``. Matmuls run in full fp32 (TF32 off), so compiled runs match the eager oracle
within rtol 1e-4, atol 1e-5.
"""

import datetime
import json

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

import zenflow
from tests.models import batches, build, loss_of
from tests.ports import free_port
from tests.zero_configs import overlapped_zenflow_zero
from zenflow import report
from zenflow.optimizer import ZenFlowAdamW
from zenflow.reference import ReferenceZenFlowAdamW
from zenflow.runtime import core_binding, cpu_adam
from zenflow.runtime.comm import DataParallel
from zenflow.runtime.host_sync import HostSync
from zenflow.runtime.owned_weight import OwnedWeight
from zenflow.runtime.state_schema import saved_weights
from zenflow.runtime.streams import CopyStream, copy_stream

pytestmark = pytest.mark.cuda

GPU_TOL = dict(rtol=1e-4, atol=1e-5)
SCHEDULE = dict(lr=1e-2, weight_decay=0.01, topk_ratio=0.25, update_interval=2, select_interval=4)
RUNTIME_ONLY = ("offload", "accumulate_on_device", "zero_stage")  # where, not what


@pytest.fixture(autouse=True)
def cuda_fp32():
    """A CUDA device, and full fp32 matmuls (TF32 would cost three decimal digits)."""
    if not torch.cuda.is_available():
        pytest.fail(
            "tests/test_cuda.py needs a CUDA device; on a machine without one, deselect these "
            'tests with -m "not cuda" (as make test does)'
        )
    torch._dynamo.reset()  # each test compiles afresh: no cache entry limit across tests
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield torch.device("cuda", torch.cuda.current_device())
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
        torch.cuda.synchronize()


def on(device, data):
    return [(x.to(device), y.to(device)) for x, y in data]


def train(model, opt, data, name="mlp"):
    for inputs, targets in data:
        opt.zero_grad()
        loss_of(name, model, inputs, targets).backward()
        opt.step()


def zenflow_run(device, inner, steps=12, flush=False, **settings):
    """The MLP trained on ``device`` by ZenFlowAdamW through backend "zenflow"."""
    hyper = {**SCHEDULE, **settings}
    model = build("mlp").to(device)
    opt = ZenFlowAdamW(model.parameters(), step_backend=inner, **hyper)
    compiled = torch.compile(model, backend="zenflow", options={"inner": inner})
    train(compiled, opt, on(device, batches("mlp", steps)))
    if flush:
        opt.flush()
    return model, opt


def reference_run(device, steps=12, flush=False, **settings):
    hyper = {k: v for k, v in {**SCHEDULE, **settings}.items() if k not in RUNTIME_ONLY}
    model = build("mlp").to(device)
    opt = ReferenceZenFlowAdamW(model.parameters(), **hyper)
    train(model, opt, on(device, batches("mlp", steps)))
    if flush:
        opt.flush()
    return model, opt


def assert_placement(opt: ZenFlowAdamW, device: torch.device, offload: bool = False) -> None:
    state_device = "cpu" if offload else device.type
    saved = opt.state_dict()
    for weight in saved_weights(saved):
        *fp32, steps = weight["host"]
        for host in fp32:
            assert host.device.type == "cpu" and host.is_pinned()
        assert steps.device.type == "cpu"
        for state in weight["device"]:
            assert state.device.type == state_device
    for vector in saved["vectors"]:
        assert all(t.device.type == device.type for t in vector)


# Copy streams.


def test_copy_to_host_keeps_the_source_as_it_was_at_the_call(cuda_fp32):
    for dtype in (torch.float32, torch.bfloat16):
        source = torch.randn(1024, 512, device=cuda_fp32).to(dtype)
        expected = source.cpu()
        pending = CopyStream(cuda_fp32).copy_to_host(source)
        source.fill_(-7.0)  # a compiled graph reusing the buffer right after the hand-off
        source.mul_(3.0)
        host = pending.wait(HostSync())
        assert host.device.type == "cpu" and host.is_pinned() and host.dtype == dtype
        assert torch.equal(host, expected)


def test_copy_to_host_completes_while_later_compute_still_runs(cuda_fp32):
    """The copy runs on a side stream: it does not wait for work queued after the call."""
    source = torch.randn(256, 1024, device=cuda_fp32)
    expected = source.cpu()
    pending = CopyStream(cuda_fp32).copy_to_host(source)
    # Work queued on the current stream after the hand-off: a spin kernel of ~0.5 s or more
    # (1e9 clock cycles; at most ~2 GHz), then an event to tell whether it has finished.
    torch.cuda._sleep(1_000_000_000)
    after_compute = torch.cuda.Event()
    after_compute.record()
    host = pending.wait(HostSync())
    still_running = not after_compute.query()
    torch.cuda.synchronize()
    assert torch.equal(host, expected)
    assert still_running, "the device-to-host copy waited for compute queued after it"


def test_an_owned_source_is_copied_without_a_snapshot(cuda_fp32):
    source = torch.randn(1024, 1024, device=cuda_fp32)
    expected = source.cpu()
    out = torch.empty(1024, 1024, pin_memory=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(cuda_fp32)
    pending = CopyStream(cuda_fp32).copy_to_host(source, out=out, owned=True)
    assert torch.cuda.memory_allocated(cuda_fp32) == before  # no device-side clone
    del source  # the side stream keeps it alive until the copy is done
    assert torch.equal(pending.wait(HostSync()), expected)


def test_copy_to_device_overlaps_work_queued_before_it_and_orders_work_after(cuda_fp32):
    source = torch.randn(256, 1024).pin_memory()
    stream = CopyStream(cuda_fp32)
    stream.copy_to_device(source)  # freed at once: the side stream's allocator caches a block
    torch.cuda.synchronize()
    # Work queued before the call: a spin kernel of ~0.5 s or more.
    torch.cuda._sleep(1_000_000_000)
    before_done = torch.cuda.Event()
    before_done.record()
    on_device, pending = stream.copy_to_device(source)
    assert pending.wait(HostSync()) is source  # the host buffer is free while the spin still runs
    overlapped = not before_done.query()
    doubled = on_device * 2  # queued on the current stream: waits for the copy on the device
    assert overlapped, "the host-to-device copy waited for compute queued before it"
    assert torch.equal(doubled.cpu(), source * 2)


def test_written_columns_leave_from_a_pinned_buffer_not_the_host_master(cuda_fp32):
    """The next overlapped CPU update rewrites the host master as soon as the write returns:
    what reaches the bf16 parameter is the master as it was at the call."""
    param = torch.nn.Parameter(torch.randn(8, 16, device=cuda_fp32).to(torch.bfloat16))
    w = OwnedWeight(param, 0, DataParallel(), offload=False, device_sums=False, sync=HostSync())
    w.reselect(torch.tensor([1, 5, 9]))
    layout = w.layout
    columns = layout.on(cuda_fp32, "unselected")
    for round_value in (3.0, -2.0):
        master = w.state.host_master[layout.k_local :]
        master.fill_(round_value)
        w.write_rows(master, False, columns, layout.unselected_counts)
        master.fill_(99.0)  # the next CPU update, before the transfer is done
        torch.cuda.synchronize()
        unselected = param.detach().t()[layout.host_columns]
        assert torch.equal(
            unselected.float().cpu(), torch.full_like(unselected.float().cpu(), round_value)
        )


@pytest.mark.parametrize("warm_up", [0, 2])
def test_an_fp32_models_updated_columns_cross_from_the_cpu_updates_own_copy(cuda_fp32, warm_up):
    """The CPU update copies an fp32 weight's new rows into a pinned buffer as it computes
    them, and every weight's rows cross to the device in one copy: the write neither converts
    nor copies on the training thread (warm-up steps, synchronous and overlapped windows)."""
    written, sent = [], []
    write_rows = OwnedWeight.write_rows
    copy_to_device = CopyStream.copy_to_device

    def recording_write_rows(self, mine, copied, columns, counts, ascending=None, also=()):
        written.append((copied, mine.device.type, mine.dtype))
        return write_rows(self, mine, copied, columns, counts, ascending, also)

    def recording_copy_to_device(self, source):
        sent.append((source.is_pinned(), source.numel()))
        return copy_to_device(self, source)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(OwnedWeight, "write_rows", recording_write_rows)
        patch.setattr(CopyStream, "copy_to_device", recording_copy_to_device)
        for overlap in (False, True):
            zenflow_run(cuda_fp32, "eager", overlap_step=overlap, full_warm_up_rounds=warm_up)
    assert written and set(written) == {(True, "cuda", torch.float32)}
    assert sent and all(pinned for pinned, _ in sent)
    assert len(sent) < len(written)  # one copy for all of an update's weights


def test_one_copy_stream_per_cuda_device(cuda_fp32):
    stream = copy_stream(cuda_fp32)
    assert stream is copy_stream(cuda_fp32)  # the side stream: see the overlap tests above


# Pinned host state.


def test_a_cuda_weights_host_state_is_pinned(cuda_fp32):
    param = torch.nn.Parameter(torch.randn(8, 16, device=cuda_fp32))
    w = OwnedWeight(param, 0, DataParallel(), offload=False, device_sums=False, sync=HostSync())
    state = w.state
    for host in (state.host_master, state.host_exp_avg, state.host_exp_avg_sq):
        assert host.device.type == "cpu" and host.is_pinned()
    assert torch.equal(state.host_master, param.detach().t().cpu())
    assert state.device_master.device == param.device and state.device_master.shape == (0, 8)

    # The selected rows go to the device; the host rows stay pinned.
    w.reselect(torch.tensor([1, 5, 9]))
    for host in (state.host_master, state.host_exp_avg, state.host_exp_avg_sq):
        assert host.is_pinned()
    assert state.device_master.device == param.device and state.device_master.shape == (3, 8)
    assert torch.equal(state.device_master.cpu(), param.detach().t()[[1, 5, 9]].cpu())


def test_a_cpu_weights_host_state_is_never_pinned(cuda_fp32):
    param = torch.nn.Parameter(torch.randn(4, 6))
    w = OwnedWeight(param, 0, DataParallel(), offload=False, device_sums=False, sync=HostSync())
    assert not w.state.host_master.is_pinned()


# Compiled training against the oracle.


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_compiled_training_on_cuda_equals_reference(cuda_fp32, inner):
    model, opt = zenflow_run(cuda_fp32, inner)
    oracle_model, _ = reference_run(cuda_fp32)
    assert_close(list(model.parameters()), list(oracle_model.parameters()), **GPU_TOL)
    assert opt.stats()["reselections"] == 4 and opt.stats()["cpu_updates"] == 6
    assert all(p.grad is None for p in model.parameters() if p.dim() >= 2)
    assert_placement(opt, cuda_fp32)


@pytest.mark.parametrize(
    "settings",
    [
        dict(overlap_step=True),
        dict(offload=True),
        dict(offload=True, overlap_step=True),
        dict(accumulate_on_device=True),
        dict(accumulate_on_device=True, overlap_step=True),
        dict(topk_ratio=0.0, update_interval=1, select_interval=1),
    ],
    ids=[
        "overlap",
        "offload",
        "offload-overlap",
        "device-sums",
        "device-sums-overlap",
        "plain-offload",
    ],
)
def test_runtime_options_on_cuda_equal_reference(cuda_fp32, settings):
    model, opt = zenflow_run(cuda_fp32, "eager", flush=True, **settings)
    oracle_model, _ = reference_run(cuda_fp32, flush=True, **settings)
    assert_close(list(model.parameters()), list(oracle_model.parameters()), **GPU_TOL)
    assert_placement(opt, cuda_fp32, offload=settings.get("offload", False))
    if settings.get("accumulate_on_device"):
        sums = [weight["accumulator"] for weight in saved_weights(opt.state_dict())]
        assert all(s.device.type == "cuda" for s in sums if s is not None)


@pytest.mark.parametrize("device_sums", [False, True], ids=["host-sums", "device-sums"])
def test_gradient_accumulation_on_cuda_equals_reference(cuda_fp32, device_sums):
    """Three micro-batches per step: with host-side sums every micro-batch's unselected rows
    take the copy stream to the host, a later one's added into the staged sum once landed;
    with device-side sums ("auto"'s choice on one GPU) they add up on the device."""
    data = on(cuda_fp32, batches("mlp", 12))

    def run(model, opt):
        for inputs, targets in data:
            opt.zero_grad()
            for part in zip(inputs.chunk(3), targets.chunk(3), strict=True):
                (loss_of("mlp", model, *part) / 3).backward()
            opt.step()

    model = build("mlp").to(cuda_fp32)
    opt = ZenFlowAdamW(
        model.parameters(), step_backend="eager", accumulate_on_device=device_sums, **SCHEDULE
    )
    run(torch.compile(model, backend="zenflow", options={"inner": "eager"}), opt)
    oracle_model = build("mlp").to(cuda_fp32)
    run(oracle_model, ReferenceZenFlowAdamW(oracle_model.parameters(), **SCHEDULE))
    assert_close(list(model.parameters()), list(oracle_model.parameters()), **GPU_TOL)


@pytest.mark.parametrize("device_sums", [False, True], ids=["host-sums", "device-sums"])
def test_overlapped_result_is_not_overwritten_while_its_copy_is_in_flight(cuda_fp32, device_sums):
    """overlap_step with fp32 weights on a busy device, the window sums on either side.

    At a window boundary the optimizer applies the previous window's CPU result (a copy from
    pinned host memory to the device, queued on the current stream) and then submits the next
    CPU update, which rewrites the host rows that copy may read. The copy must read the values
    as they were when it was queued. A spin kernel after each device update keeps the stream busy,
    so a copy that is still in flight when the CPU update starts would deliver the next
    window's values one window early, and the run would leave the oracle. (update_interval 2,
    select_interval 8: each select cycle has background windows with a result pending.)
    """
    settings = dict(update_interval=2, select_interval=8, overlap_step=True)
    hyper = {**SCHEDULE, **settings}
    model = build("mlp").to(cuda_fp32)
    opt = ZenFlowAdamW(
        model.parameters(), step_backend="eager", accumulate_on_device=device_sums, **hyper
    )
    selected_values = OwnedWeight.selected_values

    def slow_selected_values(self, copied=None):
        # Taken right after the device update, in every step.
        torch.cuda._sleep(20_000_000)  # ~10 ms or more of device time after the update
        return selected_values(self, copied)

    compiled = torch.compile(model, backend="zenflow", options={"inner": "eager"})
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(OwnedWeight, "selected_values", slow_selected_values)
        train(compiled, opt, on(cuda_fp32, batches("mlp", 16)))
    opt.flush()
    oracle_model, _ = reference_run(cuda_fp32, steps=16, flush=True, **settings)
    assert_close(list(model.parameters()), list(oracle_model.parameters()), **GPU_TOL)


def test_the_device_update_on_cuda_runs_torchs_multi_tensor_kernels_by_default(cuda_fp32):
    """step_backend "auto": no Inductor compile of the device update on a GPU, also after
    engine.compile() (which compiles the model with Inductor)."""
    model = build("mlp").to(cuda_fp32)
    assert ZenFlowAdamW(model.parameters(), **SCHEDULE).step_backend == "eager"
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": overlapped_zenflow_zero(),
    }
    engine, *_ = zenflow.initialize(model=build("mlp").to(cuda_fp32), config=config)
    engine.compile()
    assert engine.optimizer.step_backend == "eager"


def test_bf16_model_trains_on_cuda(cuda_fp32):
    """A bf16 model (as the GPU benchmark runs it): fp32 state, bf16 parameters, loss falls."""
    model = build("mlp").to(cuda_fp32, torch.bfloat16)
    opt = ZenFlowAdamW(model.parameters(), step_backend="inductor", overlap_step=True, **SCHEDULE)
    compiled = torch.compile(model, backend="zenflow", options={"inner": "inductor"})
    data = on(cuda_fp32, batches("mlp", 1)) * 24  # one batch, over and over: the loss must fall
    losses = []
    for inputs, targets in data:
        opt.zero_grad()
        loss = loss_of("mlp", compiled, inputs.bfloat16(), targets.bfloat16())
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(
        weight["host"][0].dtype == torch.float32 for weight in saved_weights(opt.state_dict())
    )
    assert losses[-1] < 0.8 * losses[0], losses


# Traffic accounting does not depend on the device.


@pytest.mark.parametrize(
    "settings",
    [
        dict(accumulate_on_device=False),
        dict(accumulate_on_device=False, overlap_step=True),
        dict(accumulate_on_device=True),
        dict(accumulate_on_device=False, topk_ratio=0.0),
    ],
    ids=["host-sums", "overlap", "device-sums", "plain-offload"],
)
def test_stats_byte_counts_are_the_same_on_cpu_and_cuda(cuda_fp32, copy_stream_staging, settings):
    # The CPU run stages as a GPU weight does (through the copy stream's twin): staged in its
    # host block, a CPU weight's rows never move at a selection. (With offload=True they
    # differ by design: on a CPU the "device" state is already on the host, so nothing
    # crosses; see the GPU check's notes. accumulate_on_device is set: "auto" decides
    # differently on the two.)
    _, on_cpu = zenflow_run(torch.device("cpu"), "eager", flush=True, **settings)
    _, on_gpu = zenflow_run(cuda_fp32, "eager", flush=True, **settings)
    keys = ("steps", "selected_fraction", "reselections", "cpu_updates", "d2h_bytes", "h2d_bytes")
    assert {k: on_gpu.stats()[k] for k in keys} == {k: on_cpu.stats()[k] for k in keys}
    assert on_gpu.stats()["d2h_bytes"] > 0 and on_gpu.stats()["h2d_bytes"] > 0


def test_device_sums_are_on_by_default_for_one_gpu_rank(cuda_fp32):
    _, by_default = zenflow_run(cuda_fp32, "eager", flush=True)
    _, host_sums = zenflow_run(cuda_fp32, "eager", flush=True, accumulate_on_device=False)
    assert by_default.stats()["accumulate_on_device"] is True
    assert by_default.stats()["d2h_bytes"] < host_sums.stats()["d2h_bytes"]


def test_the_report_shows_each_gpu_and_pins_the_pool_by_default(capsys):
    """``python -m zenflow`` on a GPU machine: every GPU with its free memory, and the pool
    pinned under bind_cores "auto", as for weights on a GPU."""
    assert report.main(["--json"]) == 0
    seen = json.loads(capsys.readouterr().out)
    assert [gpu["index"] for gpu in seen["gpus"]] == list(range(torch.cuda.device_count()))
    assert all(0 < gpu["free_bytes"] <= gpu["total_bytes"] for gpu in seen["gpus"])
    assert seen["pools"]["pinned"] is True
    assert seen["pools"]["ranks"][0]["cpus"] == list(core_binding.place_pool(0.5, True).cpus or ())


def test_the_cpu_pools_workers_are_pinned_by_default_for_gpu_weights(cuda_fp32):
    """bind_cores "auto" with the weights on a GPU: the pool's workers (for overlapped updates)
    run on the cores pt_reserved_cores_perc leaves them, where the machine can be split."""
    _, opt = zenflow_run(cuda_fp32, "eager", flush=False)
    expected = core_binding.place_pool(0.5, True).cpus
    assert opt.stats()["cpu_pool_cpus"] == list(expected or ())
    assert cpu_adam.get_worker_cpus() == (expected or ())  # where the pool's workers start
    _, unbound = zenflow_run(cuda_fp32, "eager", flush=False, bind_cores=False)
    assert unbound.stats()["cpu_pool_cpus"] == []


@pytest.mark.parametrize(
    "settings",
    [
        dict(accumulate_on_device=True),
        dict(accumulate_on_device=False),
        dict(accumulate_on_device=False, offload=True),
        dict(accumulate_on_device=True, overlap_step=False),
    ],
    ids=["device-sums", "host-sums", "offload", "synchronous"],
)
def test_steps_from_the_first_selection_past_a_select_boundary_synchronize_only_through_the_helper(
    cuda_fp32, settings
):
    """Under set_sync_debug_mode("error") any synchronization outside zenflow's helper raises:
    the first selection (the staged rows re-split, nothing leaving), ordinary and
    window-closing steps, a select boundary (scores read, leaving rows sent on the copy
    stream, index tensors through pinned memory), the step after it, and the window close
    after that, which applies the update submitted at the boundary (the leaving rows landed,
    the new layout's columns written) run through; with ``offload`` the selected rows cross
    to the host on the copy stream every step. Every backward after the first (which
    compiles) hands each weight's gradient to the runtime without a synchronization either:
    one there would hold the host once per weight, in the middle of the backward."""
    settings = dict(SCHEDULE, select_interval=8, overlap_step=True) | settings
    model = build("mlp").to(cuda_fp32)
    opt = ZenFlowAdamW(model.parameters(), step_backend="eager", **settings)
    compiled = torch.compile(model, backend="zenflow", options={"inner": "eager"})
    for step, (inputs, targets) in enumerate(on(cuda_fp32, batches("mlp", 10))):
        if step > 0:
            torch.cuda.set_sync_debug_mode("error")
        try:
            opt.zero_grad()
            loss_of("mlp", compiled, inputs, targets).backward()
            before = opt.stats()["device_syncs"]
            torch.cuda.set_sync_debug_mode("error")
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert opt.stats()["device_syncs"] - before <= (8 if step in (0, 7) else 2), step
    assert opt.stats()["cpu_updates"] == 5 and opt.stats()["reselections"] == 2


# NCCL with one rank.


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_nccl_with_one_rank_equals_the_single_process_run(cuda_fp32, zero_stage):
    single, _ = zenflow_run(cuda_fp32, "eager", flush=True, zero_stage=zero_stage)
    torch.cuda.set_device(cuda_fp32)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        assert dist.get_backend() == "nccl"
        probe = torch.full((4,), 3.0, device=cuda_fp32)
        dist.all_reduce(probe)  # NCCL itself works (the runtime skips collectives at size 1)
        assert torch.equal(probe.cpu(), torch.full((4,), 3.0))
        model, opt = zenflow_run(cuda_fp32, "eager", flush=True, zero_stage=zero_stage)
        columns = sum(p.shape[1] for p in model.parameters() if p.dim() >= 2)
        assert opt.stats()["host_columns"] == columns  # one rank holds every column
        assert_placement(opt, cuda_fp32)
    finally:
        dist.destroy_process_group()
    assert_close(list(model.parameters()), list(single.parameters()), **GPU_TOL)
    oracle_model, _ = reference_run(cuda_fp32, flush=True)
    assert_close(list(model.parameters()), list(oracle_model.parameters()), **GPU_TOL)


def test_accelerate_prepare_leaves_the_host_state_on_the_host(cuda_fp32):
    """``accelerator.prepare(optimizer)`` (Trainer calls it) moves the state dict to the device
    and loads it back: the host state (three times the weights it holds) must not come along,
    nor end up on the device after the load."""
    import accelerate

    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).to(cuda_fp32)
    opt = ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=0.1, update_interval=2)
    model(torch.randn(8, 1024, device=cuda_fp32)).square().mean().backward()
    opt.step()
    host_bytes = sum(
        t.numel() * t.element_size() for w in saved_weights(opt.state_dict()) for t in w["host"]
    )
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    prepared = accelerate.Accelerator().prepare(opt)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < host_bytes / 2
    assert all(t.is_pinned() for w in saved_weights(opt.state_dict()) for t in w["host"][:3])
    model(torch.randn(8, 1024, device=cuda_fp32)).square().mean().backward()
    prepared.step()
    assert opt.stats()["steps"] == 2
