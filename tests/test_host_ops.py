"""What an ordinary step costs the training thread per weight, counted in operations.

On a GPU each operation the host dispatches is a kernel launch: a step whose operations grow
by many per weight leaves the device waiting on a model of many small weights. The count is
the same on the CPU for the same code path, so it is tested here: the top-level aten
operations that move data (views and no-op conversions left out) of ``step()`` +
``zero_grad()``, for 4 and for 10 layers (a weight and a bias each), on the steps inside a
window (``benchmarks/bench_host_ops.py`` prints them for every kind of step).
"""

import collections

import pytest
import torch

import zenflow

NO_WORK = {
    "aten::t",
    "aten::view",
    "aten::slice",
    "aten::permute",
    "aten::detach",
    "aten::unsqueeze",
    "aten::select",
    "aten::as_strided",
    "aten::transpose",
    "aten::resolve_conj",
    "aten::resolve_neg",
    "aten::split_with_sizes",
    "aten::empty",
    "aten::new_empty",
}
MAYBE_COPY = {"aten::to", "aten::reshape", "aten::contiguous"}
COPIES = {"aten::_to_copy", "aten::copy_", "aten::clone"}
# Steps of the first select cycle (8 steps, update_interval 4) inside a window: 0 selects first,
# 3 closes a window, 7 closes one and selects.
INSIDE_A_WINDOW = (1, 2, 4, 5, 6)


def working_ops(prof) -> list[str]:
    children = collections.defaultdict(list)
    for event in prof.events():
        if event.cpu_parent is not None:
            children[id(event.cpu_parent)].append(event)

    def copies(event) -> bool:
        return any(c.name in COPIES or copies(c) for c in children[id(event)])

    ops = []
    for event in prof.events():
        if not event.name.startswith("aten::") or event.name in NO_WORK:
            continue
        caller = event.cpu_parent
        while caller is not None and not caller.name.startswith("aten::"):
            caller = caller.cpu_parent
        if caller is None and (event.name not in MAYBE_COPY or copies(event)):
            ops.append(event.name)
    return ops


def ordinary_step_ops(layers: int, device_sums: bool) -> list[str]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(layers)))
    opt = zenflow.ZenFlowAdamW(
        model.parameters(),
        lr=1e-3,
        topk_ratio=0.25,
        update_interval=4,
        select_interval=8,
        overlap_step=True,
        accumulate_on_device=device_sums,
        step_backend="eager",
    )
    compiled = torch.compile(model, backend="zenflow", options={"inner": "eager"})
    x = torch.randn(4, 32)
    counted = []
    for i in range(8):
        compiled(x).square().mean().backward()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            opt.step()
            opt.zero_grad()
        if i in INSIDE_A_WINDOW:
            counted.append(working_ops(prof))
    assert all(ops == counted[0] for ops in counted), "steps of one kind dispatch alike"
    return counted[0]


@pytest.mark.parametrize("device_sums", [True, False], ids=["device-sums", "host-sums"])
def test_an_ordinary_step_dispatches_a_few_operations_per_weight(device_sums):
    """Per extra layer: the weight's norm (a sum of its scores) and the write of its selected
    columns; the 1-D parameters and the device-side sums go through multi-tensor operations
    (one for every weight), and with host-side sums the small batch's factors add three
    products. Before: an addition per weight and per bias into the norm, a norm and a power
    per bias, a copy per bias, an add per device-side sum."""
    few, many = (collections.Counter(ordinary_step_ops(n, device_sums)) for n in (4, 10))
    per_layer = {op: (many[op] - few[op]) / 6 for op in many | few if many[op] != few[op]}
    expected = {"aten::sum": 1.0, "aten::index_copy_": 1.0}
    if not device_sums:
        # Factors (batch 4 against 32 columns): the norm from x x^T and dy dy^T, the selected
        # rows from their product, the batch's columns gathered for it.
        expected |= {"aten::matmul": 3.0, "aten::mul": 1.0, "aten::index_select": 1.0}
        expected["aten::to"] = 2.0
    assert per_layer == expected
