"""ZenFlowAdamW as a torch.optim.Optimizer: checkpoints, statistics, bad input."""

import math
import time

import pytest
import torch
from torch.testing import assert_close

from tests.models import batches, build, loss_of
from zenflow.columns import select_top_columns
from zenflow.notices import reset_notices
from zenflow.optimizer import ZenFlowAdamW
from zenflow.reference import ReferenceZenFlowAdamW
from zenflow.runtime import cpu_adam
from zenflow.runtime.selective_step import step_backend_for
from zenflow.runtime.streams import PendingCopy

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
SETTINGS = dict(lr=1e-2, topk_ratio=0.25, update_interval=2, select_interval=4, overlap_step=True)


def train(model, opt, data):
    for inputs, targets in data:
        opt.zero_grad()
        loss_of("mlp", model, inputs, targets).backward()
        opt.step()


@pytest.mark.parametrize(
    "schedule, steps, save_at, window_steps",
    [
        # The window after the save ends without a reselection, so the pending update matters.
        (dict(select_interval=12), 20, 7, 1),
        # Right after a select boundary: the update in flight was submitted before the
        # reselection and covers the columns that entered the selection there too.
        (dict(select_interval=4), 12, 4, 0),
        # Windows of 4, 5 and 3 steps, each update's lr scaled by its own length: saved two
        # steps into the 5-step one, with the 4-step one's update still running.
        (
            dict(
                update_interval="auto",
                min_update_interval=2,
                max_update_interval=6,
                select_interval=12,
            ),
            24,
            6,
            2,
        ),
    ],
    ids=["fixed interval", "after a select boundary", "auto interval"],
)
def test_save_mid_window_with_an_overlapped_update_pending_resumes_bitwise(
    schedule, steps, save_at, window_steps
):
    settings = {**SETTINGS, **schedule}
    data = batches("mlp", steps)
    straight = build("mlp")
    straight_opt = ZenFlowAdamW(straight.parameters(), step_backend="eager", **settings)
    train(straight, straight_opt, data)

    first = build("mlp")
    first_opt = ZenFlowAdamW(first.parameters(), step_backend="eager", **settings)
    train(first, first_opt, data[:save_at])
    stats = first_opt.stats()
    assert stats["updates_in_flight"] == 1 and stats["window_steps"] == window_steps
    saved_model = {k: v.clone() for k, v in first.state_dict().items()}
    saved_opt = first_opt.state_dict()

    resumed = build("mlp", seed=123)
    resumed.load_state_dict(saved_model)
    resumed_opt = ZenFlowAdamW(resumed.parameters(), step_backend="eager", **settings)
    resumed_opt.load_state_dict(saved_opt)
    train(resumed, resumed_opt, data[save_at:])
    for a, b in zip(resumed.parameters(), straight.parameters(), strict=True):
        assert torch.equal(a, b)
    assert resumed_opt.stats()["steps"] == steps
    assert resumed_opt.stats()["cpu_updates"] == straight_opt.stats()["cpu_updates"]


def test_a_16_bit_model_equals_reference_across_overlapped_select_boundaries():
    """A bf16 model's unselected columns come back rounded by the CPU job. The update
    submitted at a select boundary covers the columns entering the selection there as well;
    from then on their parameter columns hold their device values, which its stale copy must
    not overwrite when it lands a window later. (bf16 tolerance: a column a window stale is
    off by about one lr.)"""
    model, oracle_model = build("mlp").bfloat16(), build("mlp").bfloat16()
    opt = ZenFlowAdamW(model.parameters(), step_backend="eager", **SETTINGS)
    oracle = ReferenceZenFlowAdamW(oracle_model.parameters(), **SETTINGS)
    for inputs, targets in batches("mlp", 12):
        for m, o in ((model, opt), (oracle_model, oracle)):
            o.zero_grad()
            loss_of("mlp", m, inputs.bfloat16(), targets.bfloat16()).backward()
            o.step()
        assert_close(
            list(model.parameters()), list(oracle_model.parameters()), rtol=8e-3, atol=1e-3
        )
    assert opt.stats()["reselections"] == oracle.reselections == 4


class _SometimesUsed(torch.nn.Module):
    """Two branches into one head: ``sometimes`` (a weight and a bias) takes part only in the
    steps that ask for it, and gets no gradient in the others."""

    def __init__(self):
        super().__init__()
        self.always = torch.nn.Linear(6, 16)
        self.sometimes = torch.nn.Linear(6, 16)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x, use_both: bool):
        hidden = self.always(x)
        if use_both:
            hidden = hidden + self.sometimes(x)
        return self.head(torch.tanh(hidden))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_weight_without_a_gradient_in_some_steps_equals_reference(compiled):
    """The device update steps the rows of whichever parameters got a gradient; here the set
    changes every other step (the update's rows are packed for the set it steps, and packed
    again when the set changes), and the one left out keeps its state meanwhile."""
    torch.manual_seed(0)
    model = _SometimesUsed()
    oracle_model = _SometimesUsed()
    oracle_model.load_state_dict(model.state_dict())
    opt = ZenFlowAdamW(model.parameters(), step_backend="eager", **SETTINGS)
    oracle = ReferenceZenFlowAdamW(oracle_model.parameters(), **SETTINGS)
    forward = (
        torch.compile(model, backend="zenflow", options={"inner": "eager"}) if compiled else model
    )
    for step, (inputs, targets) in enumerate(batches("mlp", 12)):
        for m, o in ((forward, opt), (oracle_model, oracle)):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(inputs, step % 3 != 1), targets).backward()
            o.step()
        assert_close(
            list(model.parameters()), list(oracle_model.parameters()), rtol=1e-5, atol=1e-6
        )
    assert opt.stats()["reselections"] == oracle.reselections > 0


def test_a_state_dict_of_an_unknown_format_is_refused_by_its_version():
    model = build("mlp")
    opt = ZenFlowAdamW(model.parameters(), step_backend="eager", **SETTINGS)
    train(model, opt, batches("mlp", 3))
    state = opt.state_dict()
    for readable in ("zenflow.ZenFlowAdamW/3", "zenflow.ZenFlowAdamW/2"):
        older = ZenFlowAdamW(build("mlp").parameters(), step_backend="eager", **SETTINGS)
        older.load_state_dict({**state, "format": readable})
        assert older.stats()["steps"] == 3
    with pytest.raises(ValueError, match=r"found 'zenflow.ZenFlowAdamW/1'"):
        opt.load_state_dict({**state, "format": "zenflow.ZenFlowAdamW/1"})


def test_overlap_on_large_weights_equals_reference(staging):
    """Big enough that the CPU update is still running while the next window accumulates."""
    torch.manual_seed(0)
    make = lambda: torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 64))  # noqa: E731
    torch.manual_seed(0)
    model = make()
    torch.manual_seed(0)
    oracle_model = make()
    oracle = ReferenceZenFlowAdamW(oracle_model.parameters(), **SETTINGS)
    opt = ZenFlowAdamW(model.parameters(), step_backend="eager", **SETTINGS)
    g = torch.Generator().manual_seed(0)
    for _ in range(8):
        x, y = torch.randn(4, 256, generator=g), torch.randn(4, 64, generator=g)
        for m, o in ((model, opt), (oracle_model, oracle)):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
    assert_close(list(model.parameters()), list(oracle_model.parameters()), rtol=1e-5, atol=1e-6)


def test_sums_queued_behind_a_busy_pool_equal_reference(staging, monkeypatch):
    """The CPU pool adds each step's unselected rows into the window's sum after step() has
    returned. Here every such job waits behind a long one, so the next backward stages while the
    previous step's rows are still unread: they must not be staged over."""
    blockers, queued = [], []

    def behind_a_long_job(sums, rows, scale):
        zeros = torch.zeros(2**22)
        blockers.append(
            cpu_adam.submit_adamw_step(
                [zeros], [zeros], [zeros.clone()], [zeros.clone()], steps=1, **HYPER
            )
        )
        queued.append(real_submit(sums, rows, scale=scale))
        return queued[-1]

    real_submit = cpu_adam.submit_accumulate
    monkeypatch.setattr(cpu_adam, "submit_accumulate", behind_a_long_job)
    settings = {**SETTINGS, "update_interval": 4, "select_interval": 8}
    data = batches("mlp", 12)
    model, oracle_model = build("mlp"), build("mlp")
    oracle = ReferenceZenFlowAdamW(oracle_model.parameters(), **settings)
    opt = ZenFlowAdamW(model.parameters(), step_backend="eager", **settings)
    train(oracle_model, oracle, data)
    returned_before_the_sum = 0
    for inputs, targets in data:
        opt.zero_grad()
        loss_of("mlp", model, inputs, targets).backward()
        opt.step()
        returned_before_the_sum += bool(queued) and not queued[-1].done()
    opt.flush()
    oracle.flush()
    assert returned_before_the_sum >= 4
    assert_close(list(model.parameters()), list(oracle_model.parameters()), rtol=1e-5, atol=1e-6)


def recorded_selections(data) -> dict[tuple, list[set]]:
    """The columns the oracle selects at each reselection, per weight shape."""
    selections: dict[tuple, list[set]] = {}

    def record(param, scores, k):
        chosen = select_top_columns(scores, k)
        selections.setdefault(tuple(param.shape), []).append(set(chosen.tolist()))
        return chosen

    model = build("mlp")
    oracle = ReferenceZenFlowAdamW(model.parameters(), selector=record, **SETTINGS)
    train(model, oracle, data)
    return selections


def test_stats_count_steps_updates_bytes_and_pool_time():
    data = batches("mlp", 8)
    model = build("mlp")
    opt = ZenFlowAdamW(model.parameters(), step_backend="eager", **SETTINGS)
    train(model, opt, data)
    stats = opt.stats()
    assert stats["steps"] == 8 and stats["reselections"] == 3 and stats["cpu_updates"] == 4
    # Weights [16, 6] and [3, 16]: k = 1 of 6 and 4 of 16 columns.
    all_elements = 6 * 16 + 16 * 3
    selected_elements = 1 * 16 + 4 * 3
    unselected_elements = all_elements - selected_elements
    assert stats["selected_fraction"] == pytest.approx(selected_elements / all_elements)
    # Step 1 stages every row (nothing selected yet), steps 2-8 the unselected ones, in fp32.
    staged = (all_elements + 7 * unselected_elements) * 4
    # A reselection moves only the columns that change side: fp32 master and moments plus an
    # int64 step each (one process on the CPU: the staged gradient's rows stay in their block);
    # at the select boundaries (overlapped) the entering columns' fp32 window sums come along.
    moved_in = moved_out = 0
    for (out, _), history in recorded_selections(data).items():
        row_bytes = out * 3 * 4 + 8
        for old, new in zip([set()] + history, history, strict=False):
            moved_in += len(new - old) * (row_bytes + (out * 4 if old else 0))
            moved_out += len(old - new) * row_bytes
    assert moved_in > 0
    assert stats["d2h_bytes"] == staged + moved_out
    # The unselected columns go back in the parameter dtype when the overlapped updates of
    # steps 2, 4 and 6 are applied (at steps 4, 6 and 8); step 8's is still in flight.
    assert stats["h2d_bytes"] == 3 * unselected_elements * 4 + moved_in
    assert stats["skipped_steps"] == 0
    # The pool's time counts whether or not the training thread waited for it (overlapped).
    assert stats["cpu_adam_s"] > 0 and stats["cpu_accumulate_s"] > 0


def test_stats_time_the_host_after_each_steps_synchronization():
    """``host_after_sync_s``: the time step() spends after the step's last wait for the
    device (what a GPU idles for), some of step() and never more than all of it."""
    data = batches("mlp", 8)
    model = build("mlp")
    opt = ZenFlowAdamW(model.parameters(), step_backend="eager", **SETTINGS)
    in_step = 0.0
    for inputs, targets in data:
        opt.zero_grad()
        loss_of("mlp", model, inputs, targets).backward()
        started = time.perf_counter()
        opt.step()
        in_step += time.perf_counter() - started
    after_sync = opt.stats()["host_after_sync_s"]
    assert 0 < after_sync < in_step


def test_stats_time_the_backwards_hand_overs():
    """``hand_over_s``: the time compiled backward passes spent handing gradients to the
    runtime, some of each backward and none of step(); a model that is not compiled has its
    ``.grad`` taken in step() and hands nothing over."""
    data = batches("mlp", 6)
    model = build("mlp")
    opt = ZenFlowAdamW(model.parameters(), step_backend="eager", **SETTINGS)
    compiled = torch.compile(model, backend="zenflow", options={"inner": "eager"})
    in_backward = 0.0
    for inputs, targets in data:
        opt.zero_grad()
        loss = loss_of("mlp", compiled, inputs, targets)
        started = time.perf_counter()
        loss.backward()
        in_backward += time.perf_counter() - started
        before_step = opt.stats()["hand_over_s"]
        opt.step()
        assert opt.stats()["hand_over_s"] == before_step
    assert 0 < opt.stats()["hand_over_s"] < in_backward

    eager_model = build("mlp")
    eager_opt = ZenFlowAdamW(eager_model.parameters(), step_backend="eager", **SETTINGS)
    train(eager_model, eager_opt, data)
    assert eager_opt.stats()["hand_over_s"] == 0.0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(topk_ratio=1.5), "topk_ratio"),
        (dict(update_interval=0), "update_interval"),
        (dict(update_interval=4, select_interval=2), "select_interval"),
        (dict(select_strategy="epoch", select_interval=1), "steps_per_epoch"),
        (dict(max_grad_norm=0.0), "max_grad_norm"),
        (dict(lr=-1.0), "lr"),
        (dict(update_interval="auto", max_update_interval=0), "max_update_interval"),
        (dict(update_interval="auto", auto_ratio=1.5), "auto_ratio"),
        (dict(step_backend="tvm"), "step_backend must be one of"),
        (dict(offload=True, accumulate_on_device=True), "set one of them"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ZenFlowAdamW(build("mlp").parameters(), **kwargs)


def test_strided_weight_is_refused():
    weight = torch.nn.Parameter(torch.randn(4, 12)[:, ::2])
    with pytest.raises(ValueError, match="contiguous"):
        ZenFlowAdamW([weight])


@pytest.mark.parametrize("overlap_step", [False, True])
def test_parameters_keep_pytorchs_layout_through_training(overlap_step):
    """Contiguous with their natural strides when the optimizer takes them and after every
    step (selected columns written each step, unselected ones at window boundaries, a
    reselection between): views and flattening work as on any model."""
    model = build("conv")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    pointers = {name: p.data_ptr() for name, p in model.named_parameters()}
    settings = {**SETTINGS, "overlap_step": overlap_step}
    opt = ZenFlowAdamW(model.parameters(), step_backend="eager", **settings)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name])
    for inputs, targets in batches("conv", 9):
        opt.zero_grad()
        loss_of("conv", model, inputs, targets).backward()
        opt.step()
        for name, p in model.named_parameters():
            assert p.is_contiguous() and p.data_ptr() == pointers[name], name
            assert p.view(-1).numel() == p.numel()
    assert opt.stats()["reselections"] == 3


def test_state_dict_between_backward_and_step_is_refused():
    model = build("mlp")
    opt = ZenFlowAdamW(model.parameters(), step_backend="eager", **SETTINGS)
    loss_of("mlp", model, *batches("mlp", 1)[0]).backward()
    opt.clip_grad_norm_(1.0)  # takes the gradients over from .grad
    with pytest.raises(RuntimeError, match="save after step"):
        opt.state_dict()


def test_grad_divisor_unscales_before_clipping_and_update():
    data = batches("mlp", 6)
    settings = {**SETTINGS, "max_grad_norm": 0.05}
    scaled, oracle_model = build("mlp"), build("mlp")
    opt = ZenFlowAdamW(scaled.parameters(), step_backend="eager", **settings)
    oracle = ReferenceZenFlowAdamW(oracle_model.parameters(), **settings)
    for inputs, targets in data:
        opt.zero_grad()
        (loss_of("mlp", scaled, inputs, targets) * 1024.0).backward()
        opt.step(grad_divisor=1024.0)
        assert not opt.last_step_skipped
    train(oracle_model, oracle, data)
    assert_close(list(scaled.parameters()), list(oracle_model.parameters()), rtol=1e-5, atol=1e-6)


LINEAR_RAMP = torch.linspace(0.1, 2.0, 32)
FOUR_STRONG_FEATURES = torch.cat([torch.full((28,), 0.1), torch.full((4,), 2.0)])


def teacher_task(steps: int, scale: torch.Tensor = LINEAR_RAMP):
    """A random teacher MLP to learn from inputs whose 32 features have the given scales."""
    g = torch.Generator().manual_seed(0)
    teacher = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    for p in teacher.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.5
    inputs = [torch.randn(16, 32, generator=g) * scale for _ in range(steps)]
    return [(x, teacher(x).detach()) for x in inputs]


def train_on_teacher(data, **settings) -> tuple[float, dict]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    opt = ZenFlowAdamW(
        model.parameters(),
        lr=1e-2,
        topk_ratio=0.1,
        select_interval=16,
        step_backend="eager",
        **settings,
    )
    for x, y in data[:-20]:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    opt.flush()
    with torch.no_grad():
        losses = [torch.nn.functional.mse_loss(model(x), y).item() for x, y in data[-20:]]
    return sum(losses) / len(losses), opt.stats()


@pytest.mark.parametrize(
    "scale, fewer",
    [(LINEAR_RAMP, False), (FOUR_STRONG_FEATURES, True)],
    ids=["spread importance", "concentrated importance"],
)
def test_auto_update_interval_trains_as_well_as_a_fixed_4_with_no_more_cpu_updates(scale, fewer):
    data = teacher_task(180, scale)
    fixed_loss, fixed = train_on_teacher(data, update_interval=4)
    auto_loss, auto = train_on_teacher(data, update_interval="auto")
    assert auto_loss <= 1.01 * fixed_loss
    assert auto["cpu_updates"] <= fixed["cpu_updates"]
    if fewer:  # the rule, not the floor, set the windows
        assert auto["cpu_updates"] < fixed["cpu_updates"]


def test_auto_steps_a_window_with_lr_times_the_square_root_of_its_length():
    """Windows held at 3 steps (floor = ceiling), nothing selected: the reference at a fixed
    interval 3 with lr * sqrt(3) (no biases, which would take the unscaled lr every step)."""
    make = lambda: torch.nn.Sequential(  # noqa: E731
        torch.nn.Linear(8, 16, bias=False), torch.nn.Tanh(), torch.nn.Linear(16, 4, bias=False)
    )
    torch.manual_seed(0)
    model, oracle_model = make(), make()
    oracle_model.load_state_dict(model.state_dict())
    data = [(torch.randn(5, 8), torch.randn(5, 4)) for _ in range(9)]
    common = dict(topk_ratio=0.0, weight_decay=0.01)
    opt = ZenFlowAdamW(
        model.parameters(),
        lr=1e-2,
        update_interval="auto",
        min_update_interval=3,
        max_update_interval=3,
        step_backend="eager",
        **common,
    )
    oracle = ReferenceZenFlowAdamW(
        oracle_model.parameters(), lr=1e-2 * math.sqrt(3), update_interval=3, **common
    )
    for m, o in ((model, opt), (oracle_model, oracle)):
        for x, y in data:
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
    assert opt.stats()["cpu_updates"] == 3
    assert_close(list(model.parameters()), list(oracle_model.parameters()), rtol=1e-5, atol=1e-6)


def test_a_cpu_update_counts_once_across_param_groups():
    model = build("mlp")
    groups = [{"params": [model[0].weight, model[0].bias]}, {"params": [model[2].weight]}]
    opt = ZenFlowAdamW(groups, step_backend="eager", **SETTINGS)
    train(model, opt, batches("mlp", 4))
    assert opt.stats()["cpu_updates"] == 2


def test_offload_counts_the_selected_rows_traffic():
    data = batches("mlp", 8)
    plain, offloaded = build("mlp"), build("mlp")
    plain_opt = ZenFlowAdamW(plain.parameters(), step_backend="eager", **SETTINGS)
    offload_opt = ZenFlowAdamW(
        offloaded.parameters(), step_backend="eager", offload=True, **SETTINGS
    )
    train(plain, plain_opt, data)
    weights = [offloaded[0].weight, offloaded[2].weight]
    reselected_bytes = 0
    for step, (inputs, targets) in enumerate(data, start=1):
        before = [offload_opt.selected_columns(w) for w in weights]
        train(offloaded, offload_opt, [(inputs, targets)])
        for w, was in zip(weights, before, strict=True):
            now = offload_opt.selected_columns(w)
            if step in (4, 8) and not torch.equal(was, now):
                reselected_bytes += now.numel() * w.shape[0] * 4
    # Steps 2-8 send the selected rows' fp32 gradient to the host (step 1 staged every row as
    # unselected: nothing was selected yet); steps 1-8 send their new fp32 values back, and so
    # do the select boundaries after steps 4 and 8 for each weight whose selection changed,
    # with the entering columns' new values.
    selected_bytes = (1 * 16 + 4 * 3) * 4
    assert offload_opt.stats()["d2h_bytes"] - plain_opt.stats()["d2h_bytes"] == 7 * selected_bytes
    sent = offload_opt.stats()["h2d_bytes"] - plain_opt.stats()["h2d_bytes"]
    assert reselected_bytes > 0
    assert sent == 8 * selected_bytes + reselected_bytes


@pytest.mark.parametrize(
    "requested, device, backend",
    [
        ("auto", "cuda", "eager"),
        ("auto", "cpu", "inductor"),
        ("inductor", "cuda", "inductor"),
        ("eager", "cpu", "eager"),
    ],
)
def test_step_backend_auto_compiles_the_device_update_on_the_cpu_only(requested, device, backend):
    assert step_backend_for(requested, torch.device(device)) == backend


def test_step_backend_reads_back_what_it_resolved_to_and_can_be_changed():
    opt = ZenFlowAdamW(build("mlp").parameters(), **SETTINGS)  # "auto", on the CPU
    assert opt.step_backend == "inductor"
    opt.step_backend = "eager"
    assert opt.step_backend == "eager"
    with pytest.raises(ValueError, match="step_backend must be one of"):
        opt.step_backend = "fast"
    assert opt.step_backend == "eager"


def row_scalings_in_an_eager_step(layers: int) -> int:
    """Ops an eager device step (after warm-up) makes that scale rows by a per-row constant
    (a ``[rows, width]`` tensor times or over a ``[rows, 1]`` one), for a stack of ``layers``
    Linear(16, 16) layers."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(layers)))
    opt = ZenFlowAdamW(model.parameters(), step_backend="eager", **SETTINGS)
    x = torch.randn(8, 16)
    for _ in range(3):
        opt.zero_grad()
        model(x).square().sum().backward()
        with torch.profiler.profile(record_shapes=True) as prof:
            opt.step()
    scalings = 0
    for event in prof.events():
        shapes = event.input_shapes
        if event.name in ("aten::mul_", "aten::div_") and len(shapes) == 2:
            rows, constants = shapes
            scalings += len(rows) == 2 and constants == [rows[0], 1] and rows[1] > 1
    return scalings


def test_an_eager_step_scales_rows_once_per_width_not_per_tensor():
    # torch's multi-tensor kernels take no broadcast: on a GPU a per-tensor scaling is a
    # kernel launch per tensor (about 290 per op for a 354M GPT), the host's time, not the
    # device's. Each step scales the denominators and the updates: twice per width.
    assert row_scalings_in_an_eager_step(6) == row_scalings_in_an_eager_step(24) == 2


def test_the_step_shows_its_phases_in_a_profiler_trace():
    data = batches("mlp", 12)
    model = build("mlp")
    opt = ZenFlowAdamW(model.parameters(), step_backend="eager", **SETTINGS)
    train(model, opt, data[:8])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        # Step 10 starts an overlapped update, which step 12, a select boundary, writes back
        # before it submits its own and reselects from its gradient.
        train(model, opt, data[8:])
    names = {event.key for event in prof.key_averages()}
    phases = ["step", "gradient_norm", "reselect", "device_update", "window_sums", "cpu_update"]
    for phase in phases + ["write_back", "wait_for_device"]:
        assert f"zenflow::{phase}" in names


def test_a_step_queues_its_device_update_before_waiting_for_the_rows_copy(copy_stream_staging):
    """A weight on a GPU (the copy stream's path, here on its CPU twin): the unselected rows'
    copy to the host is waited for where they are read (the window's sum), after the step has
    queued its device update, so the device need not idle through the copies' tail. Seen from
    outside: when the step first waits for a copy, the selected columns already hold their new
    values."""
    model = build("mlp")
    opt = ZenFlowAdamW(model.parameters(), step_backend="eager", **SETTINGS)
    data = batches("mlp", 3)
    train(model, opt, data[:2])  # the first step selects, the second closes a window
    # The third, recorded, is an ordinary step.
    opt.zero_grad()
    loss_of("mlp", model, *data[2]).backward()
    before = [p.detach().clone() for p in model.parameters()]
    updated_at_each_wait = []
    wait = PendingCopy.wait

    def recorded_wait(self, sync):
        now = list(model.parameters())
        updated_at_each_wait.append(
            any(not torch.equal(a, b) for a, b in zip(now, before, strict=True))
        )
        return wait(self, sync)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PendingCopy, "wait", recorded_wait)
        opt.step()
    assert updated_at_each_wait and updated_at_each_wait[0]


@pytest.mark.parametrize("sums", ["host", "device, clipped"])
@pytest.mark.parametrize("overlap_step", [False, True])
def test_update_interval_auto_equals_the_oracles(overlap_step, sums, staging):
    """The oracle decides "auto"'s windows by its own reading of the rule: the same windows
    (CPU updates), the same values. Device-side sums' energy is formed from terms read with
    the step's norm (``||sum + c rows||^2`` once the clip coefficient c is known)."""
    settings = dict(
        lr=1e-2,
        topk_ratio=0.25,
        update_interval="auto",
        min_update_interval=2,
        max_update_interval=5,
        select_interval=12,
        overlap_step=overlap_step,
        max_grad_norm=0.05 if sums == "device, clipped" else None,
    )
    data = teacher_task(36)
    models = []
    for make in (ZenFlowAdamW, ReferenceZenFlowAdamW):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8)
        )
        extra = {}
        if make is ZenFlowAdamW:
            extra = dict(step_backend="eager", accumulate_on_device=sums != "host")
        opt = make(model.parameters(), **settings, **extra)
        for x, y in data:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        opt.flush()
        models.append((model, opt))
    (model, opt), (oracle_model, oracle) = models
    assert opt.stats()["cpu_updates"] == oracle.cpu_updates
    assert 36 / 5 < oracle.cpu_updates < 36 / 2  # windows of more than one length
    assert_close(list(model.parameters()), list(oracle_model.parameters()), rtol=1e-5, atol=1e-6)


def test_optimizers_past_the_recompile_limit_step_eagerly_with_a_notice(caplog):
    """Each optimizer's device step is a graph of its own tensor shapes; a process that builds
    more of them than Dynamo recompiles for (a sweep) keeps training."""
    torch._dynamo.reset()
    reset_notices()
    runs = {}
    with torch._dynamo.config.patch(recompile_limit=1), caplog.at_level("WARNING", "zenflow"):
        for width in (6, 10):  # the second shape set is past the limit of 1
            for backend in ("inductor", "eager"):
                torch.manual_seed(0)
                model = torch.nn.Linear(width, 3)
                opt = ZenFlowAdamW(model.parameters(), step_backend=backend, **SETTINGS)
                for i in range(3):
                    x = torch.randn(4, width, generator=torch.Generator().manual_seed(i))
                    model(x).square().mean().backward()
                    opt.step()
                    opt.zero_grad()
                runs[width, backend] = model.weight.detach().clone()
    for width in (6, 10):
        assert_close(runs[width, "inductor"], runs[width, "eager"], rtol=1e-6, atol=1e-7)
    assert any("recompile limit" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("overlap_step", [False, True])
def test_blocking_updates_count_the_jobs_a_call_submitted_and_waited_for(overlap_step):
    """Windows close after steps 2, 4, 6 and 8; 4 and 8 are select boundaries. With overlap no
    step waits for the update it submitted, select boundaries included; flush() waits for the
    job it submits."""
    model = build("mlp")
    settings = dict(SETTINGS, overlap_step=overlap_step)
    opt = ZenFlowAdamW(model.parameters(), step_backend="eager", **settings)
    train(model, opt, batches("mlp", 8))
    stats = opt.stats()
    assert stats["cpu_updates"] == 4
    assert stats["blocking_updates"] == (0 if overlap_step else 4)
    opt.flush()  # nothing open: nothing submitted
    assert opt.stats()["blocking_updates"] == stats["blocking_updates"]
    train(model, opt, batches("mlp", 1, seed=2))
    opt.flush()
    stats = opt.stats()
    assert stats["blocking_updates"] == (1 if overlap_step else 5)
    phases = ("ordinary", "select", "window_close", "select_boundary", "warm_up", "flush")
    waits = [stats[f"optimizer_wait_s_{phase}"] for phase in (*phases, "state_dict")]
    assert sum(waits) == pytest.approx(stats["optimizer_wait_s"], rel=1e-9, abs=1e-12)
    assert stats["optimizer_wait_s_flush"] > 0 and stats["optimizer_wait_s_warm_up"] == 0


def test_warm_up_steps_block_on_their_cpu_update():
    model = build("mlp")
    opt = ZenFlowAdamW(
        model.parameters(), step_backend="eager", **dict(SETTINGS, full_warm_up_rounds=2)
    )
    train(model, opt, batches("mlp", 2))
    assert opt.stats()["blocking_updates"] == 2 and opt.stats()["cpu_updates"] == 2
