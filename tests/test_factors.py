"""A gradient staged as factors (x, dy) behaves as the gradient x.T @ dy staged as rows."""

import pytest
import torch
from torch.testing import assert_close

from zenflow.runtime.comm import DataParallel
from zenflow.runtime.split_weight import SplitWeight


def split_pair(out=24, columns=40, selected=(3, 7, 11, 30)):
    weights = []
    for _ in range(2):
        param = torch.nn.Parameter(torch.randn(out, columns, generator=torch.Generator()))
        w = SplitWeight(param, 0, DataParallel(2, None), pin=False)
        w.reselect(torch.tensor(selected))
        weights.append(w)
    return weights


def test_factors_give_the_norm_scores_and_rows_of_their_product():
    g = torch.Generator().manual_seed(0)
    as_rows, as_factors = split_pair()
    assert as_factors.stages_on_host
    parts = [(torch.randn(3, 40, generator=g), torch.randn(3, 24, generator=g)) for _ in range(2)]
    grad_t = sum(x.t() @ dy for x, dy in parts)  # two micro-batches: [columns, out]
    for x, dy in parts:
        as_factors.stage_factors(x.t(), dy)
        as_rows.stage(grad_t.index_select(0, as_rows.order) / 2)
    for w in (as_rows, as_factors):
        w.reduce_staged()

    norm_sq = torch.tensor(float(grad_t.double().square().sum()))
    for w in (as_rows, as_factors):
        assert_close(w.staged_norm_sq().float(), norm_sq, rtol=1e-5, atol=0)
    assert_close(as_factors.column_scores(), grad_t.square().sum(1), rtol=1e-5, atol=1e-5)
    assert_close(as_rows.column_scores(), grad_t.square().sum(1), rtol=1e-5, atol=1e-5)
    assert_close(as_factors.selected_rows(), as_rows.selected_rows(), rtol=1e-5, atol=1e-5)
    assert_close(as_factors.unselected_rows(), as_rows.unselected_rows(), rtol=1e-5, atol=1e-5)
    sums = [torch.ones(36, 24), torch.ones(36, 24)]
    as_rows.add_unselected_to(sums[0], 0.5)
    as_factors.add_unselected_to(sums[1], 0.5)
    assert_close(sums[1], sums[0], rtol=1e-5, atol=1e-5)
    assert as_factors.staged_bytes == 2 * (3 * 40 + 3 * 24) * 4


def test_mixing_rows_and_factors_in_one_step_is_refused():
    w = split_pair()[0]
    w.stage(torch.zeros(40, 24))
    with pytest.raises(RuntimeError, match="as rows and as factors"):
        w.stage_factors(torch.zeros(40, 2), torch.zeros(2, 24))
    w.discard_staged()
    w.stage_factors(torch.zeros(40, 2), torch.zeros(2, 24))
    with pytest.raises(RuntimeError, match="as rows and as factors"):
        w.stage(torch.zeros(40, 24))


def test_deferred_steps_sum_into_the_window_as_their_rows_would():
    g = torch.Generator().manual_seed(1)
    deferred, added = split_pair()
    sums = torch.zeros(36, 24)
    for alpha in (1.0, 0.5, 2.0):  # clip coefficients differ from step to step
        x, dy = torch.randn(3, 40, generator=g), torch.randn(3, 24, generator=g)
        for w in (deferred, added):
            w.discard_staged()
            w.stage_factors(x.t(), dy)
        assert deferred.defer_unselected(alpha)
        added.add_unselected_to(sums, alpha)
    window = torch.zeros(36, 24)
    deferred.sum_deferred_into(window)
    assert_close(window, sums, rtol=1e-5, atol=1e-5)
    assert deferred.window_factors == []
    deferred.discard_staged()
    deferred.stage(torch.zeros(40, 24))
    assert not deferred.defer_unselected(1.0)  # rows are added at once, not deferred
