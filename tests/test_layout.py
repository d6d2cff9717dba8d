"""Column layouts and their migrations: pure plans, and the rows they move land where the new
layout says their columns are."""

import pytest
import torch

from zenflow.runtime.comm import DataParallel
from zenflow.runtime.layout import ColumnLayout
from zenflow.runtime.migration import move_rows
from zenflow.runtime.schedule import Schedule, closes_window, lr_scale, reselects, step_kind


def two_rank_layout(rank: int) -> ColumnLayout:
    return ColumnLayout.natural(4, rank, [(0, 2), (2, 4)])


def test_the_first_selection_puts_each_blocks_selected_columns_first():
    migration = two_rank_layout(0).reselect(torch.tensor([1, 2]))
    layout = migration.layout
    assert layout.device_columns.tolist() == [1, 2]
    assert [o.tolist() for o in layout.local_orders] == [[1, 0], [2, 3]]
    assert layout.k_locals == (1, 1) and layout.order().tolist() == [1, 2, 0, 3]
    assert layout.host_columns.tolist() == [0] and layout.unselected_counts == [1, 1]
    # Rank 0 owns column 1's host rows (row 1), not column 2's; the device rows are rebuilt in
    # column order; column 0's host row moves behind column 1's.
    assert migration.entering.tolist() == [1, 2]
    assert migration.entering_owned.tolist() == [True, False]
    assert migration.entering_host_rows.tolist() == [1]
    assert migration.entering_device_rows.tolist() == [0, 1]
    assert [t.tolist() for t in migration.host_moves] == [[0], [1]]
    assert migration.leaving_device_rows.numel() == 0


def test_a_selection_of_the_same_size_replaces_leaving_rows_in_place():
    layout = two_rank_layout(1).reselect(torch.tensor([1, 2])).layout
    before = (layout.device_columns.clone(), [o.clone() for o in layout.local_orders])
    migration = layout.reselect(torch.tensor([1, 3]))
    after = migration.layout
    assert after.device_columns.tolist() == [1, 3]  # 3 takes 2's device row
    assert [o.tolist() for o in after.local_orders] == [[1, 0], [3, 2]]
    assert migration.entering_device_rows.tolist() == [1]
    assert migration.leaving_device_rows.tolist() == [1]  # rank 1 owns column 2
    assert migration.leaving_host_rows.tolist() == [1]
    assert [t.numel() for t in migration.host_moves] == [0, 0]  # 2's host row was stale
    # Pure: the layout it started from is unchanged.
    assert torch.equal(layout.device_columns, before[0])
    assert all(torch.equal(a, b) for a, b in zip(layout.local_orders, before[1], strict=True))


def test_nothing_selected_is_the_natural_order():
    layout = ColumnLayout.natural(5, 0, [(0, 5)])
    assert layout.natural_order and layout.k == 0
    assert layout.order().tolist() == list(range(5))
    assert not layout.reselect(torch.tensor([2])).layout.natural_order


@pytest.mark.parametrize("k", [1, 7, 16])
def test_moved_rows_follow_their_columns_through_many_reselections(k):
    """Each column's rows hold its id: after every migration the device rows hold the selected
    columns' ids in device row order and the host rows the unselected columns' in host row
    order, with no column's state lost or duplicated."""
    columns, out = 16, 3
    layout = ColumnLayout.natural(columns, 0, [(0, columns)])
    ids = torch.arange(columns, dtype=torch.float32)[:, None].expand(columns, out)
    host, device = ids.clone(), torch.empty(0, out)
    steps_host, steps_device = torch.arange(columns), torch.empty(0, dtype=torch.int64)
    g = torch.Generator().manual_seed(k)
    for _ in range(12):
        selected = torch.randperm(columns, generator=g)[:k].sort().values
        migration = layout.reselect(selected)
        pairs = [(host, device), (steps_host, steps_device)]
        (device, steps_device), to_host, to_device = move_rows(
            migration, pairs, DataParallel(), False
        )
        layout = migration.layout
        assert torch.equal(device[:, 0], layout.device_columns.float())
        assert torch.equal(steps_device, layout.device_columns)
        assert torch.equal(host[layout.k_local :, 0], layout.host_columns.float())
        assert torch.equal(steps_host[layout.k_local :], layout.host_columns)
        assert to_host == migration.rows_to_host * (out * 4 + 8)
        assert to_device == migration.rows_to_device * (out * 4 + 8)


def test_step_kinds_follow_the_schedule():
    schedule = Schedule(warm_up_rounds=2, select_interval=4, update_interval=2, selects=True)
    kinds = [step_kind(schedule, committed) for committed in range(8)]
    assert [k.warm_up for k in kinds] == [True, True] + [False] * 6
    # The first selection before step 0 after warm-up is committed, the next ones after each
    # select boundary is.
    assert [k.select for k in kinds] == [False, False, True] + [False] * 5
    assert [k.update_boundary for k in kinds] == [False, False] + [False, True] * 3
    assert [k.select_boundary for k in kinds] == [False] * 5 + [True, False, False]
    assert [reselects(schedule, k) for k in kinds] == [False] * 5 + [True, False, False]
    assert not any(closes_window(k, auto_fired=True) for k in kinds[:2])
    never = schedule._replace(selects=False)  # topk_ratio 0: nothing is ever selected
    assert not any(step_kind(never, committed).select for committed in range(8))
    assert not any(reselects(never, step_kind(never, committed)) for committed in range(8))


def test_auto_windows_close_when_the_rule_fires_or_at_a_select_boundary():
    schedule = Schedule(warm_up_rounds=0, select_interval=6, update_interval=None, selects=True)
    kinds = [step_kind(schedule, committed) for committed in range(6)]
    assert [closes_window(k, auto_fired=False) for k in kinds] == [False] * 5 + [True]
    assert all(closes_window(k, auto_fired=True) for k in kinds)
    assert lr_scale(schedule, 4) == 2.0 and lr_scale(schedule._replace(update_interval=2), 4) == 1.0
