"""What a step costs the training thread per weight, counted in operations.

On a GPU each operation the host dispatches is a kernel launch: a step whose operations grow
by many per weight leaves the device waiting on a model of many small weights. The count is
the same on the CPU for the same code path, so it is tested here: the top-level aten
operations that move data (views and no-op conversions left out) of ``step()`` +
``zero_grad()``, for 4 and for 10 layers (a weight and a bias each), on the steps inside a
window (``benchmarks/bench_host_ops.py`` prints them for every kind of step).
"""

import collections
import gc
import importlib.util

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import zenflow
from tests.python_process import ROOT

# Steps of the first select cycle (8 steps, update_interval 4) inside a window: 0 selects first,
# 3 closes a window, 7 closes one and selects.
INSIDE_A_WINDOW = (1, 2, 4, 5, 6)


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _bench_host_ops():
    """``benchmarks/bench_host_ops.py``, whose count of working operations the budgets here
    are written in."""
    spec = importlib.util.spec_from_file_location(
        "bench_host_ops", ROOT / "benchmarks" / "bench_host_ops.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


working_ops = _bench_host_ops().working_ops


def dispatched_ops(prof) -> list[str]:
    """Every top-level aten call, views and no-op conversions included: each is a trip through
    the dispatcher on the host's time, whatever it does."""
    return [
        event.name
        for event in prof.events()
        if event.name.startswith("aten::")
        and (event.cpu_parent is None or not event.cpu_parent.name.startswith("aten::"))
    ]


def training(
    layers: int,
    device_sums: bool | None,
    select_interval: int = 8,
    dtype: torch.dtype = torch.float32,
    lr: float = 1e-3,
    update_interval: int = 4,
):
    """A model of ``layers`` Linear(32, 32) compiled with zenflow and its ZenFlowAdamW, or with
    ``device_sums`` None, compiled with aot_eager (the same eager backward) and torch's AdamW.
    With ``lr`` 0 every step's gradient is the first's: each select boundary chooses the
    columns already selected."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(layers))).to(dtype)
    if device_sums is None:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        return torch.compile(model, backend="aot_eager"), opt
    opt = zenflow.ZenFlowAdamW(
        model.parameters(),
        lr=lr,
        topk_ratio=0.25,
        update_interval=update_interval,
        select_interval=select_interval,
        overlap_step=True,
        accumulate_on_device=device_sums,
        step_backend="eager",
    )
    return torch.compile(model, backend="zenflow", options={"inner": "eager"}), opt


def ops_at(
    layers: int,
    device_sums: bool | None,
    counted_part: str,
    steps: tuple[int, ...] = INSIDE_A_WINDOW[1:],
    select_interval: int = 8,
    dtype: torch.dtype = torch.float32,
    lr: float = 1e-3,
    count=working_ops,
) -> list[str]:
    """The working operations (``count``: another way to list a profile's operations) of the
    backward or of ``step()`` + ``zero_grad()`` at ``steps``, alike on each of them (by default
    the steps inside a window, after the first, which makes the new selection's indices)."""
    compiled, opt = training(layers, device_sums, select_interval, dtype, lr)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0)).to(dtype)
    activities = [torch.profiler.ProfilerActivity.CPU]
    counted = []
    for i in range(max(steps) + 1):
        loss = compiled(x).float().square().mean()
        with torch.profiler.profile(activities=activities) as backward:
            loss.backward()
        with torch.profiler.profile(activities=activities) as stepped:
            opt.step()
            opt.zero_grad()
        if i in steps:
            counted.append(count(backward if counted_part == "backward" else stepped))
    assert all(ops == counted[0] for ops in counted), "steps of one kind dispatch alike"
    return counted[0]


def per_extra_layer(device_sums: bool | None, counted_part: str, **at) -> dict[str, float]:
    """The operations that 10 layers dispatch beyond 4, per extra layer (``at``: ``ops_at``'s
    steps, select_interval, dtype, lr and count)."""
    few, many = (collections.Counter(ops_at(n, device_sums, counted_part, **at)) for n in (4, 10))
    return _per_extra_layer(few, many)


def _per_extra_layer(few: collections.Counter, many: collections.Counter) -> dict[str, float]:
    """What 10 layers count beyond 4 (``many`` against ``few``), per extra layer."""
    return {op: (many[op] - few[op]) / 6 for op in many | few if many[op] != few[op]}


@pytest.mark.parametrize("device_sums", [True, False], ids=["device-sums", "host-sums"])
def test_an_ordinary_step_dispatches_a_few_operations_per_weight(device_sums):
    """Per extra layer: the write of its selected columns, and with host-side sums the weight's
    norm (a sum of its scores); the 1-D parameters, the device-side sums and their norms go
    through multi-tensor operations (one for every weight), and with host-side sums the small
    batch's factors add three products. Before: an addition per weight and per bias into the
    norm, a norm and a power per bias, a copy per bias, an add per device-side sum, a sum of
    each device-side staged weight's scores."""
    per_layer = per_extra_layer(device_sums, "step")
    expected = {"aten::index_copy_": 1.0}
    if not device_sums:
        # Factors (batch 4 against 32 columns): the norm from x x^T and dy dy^T, the selected
        # rows from their product, the batch's columns gathered for it.
        expected |= {"aten::matmul": 3.0, "aten::mul": 1.0, "aten::index_select": 1.0}
        expected |= {"aten::sum": 1.0, "aten::to": 2.0}
    assert per_layer == expected


def test_a_16_bit_ordinary_step_converts_in_multi_tensor_copies():
    """A bf16 model with device-side sums: per extra layer, the write of its selected columns
    and nothing else, as for fp32. The selected rows' new values are converted to bf16 and the
    bias's gradient to fp32 for every weight and bias at once, by the device update's
    multi-tensor copies. Before: a conversion per weight and one per bias."""
    assert per_extra_layer(True, "step", dtype=torch.bfloat16) == {"aten::index_copy_": 1.0}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_an_ordinary_step_with_device_side_sums_makes_one_call_per_weight_views_included(dtype):
    """Per extra layer, every call through the dispatcher, views included: the write of its
    selected columns alone. Before: a detach and a reshape of the parameter and a transpose of
    the values around each write, and for fp32 a conversion of the master to its own dtype."""
    per_layer = per_extra_layer(True, "step", dtype=dtype, count=dispatched_ops)
    assert per_layer == {"aten::index_copy_": 1.0}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_backward_with_device_side_sums_adds_nothing_per_weight(dtype):
    """Against the same model's eager backward for torch's AdamW: nothing. The hand-over is the
    weight's product, as torch's backward forms its gradient, written into a block shared by
    the weights of its width; the step puts every weight's rows in the selection's order and
    in fp32 at once (one gather and one conversion per block). The columns' scores are taken
    at the step, for every weight together, and only where a selection or the "auto" rule
    reads them. Before: a gather of the batch's columns per weight, and for bf16 a conversion
    per weight."""
    zenflow_ops = per_extra_layer(True, "backward", dtype=dtype)
    torch_ops = per_extra_layer(None, "backward", dtype=dtype)
    added = {
        op: zenflow_ops.get(op, 0.0) - torch_ops.get(op, 0.0)
        for op in zenflow_ops | torch_ops
        if zenflow_ops.get(op, 0.0) != torch_ops.get(op, 0.0)
    }
    assert added == {}


def test_a_window_close_with_device_side_sums_adds_one_write_per_weight():
    """A window that closes away from a select boundary (select_interval 16: step 11) writes
    each weight's new unselected columns beside its selected ones, and nothing else per weight:
    every device-side sum crosses in one copy, every weight's step counts advance in one
    multi-tensor add. Before: an add per weight for its step counts."""
    per_layer = per_extra_layer(True, "step", steps=(11,), select_interval=16)
    assert per_layer == {"aten::index_copy_": 2.0}


def reselection_ops(layers: int, lr: float) -> tuple[collections.Counter, collections.Counter, int]:
    """With device-side sums (select_interval 8): the working operations of the select
    boundary at step 15 and of the window close after it (step 19), and how many weights'
    selections that boundary changed (``selected_columns`` before and after it)."""
    compiled, opt = training(layers, True, lr=lr)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    weights = [m.weight for m in compiled._orig_mod]
    activities = [torch.profiler.ProfilerActivity.CPU]
    counted, before = {}, None
    for i in range(20):
        compiled(x).square().mean().backward()
        if i == 15:
            before = [opt.selected_columns(w) for w in weights]
        with torch.profiler.profile(activities=activities) as stepped:
            opt.step()
            opt.zero_grad()
        counted[i] = collections.Counter(working_ops(stepped))
    changed = sum(
        not torch.equal(was, opt.selected_columns(w))
        for was, w in zip(before, weights, strict=True)
    )
    return counted[15], counted[19], changed


@pytest.mark.parametrize("lr", [0.0, 1e-3], ids=["same-columns", "columns-change"])
def test_a_select_boundary_moves_rows_only_for_the_weights_whose_columns_change(lr):
    """A select boundary with device-side sums, per extra layer: the columns' scores put in
    column order (on the host: every weight's rows are views of one product block, whose rows'
    norms are taken and sent to the host at once), the top-k choice (two sorts), and two column writes (the step's selected columns, the
    pending window's unselected ones). Per extra weight whose columns change, besides: the
    entering columns' host rows gathered for the transfer (master, moments, steps, the window
    sum's, and the sum's offset), the leaving rows taken from the device state and the entering
    ones put in their place (four each), and the entering columns written after their update,
    in the pass of the other writes (the new layout's order waits for the next step's write);
    at the window close after it, the leaving rows put in their host rows (four). The new
    layout's index arithmetic runs in numpy, which the profiler does not count. With ``lr`` 0
    every boundary chooses the columns it has. Before: every weight moved rows (empty ones
    where nothing changed), and the close after a select boundary moved host rows within each
    block, eight more empty operations per weight; and the scores took a norm and a square of
    each weight's two parts of rows, and their concatenation, on the device."""
    select_few, close_few, changed_few = reselection_ops(4, lr)
    select_many, close_many, changed_many = reselection_ops(10, lr)
    extra_changed = changed_many - changed_few
    assert (extra_changed > 0) == (lr > 0)
    per_weight = {
        "aten::empty_like": 1,
        "aten::index_put_": 1,
        "aten::sort": 2,
        "aten::sub": 1,
        "aten::index_copy_": 2,
    }
    per_changed_weight = {"aten::index_select": 9, "aten::index_copy_": 5}
    expected_select = collections.Counter({op: 6 * n for op, n in per_weight.items()})
    expected_select.update({op: extra_changed * n for op, n in per_changed_weight.items()})
    expected_close = {"aten::index_copy_": 6 * 2 + extra_changed * 4}
    assert _extra(select_few, select_many) == +expected_select
    assert _extra(close_few, close_many) == expected_close


def _extra(few: collections.Counter, many: collections.Counter) -> dict[str, int]:
    return {op: many[op] - few[op] for op in many | few if many[op] != few[op]}


class TensorsMade(TorchDispatchMode):
    """Counts, per operation, the new tensors that operations make (neither in place nor a
    view): on a GPU an allocation each, and a Python object each that the garbage collector
    counts towards its next pass."""

    def __init__(self):
        super().__init__()
        self.made = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        schema = func._schema
        if not schema.is_mutable and not any(r.alias_info for r in schema.returns):
            leaves = torch.utils._pytree.tree_leaves(out)
            made = sum(isinstance(leaf, torch.Tensor) for leaf in leaves)
            if made:
                self.made[func.overloadpacket.__name__] += made
        return out


def tensors_made_per_extra_layer(device_sums: bool | None) -> dict[str, float]:
    """The new tensors that an ordinary ``step()`` + ``zero_grad()`` makes with 10 layers
    beyond 4, per extra layer (the steps inside a window, after the first)."""
    made = []
    for layers in (4, 10):
        compiled, opt = training(layers, device_sums)
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
        counted = []
        for i in range(max(INSIDE_A_WINDOW) + 1):
            compiled(x).square().mean().backward()
            with TensorsMade() as mode:
                opt.step()
                opt.zero_grad()
            if i in INSIDE_A_WINDOW[1:]:
                counted.append(mode.made)
        assert all(c == counted[0] for c in counted), "steps of one kind make alike"
        made.append(counted[0])
    return _per_extra_layer(*made)


def test_an_ordinary_step_with_device_side_sums_makes_few_tensors_per_weight():
    """Per extra layer (a weight and a bias), what torch's foreach AdamW makes (a square root
    per parameter) or less: the norm of each of the weight's two parts and of the bias (one
    multi-tensor norm for all of them). The device update's denominators and updates are formed
    in buffers kept from step to step. Before: a square root and a product per parameter."""
    assert tensors_made_per_extra_layer(None) == {"_foreach_sqrt": 2.0}
    assert tensors_made_per_extra_layer(True) == {"_foreach_norm": 3.0}


def peak_new_objects(layers: int, device_sums: bool | None, dtype: torch.dtype) -> int:
    """The most objects that the garbage collector counts as new at one time during an
    ordinary training step (forward, backward, ``step()``, ``zero_grad()``): the smallest
    generation-0 threshold at which such a step sets off no pass, one probe per step, on the
    steps inside the first window (update_interval 32). ``device_sums`` None: torch's AdamW."""
    compiled, opt = training(layers, device_sums, 64, dtype, update_interval=32)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0)).to(dtype)

    def step():
        compiled(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):  # the first selection, the first step of its layout
        step()
    passes = []

    def count(phase, info):
        if phase == "start":
            passes.append(info["generation"])

    thresholds = gc.get_threshold()
    low, high = 1, 1 << 14
    gc.callbacks.append(count)
    try:
        while low < high:  # 14 probes: steps 3 to 16, all inside the window
            probe = (low + high) // 2
            gc.collect()
            passes.clear()
            gc.set_threshold(probe, 1 << 20, 1 << 20)
            step()
            gc.set_threshold(*thresholds)
            low, high = (probe + 1, high) if passes else (low, probe)
    finally:
        gc.set_threshold(*thresholds)
        gc.callbacks.remove(count)
    return low


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_an_ordinary_step_keeps_no_more_objects_alive_per_layer_than_torchs(dtype):
    """The garbage collector's young pass comes once a step holds 700 new objects at once (a
    few hundred microseconds, and each pass moves what is alive into older generations, whose
    full passes walk every object of a compiled model: a fraction of a second). Per extra
    layer, a step with device-side sums holds no more at its peak than the same model's step
    with torch's AdamW (3 here: the forward's and backward's), to the measure's resolution: the
    peaks of two steps of one kind differ by an object or two now and then (torch's step has
    measured 2.75 per layer in a full run, 3.0 alone), a quarter over the 8 extra layers.
    Before: 6.6 (fp32) and 8.6 (bf16) per layer, from the step's view of each 1-D parameter
    and of its gradient, a pair of them per parameter, a tuple of the norm's parts per weight,
    the rows split per weight and then again into its two parts, and each weight's selected
    columns' values."""

    def per_layer(device_sums):
        few, many = (peak_new_objects(n, device_sums, dtype) for n in (4, 12))
        return (many - few) / 8

    assert per_layer(True) <= per_layer(None) + 0.25


def test_a_step_in_two_device_calls_keeps_the_buffers_of_each():
    """Gradients scaled through ``.grad`` (as an unscaling AMP loop does) give the owned weights
    another coefficient than the 1-D parameters: the device update runs in two calls, each
    with buffers of its own kept from step to step. Before: one set for both, remade by each
    call, every step."""
    compiled, opt = training(4, True)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    made = []
    for i in range(max(INSIDE_A_WINDOW) + 1):
        compiled(x).square().mean().backward()
        for p in compiled.parameters():
            p.grad.mul_(0.5)
        with TensorsMade() as mode:
            opt.step()
            opt.zero_grad()
        if i in INSIDE_A_WINDOW[1:]:
            made.append(mode.made)
    assert all(m["empty"] == 0 and m == made[0] for m in made), made


class ForeachCalls(TorchDispatchMode):
    """Records each multi-tensor operation's name and the number of tensors in its first list."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name.startswith("_foreach_"):
            self.calls.append((name, len(args[0])))
        return func(*args, **(kwargs or {}))


# The device update's AdamW element operations (the moments, the denominators, the masters).
ADAMW_ELEMENT_OPS = ("_foreach_lerp_", "_foreach_addcmul_", "_foreach_sqrt_", "_foreach_sub_")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_device_update_runs_over_a_block_per_width_whatever_the_layers(dtype):
    """The device update's AdamW operations take the weights' selected rows as one block per
    row width, and the 1-D parameters as another (here every row is 32 wide: two tensors), for
    4 layers as for 10; only the copies into and out of the blocks take a tensor per weight or
    bias. Before: every operation took a tensor per weight and per bias (8 and 20)."""
    for layers in (4, 10):
        compiled, opt = training(layers, True, dtype=dtype)
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0)).to(dtype)
        for _ in range(max(INSIDE_A_WINDOW) + 1):
            compiled(x).float().square().mean().backward()
            with ForeachCalls() as mode:
                opt.step()
                opt.zero_grad()
        element_ops = [(name, n) for name, n in mode.calls if name in ADAMW_ELEMENT_OPS]
        assert sorted(name for name, _ in element_ops) == sorted(ADAMW_ELEMENT_OPS)
        assert {n for _, n in element_ops} == {2}, (layers, element_ops)
