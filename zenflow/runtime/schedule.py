"""Which kind of step the next committed step is: pure functions of the step count.

``committed`` counts committed steps before this one (a skipped step counts for nothing, so a
boundary it would have been moves to the next committed step); counters start after the
warm-up rounds. See docs/algorithm.md, "Boundaries and selection".
"""

import math
from typing import NamedTuple

from zenflow.settings import ZenFlowSettings, resolve_select_interval


class Schedule(NamedTuple):
    warm_up_rounds: int
    select_interval: int  # steps, a multiple of update_interval
    update_interval: int | None  # None: "auto" (zenflow.runtime.auto_interval decides)
    selects: bool  # topk_ratio > 0

    @classmethod
    def of(cls, settings: ZenFlowSettings) -> "Schedule":
        return cls(
            warm_up_rounds=settings.full_warm_up_rounds,
            select_interval=resolve_select_interval(
                settings.select_strategy,
                settings.select_interval,
                settings.update_interval,
                settings.steps_per_epoch,
            ),
            update_interval=None
            if settings.update_interval == "auto"
            else settings.update_interval,
            selects=settings.topk_ratio > 0,
        )


class StepKind(NamedTuple):
    warm_up: bool  # every column takes a CPU step now
    select: bool  # the first selection, from this step's gradient, before it is committed
    select_boundary: bool  # the window closes; with topk > 0 this step's gradient selects next
    update_boundary: bool  # a fixed interval's window closes (with "auto": only if it fires)


def step_kind(schedule: Schedule, committed: int) -> StepKind:
    if committed < schedule.warm_up_rounds:
        return StepKind(warm_up=True, select=False, select_boundary=False, update_boundary=False)
    s = committed - schedule.warm_up_rounds
    select_boundary = (s + 1) % schedule.select_interval == 0
    interval = schedule.update_interval
    return StepKind(
        warm_up=False,
        select=schedule.selects and s == 0,
        select_boundary=select_boundary,
        update_boundary=select_boundary or (interval is not None and (s + 1) % interval == 0),
    )


def reselects(schedule: Schedule, kind: StepKind) -> bool:
    """Whether this step's gradient chooses the next selection once the step is committed."""
    return schedule.selects and kind.select_boundary


def closes_window(kind: StepKind, auto_fired: bool) -> bool:
    """Whether the window closes after this step; ``auto_fired``: update_interval "auto"
    asked for it (False for a fixed interval)."""
    return not kind.warm_up and (kind.update_boundary or auto_fired)


def lr_scale(schedule: Schedule, window_steps: int) -> float:
    """The factor on ``lr`` of a window's CPU update: ``sqrt(n)`` for an "auto" window of n
    steps (Adam's square-root rule: the waiting columns saw one n times larger batch), 1 for a
    fixed interval."""
    return 1.0 if schedule.update_interval is not None else math.sqrt(window_steps)
