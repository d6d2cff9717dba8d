"""Synchronizations with the device: one counting helper, and budgets per kind of step."""

import ast
import pathlib

import pytest
import torch

import zenflow.runtime
from zenflow.optimizer import ZenFlowAdamW
from zenflow.runtime import staging as staging_strategies
from zenflow.runtime.streams import CopyStream

RUNTIME = pathlib.Path(zenflow.runtime.__file__).parent
HELPER = RUNTIME / "host_sync.py"
NOT_IN_A_STEP = {
    RUNTIME / "cpu_adam.py",  # the CPU pool's binding: host memory and Python numbers only
    RUNTIME / "reshard.py",  # once, when a checkpoint loads at another world size
}
# Methods that wait for a device (or read a value it computed), and builtins that do so when
# given a tensor: outside the helper, the runtime calls none of them, whatever the argument.
WAITING_METHODS = {"item", "cpu", "tolist", "synchronize"}
WAITING_BUILTINS = {"float", "bool"}


def waiting_calls(path: pathlib.Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        function = node.func
        if isinstance(function, ast.Attribute) and function.attr in WAITING_METHODS:
            found.append(f"{path.name}:{node.lineno} .{function.attr}()")
        if isinstance(function, ast.Name) and function.id in WAITING_BUILTINS:
            found.append(f"{path.name}:{node.lineno} {function.id}()")
    return found


def test_the_runtime_waits_for_the_device_only_through_the_helper():
    sources = sorted(p for p in RUNTIME.rglob("*.py") if p != HELPER and p not in NOT_IN_A_STEP)
    assert len(sources) > 20
    found = [call for path in sources for call in waiting_calls(path)]
    assert found == [], "waits outside zenflow/runtime/host_sync.py: " + ", ".join(found)
    assert waiting_calls(HELPER), "the helper itself holds the waits the scan looks for"


WIDTH = 12
issued_copies: list[torch.dtype] = []  # by the copy-stream spy of a test that installs it


def syncs_by_step(
    weights: int,
    *,
    copy_stream: bool,
    copies: list | None = None,
    dtype: torch.dtype = torch.float32,
    **settings,
) -> list[tuple[str, int]]:
    """Trains a stack of ``weights`` Linear layers (in ``dtype``) for 12 steps (update_interval
    2, select_interval 4, overlap_step unless given) and returns each step's kind and the
    synchronizations it took; appends to ``copies`` (if given) each step's copies (the dtypes
    copied), recorded in ``issued_copies`` by a test's spy."""
    torch.manual_seed(0)
    layers = []
    for _ in range(weights):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers).to(dtype)
    options = dict(topk_ratio=0.25, update_interval=2, select_interval=4, overlap_step=True)
    options.update(settings)
    if copy_stream:
        staging_strategies._stage_like_a_gpu_weight_for_tests(True)
    try:
        opt = ZenFlowAdamW(model.parameters(), lr=1e-2, step_backend="eager", **options)
    finally:
        staging_strategies._stage_like_a_gpu_weight_for_tests(False)
    g = torch.Generator().manual_seed(1)
    counted = []
    for _step in range(12):
        x = (torch.randn(4, WIDTH, generator=g) * torch.linspace(0.1, 3.0, WIDTH)).to(dtype)
        opt.zero_grad()
        model(x).square().mean().backward()
        before = opt.stats()
        issued_copies.clear()
        opt.step()
        if copies is not None:
            copies.append(list(issued_copies))
        after = opt.stats()
        closed = after["cpu_updates"] > before["cpu_updates"]
        selected = after["reselections"] > before["reselections"]
        kind = "select" if selected else "window close" if closed else "ordinary"
        counted.append((kind, after["device_syncs"] - before["device_syncs"]))
    return counted


BUDGETS = {"ordinary": 1, "window close": 2, "select": 8}
STRATEGIES = {
    "host block": dict(copy_stream=False),
    "copy stream": dict(copy_stream=True),
    "device sums": dict(copy_stream=False, accumulate_on_device=True),
    "synchronous updates": dict(copy_stream=True, overlap_step=False),
    "offload": dict(copy_stream=True, offload=True),
    "update_interval auto": dict(
        copy_stream=True, update_interval="auto", min_update_interval=2, max_update_interval=4
    ),
    "update_interval auto, device sums": dict(
        copy_stream=False,
        accumulate_on_device=True,
        update_interval="auto",
        min_update_interval=2,
        max_update_interval=4,
    ),
}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_step_synchronizes_within_its_budget_whatever_the_number_of_weights(strategy):
    few = syncs_by_step(6, **STRATEGIES[strategy])
    many = syncs_by_step(24, **STRATEGIES[strategy])
    assert few == many
    kinds = [kind for kind, _ in few]
    assert kinds.count("ordinary") >= 4 and kinds.count("select") == 4
    over = [(step, kind, n) for step, (kind, n) in enumerate(few) if n > BUDGETS[kind]]
    assert over == [], f"steps over budget {BUDGETS}: {over}"


def test_an_overlapped_window_close_with_device_side_sums_synchronizes_as_an_ordinary_step():
    """The CPU update that reads the shipped sums is submitted by the copy stream's host thread
    once they land: the training thread waits only for the step's norm, and a select boundary
    once more, for its leaving rows. Before: once more each, for the sums' copy."""
    counted = syncs_by_step(6, copy_stream=False, accumulate_on_device=True)
    by_kind = {kind: {n for k, n in counted[1:] if k == kind} for kind, _ in counted}
    assert by_kind == {"ordinary": {1}, "window close": {1}, "select": {2}}


@pytest.fixture
def copies_to_host(monkeypatch):
    """Records the dtype of every copy to the host in ``issued_copies``."""
    copy_to_host = CopyStream.copy_to_host

    def recording(self, source, out=None, owned=False):
        issued_copies.append(source.dtype)
        return copy_to_host(self, source, out=out, owned=owned)

    monkeypatch.setattr(CopyStream, "copy_to_host", recording)


def test_a_reselection_sends_its_rows_to_the_host_in_one_copy_per_dtype(copies_to_host):
    """A step that reselects copies the leaving columns' rows of every weight to the host
    together, on the copy stream (its CPU twin here), one copy per dtype (fp32 values and
    moments, int64 step counts), for 6 weights as for 24; other steps none (staging in host
    blocks copies nothing). The first selection, once a run, is left out: no column leaves."""
    few, many = [], []
    kinds = syncs_by_step(6, copy_stream=False, copies=few)
    syncs_by_step(24, copy_stream=False, copies=many)
    assert few[1:] == many[1:]
    for (kind, _), copied in zip(kinds[1:], few[1:], strict=True):  # after the first selection
        assert sorted(copied, key=str) == ([torch.float32, torch.int64] if kind == "select" else [])


def test_offloaded_state_leaves_the_selection_without_a_copy(copies_to_host):
    """With offload the selected columns' state lives on the host: at a select boundary their
    leaving rows are where they go, so the step copies to the host only what every step does
    (the selected rows' gradient) and waits for no copy of state. A GPU run waited for one
    such host-to-host copy at the window close after each boundary, a CPU-only run not (its
    device and host copies share one stream), so the two counted differently."""
    copied = []
    kinds = syncs_by_step(6, copy_stream=True, offload=True, copies=copied)
    ordinary = [c for (kind, _), c in zip(kinds, copied, strict=True) if kind == "ordinary"]
    assert ordinary
    for (kind, _), c in zip(kinds, copied, strict=True):
        assert c == ordinary[0], kind


def test_a_window_close_ships_every_device_side_sum_in_one_copy(copies_to_host):
    """Device-side sums: a step that closes a window sends every weight's sum (in the
    parameter's dtype) to the host side by side, in one copy, for 6 weights as for 24; a
    select boundary adds the leaving rows' copies (fp32 values and moments, int64 steps)."""
    few, many = [], []
    kinds = syncs_by_step(6, copy_stream=False, copies=few, accumulate_on_device=True)
    syncs_by_step(24, copy_stream=False, copies=many, accumulate_on_device=True)
    assert few[1:] == many[1:]
    shipped = {"ordinary": [], "window close": [torch.float32]}
    shipped["select"] = [torch.float32, torch.float32, torch.int64]
    for (kind, _), copied in zip(kinds[1:], few[1:], strict=True):  # after the first selection
        assert sorted(copied, key=str) == shipped[kind], kind


@pytest.mark.parametrize("device_sums", [False, True], ids=["host-sums", "device-sums"])
def test_a_window_close_sends_every_weights_new_columns_in_one_copy(monkeypatch, device_sums):
    """A bf16 model: the CPU update rounds every weight's new unselected rows into one buffer,
    sent to the device in one copy when the update is applied (the copy-stream twin on the
    CPU), for 6 weights as for 24; a step that applies none sends none."""
    copy_to_device = CopyStream.copy_to_device

    def recording(self, source):
        issued_copies.append(source.dtype)
        return copy_to_device(self, source)

    monkeypatch.setattr(CopyStream, "copy_to_device", recording)
    settings = dict(copy_stream=False, dtype=torch.bfloat16, accumulate_on_device=device_sums)
    few, many = [], []
    kinds = syncs_by_step(6, copies=few, **settings)
    syncs_by_step(24, copies=many, **settings)
    assert few == many
    # Overlapped: the first window's update is applied at the second close (step 3).
    for step, ((kind, _), copied) in enumerate(zip(kinds, few, strict=True)):
        applies = kind != "ordinary" and step >= 3
        assert copied == ([torch.bfloat16] if applies else []), (step, kind)


def test_training_on_the_cpu_never_starts_cuda_on_a_machine_with_a_gpu(monkeypatch):
    """Every counted synchronization of a CPU-only run leaves CUDA alone: starting it would
    put a context on GPU 0 (hundreds of MB) and fail in a forked child of a process that
    started it. Stood in for here: CUDA reported available, and the calls that start it (the
    sync debug mode's) raising."""

    def starts_cuda(*args):
        raise AssertionError("a CPU-only run started CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", starts_cuda)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", starts_cuda)
    kinds = syncs_by_step(3, copy_stream=True)
    assert {kind for kind, _ in kinds} >= {"select", "window close", "ordinary"}
    assert sum(count for _, count in kinds) > 0
