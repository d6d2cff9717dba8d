"""A conductor's state as a state dict (``zenflow.runtime.state_schema``), and back.

Taken between steps. An overlapped CPU update still running is waited for but not applied:
its result reaches the parameters at the next window boundary, after a load as without one.
"""

import torch

from zenflow.runtime.conductor import Conductor
from zenflow.runtime.layout import ColumnLayout
from zenflow.runtime.pending_update import PendingUpdate, UpdateEntry
from zenflow.runtime.state_schema import (
    FORMAT,
    HostResident,
    WeightRecord,
    check_format,
    saved_weights,
)


def _settings(conductor: Conductor) -> dict:
    """The settings a state dict must have been saved with: others would resume another run."""
    settings = conductor.settings
    return {
        "topk_ratio": settings.topk_ratio,
        "update_interval": settings.update_interval,
        "select_interval": conductor.schedule.select_interval,
        "overlap_step": settings.overlap_step,
    }


def state_dict(conductor: Conductor) -> dict:
    if any(w.staging.staged for w in conductor.weights):
        raise RuntimeError(
            "ZenFlowAdamW.state_dict() between backward() and step(): gradients are staged "
            "but not committed; save after step() (or zero_grad())"
        )
    conductor.wait_for_jobs()
    pending = {id(w) for update in conductor.updates.pending for w in update.weights}
    weights = []
    for w in conductor.weights:
        layout = w.layout
        window = w.window.state_dict()
        record = WeightRecord(
            order=layout.order(),
            local_orders=list(layout.local_orders),
            k=layout.k,
            k_locals=list(layout.k_locals),
            host=w.state.host(),
            device=w.state.device_rows(),
            accumulator=window["accumulator"],
            window_factors=window["window_factors"],
            in_window=window["in_window"],
            pending=id(w) in pending,
        )
        weights.append(record.to_dict())
    groups = [{k: v for k, v in g.items() if k != "params"} for g in conductor.param_groups]
    return {
        "format": FORMAT,
        "world_size": conductor.comm.world_size,
        "rank": conductor.comm.rank,
        "settings": _settings(conductor),
        "param_groups": groups,
        "committed_steps": conductor.committed_steps,
        "window_steps": conductor.window_steps,
        "counters": dict(conductor.counters),
        "auto_interval": None if conductor.auto is None else conductor.auto.state_dict(),
        "weights": HostResident(weights),
        "vectors": [v.tensors() for v in conductor.vectors],
    }


@torch.no_grad()
def load_state_dict(conductor: Conductor, state: dict) -> None:
    """Restore ``state_dict``'s result into a conductor over the same parameters. Every tensor
    is copied to where its kind of state lives, wherever it was loaded or moved to."""
    check_format(state)
    mine = _settings(conductor)
    if state["settings"] != mine:
        raise ValueError(f"state dict settings {state['settings']} differ from {mine}")
    comm = conductor.comm
    saved_at = (state["world_size"], state["rank"])
    if saved_at != (comm.world_size, comm.rank):
        raise ValueError(
            f"state dict of rank {saved_at[1]} of {saved_at[0]} cannot load into rank "
            f"{comm.rank} of {comm.world_size}; at another world size pass every saved rank's "
            "state dict to load_resharded()"
        )
    records = [WeightRecord.from_dict(saved) for saved in saved_weights(state)]
    shapes = [(w.layout.block_rows, w.out) for w in conductor.weights]
    saved = [record.host_shape for record in records]
    if saved != shapes or len(state["vectors"]) != len(conductor.vectors):
        raise ValueError(
            f"state dict holds weights {saved} and {len(state['vectors'])} vectors; this "
            f"optimizer has {shapes} and {len(conductor.vectors)}"
        )
    conductor.jobs.phase = "state_dict"
    if conductor.failure is None:
        conductor.updates.apply_pending()
        conductor.jobs.finish_sums()
    else:
        conductor.abandon_jobs()
        conductor.failure = None
    for group, saved_group in zip(conductor.param_groups, state["param_groups"], strict=True):
        group.update(saved_group)
    conductor.committed_steps = state["committed_steps"]
    conductor.window_steps = state["window_steps"]
    conductor.counters.update(state["counters"])
    if conductor.auto is not None:
        conductor.auto.load_state_dict(state["auto_interval"])
    pending = []
    for w, record in zip(conductor.weights, records, strict=True):
        w.adopt(
            ColumnLayout(
                columns=w.columns,
                rank=comm.rank,
                blocks=w.layout.blocks,
                device_columns=record.order[: record.k].to("cpu", copy=True),
                local_orders=tuple(order.to("cpu", copy=True) for order in record.local_orders),
                k_locals=tuple(record.k_locals),
            )
        )
        w.state.load(record.host, record.device)
        w.window.load_state_dict(
            {
                "accumulator": record.accumulator,
                "window_factors": record.window_factors,
                "in_window": record.in_window,
            },
            w.layout.host_columns,
        )
        if record.pending:
            pending.append(w)
    for v, saved_vector in zip(conductor.vectors, state["vectors"], strict=True):
        v.load(saved_vector)
    for _, group_weights in conductor.by_group(pending):
        entries = [UpdateEntry.of(w, None, None, None) for w in group_weights]
        conductor.updates.pending.append(PendingUpdate(None, entries))
