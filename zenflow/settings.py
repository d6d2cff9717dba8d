"""ZenFlow's settings: one model for the config's ``zero_optimization.zenflow`` block and
``ZenFlowAdamW``'s keyword arguments, with one set of defaults (DeepSpeed's) and one set of
rules and messages; and how a select interval resolves into steps.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from zenflow.notices import notice
from zenflow.validation import ConfigError, Int, Problem, Section, did_you_mean, integral, validate

ZENFLOW_PATH = "zero_optimization.zenflow"


def check_interval(key: str, value: Any) -> None:
    if value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise Problem(key, f'must be a positive integer or "auto", got {value!r}')


def effective_strategy(select_strategy: Any, select_interval: Any, update_interval: Any) -> str:
    """Check the static (epoch-length independent) selection settings; return the strategy in use.

    An integer select_interval with strategy "auto" means "every that many steps" (DeepSpeed
    rejects this combination; the Python API relies on it).
    """
    if select_strategy not in ("auto", "step", "epoch"):
        raise Problem(
            "select_strategy", f'must be "auto", "step" or "epoch", got {select_strategy!r}'
        )
    check_interval("select_interval", select_interval)
    check_interval("update_interval", update_interval)
    if select_strategy == "auto" and select_interval != "auto":
        select_strategy = "step"
    if select_strategy != "auto" and select_interval == "auto":
        unit = "steps" if select_strategy == "step" else "epochs"
        raise Problem(
            "select_interval",
            f'select_strategy "{select_strategy}" needs an integer select_interval (a number of '
            f'{unit}), got "auto"; give a number, or use select_strategy "auto"',
        )
    if (
        select_strategy == "step"
        and update_interval != "auto"
        and select_interval < update_interval
    ):
        raise Problem(
            "select_interval",
            f"{select_interval} steps is less than update_interval {update_interval}; selection "
            f"happens at update boundaries, so use a multiple of update_interval "
            f"({update_interval}, {2 * update_interval}, ...)",
        )
    return select_strategy


def resolve_select_interval(
    select_strategy: str,
    select_interval: int | str,
    update_interval: int | str,
    steps_per_epoch: int | None,
) -> int:
    """The number of optimizer steps between reselections of the important columns.

    ``steps_per_epoch`` counts optimizer steps (data-loader batches divided by
    gradient_accumulation_steps), or is None when the epoch length is unknown.

    ========  =====================================================================
    strategy  select interval in steps
    ========  =====================================================================
    "step"    ``select_interval`` (an int); it must be >= update_interval
    "epoch"   ``select_interval`` (an int of epochs) * steps_per_epoch; an unknown
              steps_per_epoch is an error
    "auto"    steps_per_epoch (every epoch) when known, otherwise
              max(update_interval, 100), with a notice; an int select_interval
              with "auto" means "step"
    ========  =====================================================================

    The result is a multiple of update_interval (a select boundary is an update boundary):
    otherwise it is rounded up to the next multiple, with a notice. With update_interval "auto"
    (adaptive) any number of steps is allowed.

    Raises ``ConfigError`` (a ``ValueError``) naming the offending key.
    """
    strategy = effective_strategy(select_strategy, select_interval, update_interval)
    if steps_per_epoch is not None and (
        isinstance(steps_per_epoch, bool)
        or not isinstance(steps_per_epoch, int)
        or steps_per_epoch < 1
    ):
        raise Problem(
            "steps_per_epoch", f"must be a positive integer or None, got {steps_per_epoch!r}"
        )
    unit = 1 if update_interval == "auto" else update_interval
    if strategy == "step":
        steps = select_interval
    elif strategy == "epoch":
        if steps_per_epoch is None:
            raise Problem(
                "select_strategy",
                '"epoch" needs the epoch length, which is not known: pass steps_per_epoch (the '
                'number of optimizer steps per epoch), or use select_strategy "step" or "auto"',
            )
        steps = select_interval * steps_per_epoch
    elif steps_per_epoch is not None:
        steps = steps_per_epoch
    else:
        steps = round_up(max(unit, 100), unit)
        notice(
            f'select_strategy "auto" without a known epoch length: reselecting every {steps} steps'
        )
    rounded = round_up(steps, unit)
    if rounded != steps:
        notice(
            f"select interval of {steps} steps is not a multiple of update_interval {unit}; "
            f"rounded up to {rounded} steps"
        )
    return rounded


def round_up(steps: int, unit: int) -> int:
    return -(-steps // unit) * unit


class ZenFlowSettings(Section):
    """ZenFlow's settings: the config's ``zero_optimization.zenflow`` block, and
    ``ZenFlowAdamW``'s keyword arguments beyond AdamW's. DeepSpeed's ``ZenFlowConfig`` fields,
    same defaults, and zenflow's extensions (``extensions``).

    Extension over DeepSpeed: ``topk_ratio`` may be 0 (plain offload: nothing on the device) or 1
    (every column on the device); DeepSpeed requires 0 < topk_ratio < 1. Also an integer
    ``select_interval`` with ``select_strategy`` "auto" means "step" (DeepSpeed rejects it), and
    ``full_warm_up_rounds`` must be >= 0.

    ``steps_per_epoch`` (optimizer steps per epoch) normally comes from the data loader at run
    time: ``load_config(..., steps_per_epoch=n)`` or ``with_steps_per_epoch(n)``.
    """

    extensions: ClassVar[frozenset[str]] = frozenset(
        {"accumulate_on_device", "min_update_interval", "max_update_interval", "bind_cores"}
    )
    """Fields DeepSpeed's ZenFlowConfig does not have."""

    topk_ratio: float = Field(0.1, ge=0.0, le=1.0)
    """Fraction of each weight's columns updated on the device every step."""
    select_strategy: Literal["auto", "step", "epoch"] = "auto"
    """How select_interval is counted: "step", "epoch" or "auto" (see resolve_select_interval)."""
    select_interval: int | str = "auto"
    """Steps or epochs between reselections of the important columns; an int or "auto"."""
    update_interval: int | str = "auto"
    """Steps between CPU updates of the other columns; an int or "auto" (adaptive)."""
    overlap_step: bool = False
    """Run the CPU update asynchronously, overlapped with the next window's compute."""
    offload: bool = False
    """Keep the selected columns' Adam state in pinned host memory instead of on the device."""
    accumulate_on_device: bool | Literal["auto"] = "auto"
    """zenflow extension: sum unselected gradients on the device (fp32) and ship each window's
    sum once, instead of every step's gradient (less traffic, more device memory; one rank).
    "auto": on with one rank, no offload, weights on a GPU and sums within a quarter of the
    free device memory (``zenflow.runtime.device_sums``)."""
    min_update_interval: Int | None = Field(None, ge=1)
    """zenflow extension: the shortest window update_interval "auto" may choose (a window cut by
    a reselection may be shorter), so that it never runs more CPU updates than this fixed
    interval would; None: 4, or max_update_interval if that is smaller."""
    max_update_interval: Int = Field(16, ge=1)
    """zenflow extension: the longest window update_interval "auto" may choose."""
    auto_ratio: float = Field(0.99, ge=0.0, le=1.0)
    """Threshold of the adaptive update interval (update_interval "auto")."""
    full_warm_up_rounds: Int = Field(0, ge=0)
    """Steps of full (every parameter, every step) updates before selection starts."""
    pt_reserved_cores_perc: float = Field(0.5, ge=0.0, le=1.0)
    """Share of the rank's CPU cores kept for PyTorch; the rest run the CPU AdamW. Ranks on one
    machine with one affinity mask split its physical cores between them first."""
    bind_cores: bool | Literal["auto"] = "auto"
    """zenflow extension: pin the CPU AdamW's workers to the physical cores (every SMT sibling)
    that pt_reserved_cores_perc leaves them, so that none runs on the cores kept for the
    training thread, nor on another rank's cores; False: they run on any core. "auto": where
    the weights are on a GPU (``zenflow.runtime.core_binding``)."""
    steps_per_epoch: Int | None = Field(None, gt=0)
    """Optimizer steps per epoch; set at run time from the data loader."""

    @field_validator("select_interval", "update_interval", mode="before")
    @classmethod
    def _interval(cls, value: Any, info: ValidationInfo) -> Any:
        value = integral(value)
        try:
            check_interval(info.field_name, value)
        except Problem as problem:
            raise ValueError(problem.message) from None  # pydantic already names the field
        return value

    @model_validator(mode="after")
    def _check_selection(self) -> ZenFlowSettings:
        effective_strategy(self.select_strategy, self.select_interval, self.update_interval)
        self.select_interval_steps  # noqa: B018 -- resolve now so that a bad value fails at load
        return self

    @model_validator(mode="after")
    def _check_auto_interval_bounds(self) -> ZenFlowSettings:
        if self.min_update_interval is not None and (
            self.min_update_interval > self.max_update_interval
        ):
            raise ValueError(
                f"min_update_interval ({self.min_update_interval}) must be <= "
                f"max_update_interval ({self.max_update_interval})"
            )
        return self

    @model_validator(mode="after")
    def _check_sums_beside_offload(self) -> ZenFlowSettings:
        if self.offload and self.accumulate_on_device is True:
            raise ValueError(
                "accumulate_on_device=True keeps the windows' sums on the device (fp32, every "
                "unselected column: more device memory than the selected columns' state), and "
                "offload=True keeps optimizer state off it: set one of them "
                '(accumulate_on_device "auto" is off with offload)'
            )
        return self

    def _needs_epoch_length(self) -> bool:
        strategy = effective_strategy(
            self.select_strategy, self.select_interval, self.update_interval
        )
        return self.steps_per_epoch is None and strategy in ("epoch", "auto")

    @property
    def select_interval_steps(self) -> int | None:
        """Optimizer steps between reselections, or None until the epoch length is known.

        None means select_strategy is "epoch" or "auto" and steps_per_epoch is not set yet: call
        ``with_steps_per_epoch`` once the data loader is known (with None if there is none).
        """
        if self._needs_epoch_length():
            return None
        return resolve_select_interval(
            self.select_strategy, self.select_interval, self.update_interval, self.steps_per_epoch
        )

    def with_steps_per_epoch(self, steps_per_epoch: int | None) -> ZenFlowSettings:
        """A copy whose ``select_interval_steps`` is resolved.

        ``steps_per_epoch`` is the number of optimizer steps per epoch, or None when the run has
        no epoch length (no sized data loader): then strategy "auto" falls back to a fixed number
        of steps (the copy has select_strategy "step" and that select_interval) and "epoch" is an
        error.
        """
        try:
            if steps_per_epoch is not None:
                return validate(
                    ZenFlowSettings,
                    {**self.model_dump(), "steps_per_epoch": steps_per_epoch},
                    ZENFLOW_PATH,
                )
            if not self._needs_epoch_length():
                return self
            steps = resolve_select_interval(
                self.select_strategy, self.select_interval, self.update_interval, None
            )
        except Problem as problem:
            raise ConfigError(f"{ZENFLOW_PATH}.{problem}") from None
        return self.model_copy(update={"select_strategy": "step", "select_interval": steps})


def settings_from(
    base: ZenFlowSettings | None, fields: dict[str, Any], owner: str
) -> ZenFlowSettings:
    """``base`` (default settings if None) with ``fields`` replacing its own, validated: the
    Python API's path to the block's rules and messages. An unknown name is a ``TypeError``,
    as for any function's keyword arguments."""
    known = ZenFlowSettings.model_fields
    for name in fields:
        if name not in known:
            raise TypeError(
                f"{owner} got an unexpected keyword argument {name!r}"
                f"{did_you_mean(name, known)}; ZenFlow's settings are: {', '.join(known)}"
            )
    if base is None:
        return validate(ZenFlowSettings, fields)
    if not fields:
        return base
    return validate(ZenFlowSettings, {**base.model_dump(exclude_unset=True), **fields})
