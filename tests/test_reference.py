"""The oracle checked against torch.optim.AdamW and against hand computation."""

import math

import pytest
import torch
from torch.testing import assert_close

from zenflow.reference import ReferenceZenFlowAdamW

TOL = dict(rtol=1e-5, atol=1e-6)


def make_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(5, 7), (5,), (3, 2, 2, 2), (4, 5)]
    return [torch.randn(s, generator=g).requires_grad_() for s in shapes]


def grad_sequence(params, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=g) for p in params] for _ in range(steps)]


def clone(params):
    return [p.detach().clone().requires_grad_() for p in params]


def apply_grads(params, grads):
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()


def tiny_mlp_batches(steps, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    data = [(torch.randn(8, 6), torch.randn(8, 3)) for _ in range(steps)]
    return model, data


def train(model, opt, data):
    for x, y in data:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.parametrize(
    "zenflow_args",
    [
        dict(topk_ratio=1.0, update_interval=4, select_interval=8),
        dict(topk_ratio=0.0, update_interval=1, select_interval=1),
        dict(topk_ratio=1.0, update_interval=2, select_interval=4, overlap_step=True),
    ],
    ids=["topk1", "topk0-update1", "topk1-overlap"],
)
def test_degenerate_ratios_equal_adamw_on_a_model(zenflow_args):
    hyper = dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.05)
    model, data = tiny_mlp_batches(50)
    twin, _ = tiny_mlp_batches(50)
    train(model, torch.optim.AdamW(model.parameters(), foreach=False, **hyper), data)
    train(twin, ReferenceZenFlowAdamW(twin.parameters(), **hyper, **zenflow_args), data)
    for expected, actual in zip(model.parameters(), twin.parameters(), strict=True):
        assert_close(actual, expected, **TOL)


@pytest.mark.parametrize("update_interval", [2, 3])
def test_plain_offload_windows_equal_windowed_adamw(update_interval):
    """topk 0: weights take one AdamW step per window on the window's mean gradient, with the lr
    of the closing step; 1-D parameters step every step."""
    steps = 4 * update_interval
    params = make_params()
    grads = grad_sequence(params, steps)
    hyper = dict(betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)

    def lr_at(step):
        return 1e-2 / (1 + step)

    zen = ReferenceZenFlowAdamW(
        params,
        lr=lr_at(0),
        **hyper,
        topk_ratio=0.0,
        update_interval=update_interval,
        select_interval=update_interval,
    )
    zen_schedule = torch.optim.lr_scheduler.LambdaLR(zen, lambda t: lr_at(t) / lr_at(0))

    weights = [p for p in clone(params) if p.dim() >= 2]
    vectors = [p for p in clone(params) if p.dim() < 2]
    weight_opt = torch.optim.AdamW(weights, lr=1.0, foreach=False, **hyper)
    vector_opt = torch.optim.AdamW(vectors, lr=1.0, foreach=False, **hyper)
    window = []
    for t, step_grads in enumerate(grads):
        apply_grads(params, step_grads)
        zen.step()
        zen_schedule.step()

        apply_grads(vectors, [g for g in step_grads if g.dim() < 2])
        vector_opt.param_groups[0]["lr"] = lr_at(t)
        vector_opt.step()
        window.append([g for g in step_grads if g.dim() >= 2])
        if len(window) == update_interval:
            apply_grads(weights, [sum(gs) / update_interval for gs in zip(*window, strict=True)])
            weight_opt.param_groups[0]["lr"] = lr_at(t)
            weight_opt.step()
            window = []
        assert_close([p for p in params if p.dim() >= 2], weights, **TOL)
        assert_close([p for p in params if p.dim() < 2], vectors, **TOL)
    assert zen.cpu_updates == 4


def scalar_adamw(p, m, v, g, step, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, wd=0.0):
    p *= 1 - lr * wd
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    denom = math.sqrt(v) / math.sqrt(1 - beta2**step) + eps
    return p - lr / (1 - beta1**step) * m / denom, m, v


def test_reselection_migrates_state_with_per_column_steps():
    """One row, two columns, k = 1, update_interval 2, select_interval 2.

    Step 0 selects column 0 (device, every step); column 1 accumulates and takes one CPU step
    on the mean when the window closes after step 1, whose gradient then selects column 1: it
    continues from its CPU moments with step count 2, while column 0 accumulates and takes its
    third step when the next window closes (after which step 3's gradient selects it again)."""
    w = torch.tensor([[1.0, -1.0]], requires_grad=True)
    opt = ReferenceZenFlowAdamW(
        [w], lr=0.1, weight_decay=0.0, topk_ratio=0.5, update_interval=2, select_interval=2
    )
    grads = [[3.0, 0.5], [1.5, 2.0], [0.1, 4.0], [3.0, 0.3]]
    for g in grads:
        w.grad = torch.tensor([g])
        opt.step()

    c0 = (1.0, 0.0, 0.0)
    c0 = scalar_adamw(*c0, 3.0, 1)
    c0 = scalar_adamw(*c0, 1.5, 2)
    c0 = scalar_adamw(*c0, (0.1 + 3.0) / 2, 3)
    c1 = (-1.0, 0.0, 0.0)
    c1 = scalar_adamw(*c1, (0.5 + 2.0) / 2, 1)
    c1 = scalar_adamw(*c1, 4.0, 2)
    c1 = scalar_adamw(*c1, 0.3, 3)

    state = opt.state[w]
    assert state["selected"].tolist() == [0]
    assert state["column_steps"].tolist() == [3, 3]
    assert_close(w.detach(), torch.tensor([[c0[0], c1[0]]]), **TOL)
    assert_close(state["exp_avg"], torch.tensor([[c0[1], c1[1]]]), **TOL)
    assert_close(state["exp_avg_sq"], torch.tensor([[c0[2], c1[2]]]), **TOL)
    assert opt.reselections == 3 and opt.cpu_updates == 2


def test_overlap_is_exactly_one_window_stale():
    """Windows close after steps 1, 3, 5, ...; with overlap the unselected columns show, after
    step t, what the synchronous run showed two steps before the last close, across the select
    boundary after step 7 too: there the columns entering the selection take the closing
    window's update at once, and the columns leaving it show their device values until the
    next close."""
    params = make_params()
    grads = grad_sequence(params, 12)
    common = dict(lr=1e-2, topk_ratio=0.25, update_interval=2, select_interval=8)
    sync_params, overlap_params = clone(params), clone(params)
    sync = ReferenceZenFlowAdamW(sync_params, **common)
    overlap = ReferenceZenFlowAdamW(overlap_params, overlap_step=True, **common)
    shown_by_sync = []
    selected_before = {}
    for t, step_grads in enumerate(grads):
        apply_grads(sync_params, step_grads)
        apply_grads(overlap_params, step_grads)
        if t == 7:
            selected_before = {
                i: overlap.state[p]["selected"]
                for i, p in enumerate(overlap_params)
                if p.dim() >= 2
            }
        sync.step()
        overlap.step()
        shown_by_sync.append([p.detach().clone() for p in sync_params])
        last_close = t if t % 2 == 1 else t - 1
        expected = shown_by_sync[last_close - 2] if last_close >= 3 else params
        for i, p in enumerate(overlap_params):
            if p.dim() < 2:
                assert_close(p, sync_params[i], **TOL)
                continue
            selected = overlap.state[p]["selected"]
            assert torch.equal(selected, sync.state[sync_params[i]]["selected"])
            current = torch.zeros(overlap.state[p]["column_steps"].numel(), dtype=torch.bool)
            current[selected] = True
            leaving = torch.zeros_like(current)
            if t in (7, 8):
                leaving[selected_before[i]] = True
                leaving &= ~current
            stale = ~current & ~leaving
            view = p.detach().reshape(p.shape[0], -1)
            synced = sync_params[i].reshape(view.shape)
            assert_close(view[:, stale], expected[i].reshape(view.shape)[:, stale], **TOL)
            assert_close(view[:, ~stale], synced[:, ~stale], **TOL)
        if t == 8:
            assert any(
                not torch.equal(selected_before[i], overlap.state[p]["selected"])
                for i, p in enumerate(overlap_params)
                if p.dim() >= 2
            ), "the select boundary changed no selection: the test shows nothing"
    overlap.flush()
    sync.flush()
    assert_close(overlap_params, sync_params, **TOL)


def test_flush_applies_the_pending_overlapped_update():
    params = make_params()
    grads = grad_sequence(params, 3)
    common = dict(lr=1e-2, topk_ratio=0.0, update_interval=2, select_interval=10)
    sync_params, overlap_params = clone(params), clone(params)
    sync = ReferenceZenFlowAdamW(sync_params, **common)
    overlap = ReferenceZenFlowAdamW(overlap_params, overlap_step=True, **common)
    for step_grads in grads:
        for ps in (sync_params, overlap_params):
            apply_grads(ps, step_grads)
        sync.step()
        overlap.step()
    assert not torch.equal(sync_params[0], overlap_params[0])
    sync.flush()
    overlap.flush()
    assert_close(overlap_params, sync_params, **TOL)

    # The flushed partial window is averaged over its one committed step.
    weights = [p for p in clone(params) if p.dim() >= 2]
    adamw = torch.optim.AdamW(weights, lr=1e-2, foreach=False)
    for window in ([grads[0], grads[1]], [grads[2]]):
        per_weight = [[g for g in step if g.dim() >= 2] for step in window]
        apply_grads(weights, [sum(gs) / len(window) for gs in zip(*per_weight, strict=True)])
        adamw.step()
    assert_close([p for p in sync_params if p.dim() >= 2], weights, **TOL)


def test_warm_up_rounds_update_everything():
    params = make_params()
    grads = grad_sequence(params, 4)
    twin = clone(params)
    zen = ReferenceZenFlowAdamW(
        params, lr=1e-2, topk_ratio=0.2, update_interval=4, select_interval=4, full_warm_up_rounds=3
    )
    adamw = torch.optim.AdamW(twin, lr=1e-2, weight_decay=0.01, foreach=False)
    for t, step_grads in enumerate(grads):
        before = params[0].detach().clone()
        apply_grads(params, step_grads)
        apply_grads(twin, step_grads)
        zen.step()
        adamw.step()
        if t < 3:
            assert_close(params, twin, **TOL)
        else:
            unselected = torch.ones(7, dtype=torch.bool)
            unselected[zen.state[params[0]]["selected"]] = False
            assert torch.equal(params[0][:, unselected], before[:, unselected])
            assert not torch.equal(params[0][:, ~unselected], before[:, ~unselected])
    assert zen.state[params[0]]["column_steps"].tolist() == [4 if c else 3 for c in ~unselected]


def test_clipping_uses_the_global_norm_before_commit():
    params = make_params()
    grads = grad_sequence(params, 4)
    twin = clone(params)
    zen = ReferenceZenFlowAdamW(
        params, lr=1e-2, topk_ratio=0.0, update_interval=2, select_interval=2, max_grad_norm=0.5
    )
    weights = [p for p in twin if p.dim() >= 2]
    vectors = [p for p in twin if p.dim() < 2]
    weight_opt = torch.optim.AdamW(weights, lr=1e-2, foreach=False)
    vector_opt = torch.optim.AdamW(vectors, lr=1e-2, foreach=False)
    clipped_window = []
    for step_grads in grads:
        apply_grads(params, step_grads)
        zen.step()
        total = math.sqrt(sum(float((g.double() ** 2).sum()) for g in step_grads))
        coefficient = 0.5 / (total + 1e-6)
        assert coefficient < 1
        clipped = [g * coefficient for g in step_grads]
        apply_grads(vectors, [g for g in clipped if g.dim() < 2])
        vector_opt.step()
        clipped_window.append([g for g in clipped if g.dim() >= 2])
        if len(clipped_window) == 2:
            apply_grads(weights, [(a + b) / 2 for a, b in zip(*clipped_window, strict=True)])
            weight_opt.step()
            clipped_window = []
    assert_close(params, twin, **TOL)


def test_skipped_step_commits_nothing_and_does_not_count():
    params = make_params()
    grads = grad_sequence(params, 3)
    twin = clone(params)
    zen = ReferenceZenFlowAdamW(params, lr=1e-2, topk_ratio=0.0, update_interval=2)
    apply_grads(params, grads[0])
    assert zen.step()
    snapshot = {k: v.clone() for k, v in zen.state[params[0]].items() if torch.is_tensor(v)}
    values = [p.detach().clone() for p in params]
    bad = [g.clone() for g in grads[1]]
    bad[2].view(-1)[3] = float("inf")
    apply_grads(params, bad)
    assert not zen.step()
    assert zen.skipped_steps == 1 and zen.committed_steps == 1 and zen.window_steps == 1
    for key, tensor in snapshot.items():
        assert torch.equal(zen.state[params[0]][key], tensor), key
    assert all(torch.equal(p, v) for p, v in zip(params, values, strict=True))

    apply_grads(params, grads[2])
    zen.step()
    weights = [p for p in twin if p.dim() >= 2]
    weight_opt = torch.optim.AdamW(weights, lr=1e-2, foreach=False)
    apply_grads(
        weights, [(a + b) / 2 for a, b in zip(grads[0], grads[2], strict=True) if a.dim() >= 2]
    )
    weight_opt.step()
    assert_close([p for p in params if p.dim() >= 2], weights, **TOL)


def test_injected_selection_is_used():
    w = torch.zeros(3, 4, requires_grad=True)
    zen = ReferenceZenFlowAdamW(
        [w],
        topk_ratio=0.5,
        update_interval=4,
        select_interval=4,
        selector=lambda p, scores, k: torch.tensor([3, 0][:k]),
    )
    w.grad = torch.ones(3, 4)
    zen.step()
    assert zen.selected_columns(w).tolist() == [3, 0]
    assert torch.count_nonzero(w.detach()[:, [1, 2]]) == 0
    assert torch.count_nonzero(w.detach()[:, [0, 3]]) == 6
