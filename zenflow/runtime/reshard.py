"""A ZenFlowAdamW checkpoint saved by one number of ranks, laid out for another.

Each rank's state dict holds, per weight, the host state of its block of columns (its rows in
that rank's local order: selected columns first, then the unselected ones it owns) and the
open window's sum of its unselected rows; the device state (the selected columns) and
everything else are the same on every rank. Resharding puts the saved rows back in natural
column order and cuts them along the new ranks' blocks::

    saved, 2 ranks:  rank 0 rows [c1 c0 c2]   rank 1 rows [c5 c3 c4]      (c1, c5 selected)
    natural:         c0 c1 c2 c3 c4 c5
    new, 3 ranks:    rank 0 [c1 c0]   rank 1 [c2 c3]   rank 2 [c5 c4]

The selection and the device state are kept as saved, so the run continues as it would have at
the old world size (up to the order of floating-point sums). A window's gradients kept as
matmul factors (one process, small batches) are multiplied into its sum here. The statistics
counters continue from saved rank 0's. One weight at a time is put in natural order: with the
saved files memory-mapped, a rank holds its own share and one weight's rows, not every rank's.
"""

from collections.abc import Callable

import torch

from zenflow.runtime.state_schema import WeightRecord, check_format, saved_weights

Block = Callable[[int, int], tuple[int, int]]


def reshard(states: list[dict], world_size: int, rank: int, block: Block) -> dict:
    """The state dict of ``rank`` of ``world_size`` from ``states``, every rank's state dict of
    the saved run in rank order; ``block(columns, rank)`` is the new run's column range
    ``[lo, hi)`` of a rank."""
    _check_complete(states)
    first = states[0]
    weights = [
        _weight(
            [WeightRecord.from_dict(saved_weights(state)[i]) for state in states],
            world_size,
            rank,
            block,
        ).to_dict()
        for i in range(len(saved_weights(first)))
    ]
    return {**first, "world_size": world_size, "rank": rank, "weights": weights}


def _check_complete(states: list[dict]) -> None:
    if not states:
        raise ValueError("resharding needs the state dicts of every saved rank, got none")
    for state in states:
        check_format(state)
    saved_ranks = [(state.get("rank"), state.get("world_size")) for state in states]
    expected = [(rank, len(states)) for rank in range(len(states))]
    if saved_ranks != expected:
        raise ValueError(
            f"resharding needs the state dicts of every saved rank in rank order; got "
            f"(rank, world size) {saved_ranks}"
        )
    settings = {repr(state["settings"]) for state in states}
    if len(settings) > 1:
        raise ValueError(f"the saved ranks' settings differ: {sorted(settings)}")


def _weight(saved: list[WeightRecord], world_size: int, rank: int, block: Block) -> WeightRecord:
    first = saved[0]
    order, k = first.order, first.k
    columns = order.numel()
    host = [torch.empty(columns, *t.shape[1:], dtype=t.dtype) for t in first.host]
    window_sum = None
    if first.accumulator is not None:
        window_sum = torch.zeros(columns, first.host[0].shape[1])
    for saved_rank, record in enumerate(saved):
        local_order = record.local_orders[saved_rank]
        for natural, rows in zip(host, record.host, strict=True):
            natural[local_order] = rows
        if window_sum is not None:
            summed_columns = local_order[record.k_locals[saved_rank] :]
            window_sum[summed_columns] += record.accumulator.cpu()
            for batch_by_columns, out_grad in record.window_factors:
                window_sum += batch_by_columns.t().cpu() @ out_grad.cpu()

    selected, unselected = order[:k], order[k:]
    local_orders, k_locals = [], []
    for new_rank in range(world_size):
        lo, hi = block(columns, new_rank)
        mine = torch.zeros(columns, dtype=torch.bool)
        mine[lo:hi] = True
        # In the saved order within each part, so that the same world size changes nothing.
        local_orders.append(torch.cat([selected[mine[selected]], unselected[mine[unselected]]]))
        k_locals.append(int(mine[selected].sum()))
    unselected_parts = [o[kl:] for o, kl in zip(local_orders, k_locals, strict=True)]
    local_order, k_local = local_orders[rank], k_locals[rank]
    return WeightRecord(
        order=torch.cat([selected, *unselected_parts]),
        local_orders=local_orders,
        k=k,
        k_locals=k_locals,
        host=[natural[local_order] for natural in host],
        device=first.device,
        accumulator=None if window_sum is None else window_sum[local_order[k_local:]],
        window_factors=[],
        in_window=first.in_window,
        pending=first.pending,
    )
