"""Typed zenflow configuration, read from a DeepSpeed JSON config.

``load_config`` takes the dict or JSON file a DeepSpeed user already has and returns a validated,
resolved ``ZenFlowConfig``. The ``zero_optimization.zenflow`` block turns ZenFlow on; without it
the config describes plain training (optionally ZeRO-Offload).

Every key is one of three kinds:

* ours: typed, validated and used (batch sizes, optimizer, scheduler, gradient_clipping, bf16,
  fp16, zero_optimization with stage, offload_optimizer, reduce_bucket_size, overlap_comm,
  zenflow);
* a DeepSpeed key zenflow does not act on (``steps_per_print``, ``wandb``,
  ``zero_optimization.contiguous_gradients``, ...): accepted, with a one-line notice, so existing
  configs load unchanged;
* anything else: a ``ConfigError`` naming the key, with a "did you mean" when one is close.

All errors are ``ConfigError`` (a ``ValueError``) with one ``dotted.key.path: problem`` line per
problem, saying what is allowed.
"""

from __future__ import annotations

import json
import math
import os
import typing
from typing import Any, Literal

from pydantic import (
    BaseModel,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from zenflow.notices import notice
from zenflow.settings import ZenFlowSettings
from zenflow.validation import (
    ConfigError,
    Int,
    Problem,
    Section,
    describe,
    did_you_mean,
    validate,
)

__all__ = [
    "AdamParams",
    "BF16Config",
    "ConfigError",
    "FP16Config",
    "OffloadOptimizerConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "ZenFlowConfig",
    "ZeroConfig",
    "build_lr_scheduler",
    "load_config",
]

# --------------------------------------------------------------------------------------------
# zero_optimization


class OffloadOptimizerConfig(Section):
    """``zero_optimization.offload_optimizer``: where the fp32 master weights and Adam state live."""

    ignored_keys = frozenset(
        {
            "nvme_path",
            "buffer_count",
            "pipeline_read",
            "pipeline_write",
            "fast_init",
            "ratio",
            "super_offload",
            "cpuadam_cores_perc",
        }
    )

    device: Literal["none", "cpu"] = "none"
    """"cpu" (ZeRO-Offload) or "none". DeepSpeed's "nvme" is not supported."""
    pin_memory: bool = True
    """zenflow pins its host buffers whenever the weights are on a GPU (pageable copies would
    block the training thread), so false is ignored, with a notice."""

    @model_validator(mode="after")
    def _pinned_anyway(self) -> OffloadOptimizerConfig:
        if not self.pin_memory:
            notice(
                "zero_optimization.offload_optimizer.pin_memory: false is ignored; zenflow pins "
                "its host buffers whenever the weights are on a GPU"
            )
        return self


class ZeroConfig(Section):
    """``zero_optimization``: ZeRO stage 0, 1 or 2, optimizer offload and the ZenFlow block."""

    # DeepSpeed's other ZeRO keys; most matter only to stage 3, which zenflow does not run.
    ignored_keys = frozenset(
        {
            "contiguous_gradients",
            "reduce_scatter",
            "use_multi_rank_bucket_allreduce",
            "allgather_partitions",
            "allgather_bucket_size",
            "compute_grad_norm",
            "load_from_fp32_weights",
            "elastic_checkpoint",
            "offload_param",
            "sub_group_size",
            "prefetch_bucket_size",
            "stage3_prefetch_bucket_size",
            "param_persistence_threshold",
            "stage3_param_persistence_threshold",
            "model_persistence_threshold",
            "stage3_model_persistence_threshold",
            "max_live_parameters",
            "stage3_max_live_parameters",
            "max_reuse_distance",
            "stage3_max_reuse_distance",
            "gather_16bit_weights_on_model_save",
            "stage3_gather_16bit_weights_on_model_save",
            "stage3_gather_fp16_weights_on_model_save",
            "module_granularity_threshold",
            "stage3_module_granularity_threshold",
            "use_all_reduce_for_fetch_params",
            "stage3_use_all_reduce_for_fetch_params",
            "allgather_sequential",
            "stage3_allgather_sequential",
            "ignore_unused_parameters",
            "legacy_stage1",
            "round_robin_gradients",
            "parameter_alignment",
            "zero_hpz_partition_size",
            "zero_quantized_weights",
            "zero_quantized_nontrainable_weights",
            "zero_quantized_gradients",
            "memory_efficient_linear",
            "pipeline_loading_checkpoint",
            "override_module_apply",
            "log_trace_cache_warnings",
            "enable_sanity_checks",
            "save_muon_momentum_buffer_in_memory",
            "leaf_module",
            "mics_shard_size",
            "mics_hierarchical_params_gather",
            "zeropp_loco_param",
        }
    )
    # Deprecated DeepSpeed spellings that change behaviour: ignoring them would be silent loss.
    key_hints = {
        "cpu_offload": 'deprecated; write "offload_optimizer": {"device": "cpu"}',
        "cpu_offload_use_pin_memory": 'deprecated; write "offload_optimizer": {"pin_memory": true}',
        "cpu_offload_param": "deprecated offload_param (ZeRO stage 3), which zenflow does not support",
    }

    stage: Int = 0
    """ZeRO stage: 0 (no partitioning), 1 (optimizer state) or 2 (also gradients)."""
    offload_optimizer: OffloadOptimizerConfig | None = None
    """Optimizer offload; ZenFlow requires {"device": "cpu"}."""
    reduce_bucket_size: Int = Field(500_000_000, gt=0)
    """Elements per gradient reduction bucket."""
    overlap_comm: bool = False
    """Overlap gradient reduction with the backward pass."""
    zenflow: ZenFlowSettings | None = None
    """The ZenFlow block; its presence turns ZenFlow on."""

    @field_validator("stage")
    @classmethod
    def _stage(cls, stage: int) -> int:
        if stage == 3:
            raise ValueError("ZeRO stage 3 is not supported by zenflow; use 1 or 2")
        if stage not in (0, 1, 2):
            raise ValueError(f"must be 0, 1 or 2, got {stage}")
        return stage

    @model_validator(mode="after")
    def _offload_needs_zero(self) -> ZeroConfig:
        offload = self.offload_optimizer is not None and self.offload_optimizer.device == "cpu"
        if self.zenflow is not None:
            if not offload:
                raise Problem(
                    "offload_optimizer",
                    f'zenflow requires "offload_optimizer": {{"device": "cpu"}}, got '
                    f"{_json(self.offload_optimizer)}",
                )
            if self.stage == 0:
                raise Problem("stage", "zenflow requires ZeRO stage 1 or 2, got 0")
        elif offload and self.stage == 0:
            raise Problem("stage", "offload_optimizer needs ZeRO stage 1 or 2, got 0")
        return self


def _json(section: BaseModel | None) -> str:
    return "null" if section is None else json.dumps(section.model_dump())


# --------------------------------------------------------------------------------------------
# optimizer, scheduler, precision


class AdamParams(Section):
    """``optimizer.params``. Defaults are DeepSpeed's CPU Adam defaults."""

    ignored_keys = frozenset({"torch_adam", "fp32_optimizer_states", "set_grad_none"})
    key_hints = {"max_grad_norm": "not an optimizer parameter; use the top-level gradient_clipping"}

    lr: float = Field(1e-3, ge=0.0)
    betas: tuple[float, float] = Field((0.9, 0.999), strict=False)
    eps: float = Field(1e-8, ge=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    adam_w_mode: bool = True
    """With type "Adam": false asks for L2-style Adam (see OptimizerConfig)."""
    bias_correction: bool = True
    amsgrad: bool = False
    fused: bool | None = None
    """torch AdamW's kernel choice (as ``torch.optim.AdamW(fused=, foreach=)``), for a config
    trained by the plain AdamW (no zenflow block, no offload, fp32): on the CPU torch's default
    is its per-tensor loop, and fused is the fastest."""
    foreach: bool | None = None

    @field_validator("betas")
    @classmethod
    def _betas(cls, betas: tuple[float, float]) -> tuple[float, float]:
        for beta in betas:
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"each beta must be in [0, 1), got {list(betas)}")
        return betas

    @model_validator(mode="after")
    def _supported(self) -> AdamParams:
        if self.fused and self.foreach:
            raise Problem("fused", "true with foreach true: torch's AdamW takes one of the two")
        if not self.bias_correction:
            raise Problem("bias_correction", "false is not supported by zenflow; remove it")
        if self.amsgrad:
            raise Problem("amsgrad", "true is not supported by zenflow; remove it")
        return self


class OptimizerConfig(Section):
    """``optimizer``: Adam or AdamW (case-insensitive, as in DeepSpeed).

    DeepSpeed's "Adam" is AdamW (decoupled weight decay) unless ``params.adam_w_mode`` is false.
    Zenflow implements AdamW only: "Adam" with adam_w_mode false is accepted when weight_decay is
    0 (where the two are identical) and rejected otherwise.
    """

    type: str
    """The optimizer name as written; ``adamw`` is always True."""
    params: AdamParams = Field(default_factory=AdamParams)

    @field_validator("type")
    @classmethod
    def _type(cls, name: str) -> str:
        if name.lower() not in ("adam", "adamw"):
            raise ValueError(
                f"{name!r} is not supported by zenflow; use 'Adam' or 'AdamW' (case-insensitive)"
            )
        return name

    @model_validator(mode="after")
    def _adamw_only(self) -> OptimizerConfig:
        l2_adam = self.type.lower() == "adam" and not self.params.adam_w_mode
        if l2_adam and self.params.weight_decay != 0:
            raise Problem(
                "params.adam_w_mode",
                "false (Adam with L2 weight decay) is not supported by zenflow, which implements "
                "AdamW (decoupled weight decay); remove adam_w_mode or set weight_decay to 0",
            )
        return self


# Constructor parameters of deepspeed.runtime.lr_schedules' classes (tests compare with them);
# kept here so that loading a config does not import deepspeed.
_SCHEDULER_PARAMS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    # type: (required, optional)
    "WarmupLR": (
        frozenset(),
        frozenset(
            {
                "warmup_min_lr",
                "warmup_max_lr",
                "warmup_num_steps",
                "warmup_type",
                "last_batch_iteration",
            }
        ),
    ),
    "WarmupDecayLR": (
        frozenset({"total_num_steps"}),
        frozenset(
            {
                "warmup_min_lr",
                "warmup_max_lr",
                "warmup_num_steps",
                "warmup_type",
                "last_batch_iteration",
            }
        ),
    ),
    "WarmupCosineLR": (
        frozenset({"total_num_steps"}),
        frozenset(
            {
                "warmup_min_ratio",
                "warmup_num_steps",
                "cos_min_ratio",
                "warmup_type",
                "last_batch_iteration",
            }
        ),
    ),
    "OneCycle": (
        frozenset({"cycle_min_lr", "cycle_max_lr"}),
        frozenset(
            {
                "decay_lr_rate",
                "cycle_first_step_size",
                "cycle_second_step_size",
                "cycle_first_stair_count",
                "cycle_second_stair_count",
                "decay_step_size",
                "cycle_momentum",
                "cycle_min_mom",
                "cycle_max_mom",
                "decay_mom_rate",
                "last_batch_iteration",
            }
        ),
    ),
    "LRRangeTest": (
        frozenset(),
        frozenset(
            {
                "lr_range_test_min_lr",
                "lr_range_test_step_size",
                "lr_range_test_step_rate",
                "lr_range_test_staircase",
                "last_batch_iteration",
            }
        ),
    ),
}


# Value kinds of those parameters, checked at load (DeepSpeed's classes fail only when stepping).
# Every other parameter is a number; those ending in _lr or _mom may be a list with one number
# per param group.
_SCHEDULER_FLAGS = frozenset({"cycle_momentum", "lr_range_test_staircase"})
_SCHEDULER_NULLABLE = frozenset(
    {"warmup_max_lr", "cycle_second_step_size", "cycle_second_stair_count"}
)
_WARMUP_TYPES = ("log", "linear")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _scheduler_value_problem(name: str, value: Any) -> str | None:
    """What is wrong with ``value`` for scheduler parameter ``name``, or None."""
    if name in _SCHEDULER_FLAGS:
        return None if isinstance(value, bool) else f"must be true or false, got {describe(value)}"
    if name == "warmup_type":
        if value in _WARMUP_TYPES:
            return None
        return f'must be "log" or "linear", got {describe(value)}'
    if value is None and name in _SCHEDULER_NULLABLE:
        return None
    per_group = name.endswith(("_lr", "_mom")) and isinstance(value, list) and value
    values = value if per_group else [value]
    if not all(_is_number(v) for v in values):
        return f"must be a finite number, got {describe(value)}"
    # The schedule writes these into the optimizer: a learning rate below 0 or a beta1 outside
    # [0, 1) would fail (or train backwards) at some later step.
    if name.endswith("_lr") and min(values) < 0:
        return f"must be >= 0 (a learning rate), got {value!r}"
    if name.endswith("_mom") and not all(0 <= v < 1 for v in values):
        return f"must be in [0, 1) (it becomes Adam's beta1), got {value!r}"
    return None


class SchedulerConfig(Section):
    """``scheduler``: one of DeepSpeed's LR schedules, built by ``build_lr_scheduler``.

    ``params`` are the schedule class's constructor arguments; their names are checked here,
    their values by the class when it is built.
    """

    type: str
    params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("type")
    @classmethod
    def _type(cls, name: str) -> str:
        if name not in _SCHEDULER_PARAMS:
            raise ValueError(
                f"{name!r} is not a DeepSpeed LR schedule{did_you_mean(name, _SCHEDULER_PARAMS)}; "
                f"use one of {', '.join(_SCHEDULER_PARAMS)}"
            )
        return name

    @model_validator(mode="after")
    def _param_names(self) -> SchedulerConfig:
        required, optional = _SCHEDULER_PARAMS[self.type]
        allowed = required | optional
        for name in self.params:
            if name not in allowed:
                raise Problem(
                    f"params.{name}",
                    f"not a parameter of {self.type}{did_you_mean(name, allowed)}; "
                    f"allowed: {', '.join(sorted(allowed))}",
                )
        for name in sorted(required - self.params.keys()):
            raise Problem(f"params.{name}", f"required by {self.type}")
        for name, value in self.params.items():
            problem = _scheduler_value_problem(name, value)
            if problem is not None:
                raise Problem(f"params.{name}", problem)
        return self


class BF16Config(Section):
    """``bf16`` (DeepSpeed also reads ``bfloat16``): bf16 mixed precision, fp32 master weights."""

    ignored_keys = frozenset(
        {
            "immediate_grad_update",
            "check_grad_overflow",
            "bf16_master_weights_and_grads",
            "bf16_optimizer_states",
        }
    )

    enabled: bool = False


class FP16Config(Section):
    """``fp16``: fp16 mixed precision with loss scaling (DeepSpeed's fields and defaults)."""

    ignored_keys = frozenset(
        {"auto_cast", "consecutive_hysteresis", "fp16_master_weights_and_grads"}
    )

    enabled: bool = False
    loss_scale: float = Field(0.0, ge=0.0)
    """Static loss scale; 0 means dynamic loss scaling."""
    initial_scale_power: Int = Field(16, ge=0)
    """Dynamic scaling starts at 2**initial_scale_power."""
    loss_scale_window: Int = 1000
    """Steps without overflow before the dynamic scale is raised."""
    hysteresis: Int = 2
    """Overflows tolerated before the dynamic scale is lowered."""
    min_loss_scale: Int = 1
    """Floor of the dynamic scale."""

    @model_validator(mode="after")
    def _dynamic_scaling(self) -> FP16Config:
        # As in DeepSpeed, checked only where used: enabled with dynamic scaling.
        if self.enabled and self.loss_scale == 0:
            for key in ("loss_scale_window", "hysteresis", "min_loss_scale"):
                if getattr(self, key) < 1:
                    raise Problem(
                        key,
                        f"must be >= 1 with dynamic loss scaling (loss_scale 0), got {getattr(self, key)}",
                    )
        return self

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.loss_scale == 0


# --------------------------------------------------------------------------------------------
# the whole config

# DeepSpeed's other top-level keys, accepted with a notice. The last group was removed from
# DeepSpeed (which now rejects them) but still appears in older configs.
_IGNORED_TOP_LEVEL = frozenset(
    {
        "steps_per_print",
        "wall_clock_breakdown",
        "memory_breakdown",
        "dump_state",
        "prescale_gradients",
        "gradient_predivide_factor",
        "gradient_allreduce_op",
        "disable_allgather",
        "communication_data_type",
        "seq_parallel_communication_data_type",
        "flops_profiler",
        "tensorboard",
        "wandb",
        "csv_monitor",
        "comet",
        "comms_logger",
        "activation_checkpointing",
        "torch_autocast",
        "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer",
        "checkpoint",
        "data_types",
        "dataloader_drop_last",
        "autotuning",
        "pipeline",
        "aio",
        "timers",
        "data_efficiency",
        "weight_quantization",
        "compile",
        "tensor_parallel",
        "expert_parallel",
        "hybrid_engine",
        "use_data_before_expert_parallelism",
        "log_level",
        "datastates_ckpt",
        "sequence_parallel_size",
        "vocabulary_size",
        "disable_python_gc",
        "managed_gradient_accumulation",
        "dynamic_batching",
        "model_info",
        "nebula",
        "compression_training",
        "amp",
        "quantize_training",
        "sparse_gradients",
        "eigenvalue",
        "sparse_attention",
        "elasticity",
        "graph_harvesting",
        "curriculum_learning",
        "progressive_layer_drop",
    }
)


def _default_world_size() -> int:
    # Imported here: loading a config should not pay for importing torch when nothing else has.
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


class ZenFlowConfig(Section):
    """The whole config: a DeepSpeed JSON config as zenflow reads it. Build it with ``load_config``.

    Resolved values (all set after loading):

    * ``train_batch_size``, ``gradient_accumulation_steps``, ``micro_batch_size``
      (= ``train_micro_batch_size_per_gpu``) and ``world_size``, consistent with
      train_batch_size = micro_batch_size * gradient_accumulation_steps * world_size;
    * ``lr``, ``betas``, ``eps``, ``weight_decay`` (from ``optimizer.params``; DeepSpeed's CPU Adam
      defaults when there is no optimizer block);
    * ``zero_stage`` and ``cpu_offload`` (optimizer state on the host);
    * ``zenflow_enabled`` and ``zenflow`` (the block or None), whose ``select_interval_steps`` is
      the resolved select interval in optimizer steps, or None until the epoch length is known:
      ``with_steps_per_epoch(n)`` returns the resolved copy.
    """

    ignored_keys = _IGNORED_TOP_LEVEL

    train_batch_size: Int | None = Field(None, gt=0)
    """Global batch per optimizer step; resolved (never None) after loading."""
    train_micro_batch_size_per_gpu: Int | None = Field(None, gt=0)
    """Batch per rank per forward/backward; resolved (never None) after loading."""
    gradient_accumulation_steps: Int | None = Field(None, gt=0)
    """Micro-batches per optimizer step; resolved (never None) after loading."""
    optimizer: OptimizerConfig = Field(default_factory=lambda: OptimizerConfig(type="AdamW"))
    scheduler: SchedulerConfig | None = None
    gradient_clipping: float = Field(1.0, ge=0.0)
    """Max global gradient norm; 0 disables clipping (DeepSpeed's default is 1.0)."""
    bf16: BF16Config = Field(default_factory=BF16Config)
    fp16: FP16Config = Field(default_factory=FP16Config)
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    # Extensions over DeepSpeed.
    nonfinite_gradients: Literal["raise", "skip"] | None = None
    """A step whose gradient norm is NaN or infinite: "raise" an error or "skip" the step
    (counted in skipped_steps); nothing is committed either way. Default: "raise", and "skip"
    with fp16, whose loss scaling relies on skipping overflowing steps."""
    process_group_timeout_s: float = Field(1800.0, gt=0.0)
    """Seconds a collective waits for the other ranks before it fails (a rank that died or hangs);
    applies when zenflow initializes torch.distributed (launched by torchrun or deepspeed)."""

    _world_size: int = PrivateAttr(1)

    @model_validator(mode="after")
    def _resolve(self, info: ValidationInfo) -> ZenFlowConfig:
        if self.bf16.enabled and self.fp16.enabled:
            raise Problem("bf16", "bf16 and fp16 cannot both be enabled; enable one of them")
        if self.fp16.enabled and self.nonfinite_gradients == "raise":
            raise Problem(
                "nonfinite_gradients",
                '"raise" cannot be used with fp16: its loss scaling skips the steps that '
                'overflow; remove the key (or write "skip")',
            )
        world_size = (info.context or {}).get("world_size") or _default_world_size()
        self._world_size = world_size
        self._resolve_batch_sizes(world_size)
        return self

    def _resolve_batch_sizes(self, world_size: int) -> None:
        """DeepSpeed's rule: given any two of the three, derive the third; all three must agree."""
        batch = self.train_batch_size
        micro = self.train_micro_batch_size_per_gpu
        accumulation = self.gradient_accumulation_steps
        if batch is None and micro is None:
            raise Problem(
                "train_batch_size",
                "give train_batch_size or train_micro_batch_size_per_gpu (or both)",
            )
        if micro is None:
            accumulation = accumulation or 1
            if batch % (accumulation * world_size):
                raise Problem(
                    "train_batch_size",
                    f"{batch} is not divisible by gradient_accumulation_steps {accumulation} x "
                    f"world size {world_size}",
                )
            micro = batch // (accumulation * world_size)
        elif batch is None:
            accumulation = accumulation or 1
            batch = micro * accumulation * world_size
        elif accumulation is None:
            if batch % (micro * world_size):
                raise Problem(
                    "train_batch_size",
                    f"{batch} is not divisible by train_micro_batch_size_per_gpu {micro} x "
                    f"world size {world_size}",
                )
            accumulation = batch // (micro * world_size)
        if batch != micro * accumulation * world_size:
            raise Problem(
                "train_batch_size",
                f"{batch} must equal train_micro_batch_size_per_gpu {micro} x "
                f"gradient_accumulation_steps {accumulation} x world size {world_size} "
                f"= {micro * accumulation * world_size}; fix one of them or leave one out",
            )
        self.train_batch_size = batch
        self.train_micro_batch_size_per_gpu = micro
        self.gradient_accumulation_steps = accumulation

    @property
    def world_size(self) -> int:
        """The data-parallel world size the batch sizes were resolved with."""
        return self._world_size

    @property
    def micro_batch_size(self) -> int:
        return self.train_micro_batch_size_per_gpu

    @property
    def zenflow(self) -> ZenFlowSettings | None:
        return self.zero_optimization.zenflow

    @property
    def zenflow_enabled(self) -> bool:
        return self.zero_optimization.zenflow is not None

    @property
    def zero_stage(self) -> int:
        return self.zero_optimization.stage

    @property
    def cpu_offload(self) -> bool:
        """True when optimizer state lives on the host (ZeRO-Offload; always with ZenFlow)."""
        offload = self.zero_optimization.offload_optimizer
        return offload is not None and offload.device == "cpu"

    @property
    def nonfinite(self) -> str:
        """What a step with a NaN or infinite gradient does: "raise" or "skip"."""
        if self.nonfinite_gradients is not None:
            return self.nonfinite_gradients
        return "skip" if self.fp16.enabled else "raise"

    @property
    def lr(self) -> float:
        return self.optimizer.params.lr

    @property
    def betas(self) -> tuple[float, float]:
        return self.optimizer.params.betas

    @property
    def eps(self) -> float:
        return self.optimizer.params.eps

    @property
    def weight_decay(self) -> float:
        return self.optimizer.params.weight_decay

    @property
    def adamw_kernel(self) -> dict:
        """``fused`` / ``foreach`` as set for torch's AdamW (the plain optimizer only)."""
        params = self.optimizer.params
        return {k: v for k, v in (("fused", params.fused), ("foreach", params.foreach)) if v}

    def with_steps_per_epoch(self, steps_per_epoch: int | None) -> ZenFlowConfig:
        """A copy with the zenflow select interval resolved (see ``ZenFlowSettings.with_steps_per_epoch``).

        Returns self when ZenFlow is off.
        """
        if self.zenflow is None:
            return self
        zero = self.zero_optimization.model_copy(
            update={"zenflow": self.zenflow.with_steps_per_epoch(steps_per_epoch)}
        )
        return self.model_copy(update={"zero_optimization": zero})


# --------------------------------------------------------------------------------------------
# loading


def load_config(
    config: dict | str | os.PathLike,
    *,
    world_size: int | None = None,
    steps_per_epoch: int | None = None,
) -> ZenFlowConfig:
    """Read and validate a DeepSpeed config (a dict, or the path of a JSON file).

    ``world_size`` is the data-parallel world size for the batch-size rule; by default
    torch.distributed's when initialized, else 1. ``steps_per_epoch`` (optimizer steps per epoch,
    when known) resolves an "epoch" or "auto" select strategy; it overrides the zenflow block's
    own ``steps_per_epoch``.

    Raises ``ConfigError`` for any problem; notices (``zenflow.notices``) report DeepSpeed keys
    that zenflow accepts but does not act on.
    """
    for key, value in (("world_size", world_size), ("steps_per_epoch", steps_per_epoch)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ConfigError(f"{key}: must be a positive integer or None, got {value!r}")
    data = config if isinstance(config, dict) else _read_json(config)
    data = _check_keys(_top_level_aliases(data), ZenFlowConfig, "")
    zenflow = data.get("zero_optimization", {}).get("zenflow")
    if steps_per_epoch is not None and zenflow is not None:
        zenflow["steps_per_epoch"] = steps_per_epoch
    return validate(ZenFlowConfig, data, context={"world_size": world_size})


def build_lr_scheduler(config: ZenFlowConfig, optimizer: Any) -> Any:
    """Build the configured DeepSpeed LR schedule on ``optimizer``; None if there is no scheduler.

    The schedule is the ``deepspeed.runtime.lr_schedules`` class named by ``scheduler.type``,
    constructed with ``scheduler.params``, exactly as DeepSpeed does.
    """
    if config.scheduler is None:
        return None
    # Imported here because importing deepspeed takes seconds.
    from deepspeed.runtime import lr_schedules

    schedule = getattr(lr_schedules, config.scheduler.type)
    try:
        return schedule(optimizer, **config.scheduler.params)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"scheduler.params: {error}") from None


def _read_json(path: str | os.PathLike) -> Any:
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(
            f"config: expected a dict or the path of a JSON file, got {type(path).__name__}"
        )
    try:
        with open(path, encoding="utf-8") as file:
            return json.load(file, object_pairs_hook=_no_duplicate_keys)
    except FileNotFoundError:
        raise ConfigError(f"config: file {os.fspath(path)!r} does not exist") from None
    except json.JSONDecodeError as error:
        raise ConfigError(
            f"config: {os.fspath(path)} line {error.lineno} column {error.colno}: invalid JSON: "
            f"{error.msg}"
        ) from None
    except (OSError, UnicodeDecodeError, _DuplicateKey) as error:
        raise ConfigError(f"config: {os.fspath(path)}: {error}") from None


class _DuplicateKey(ValueError):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    # As DeepSpeed: a key written twice is a mistake, not "the last one wins".
    result = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(f"key {key!r} appears twice in one object")
        result[key] = value
    return result


def _top_level_aliases(data: Any) -> Any:
    if not isinstance(data, dict) or "bfloat16" not in data:
        return data
    if "bf16" in data:
        raise ConfigError("bfloat16: is the old name of bf16; give only one of them")
    return {("bf16" if key == "bfloat16" else key): value for key, value in data.items()}


def _check_keys(data: Any, model: type[Section], path: str) -> dict:
    """Check the keys of one JSON object against ``model``, recursively, before pydantic runs.

    Unknown keys fail (with a suggestion), DeepSpeed keys zenflow does not use get a notice and
    are dropped. Returns new dicts, so the caller's config is never modified.
    """
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path or 'config'}: expected a JSON object {{...}}, got {describe(data)}"
        )
    if path == "" and data.get("gradient_allreduce_op", "mean") != "mean":
        raise ConfigError(
            f"gradient_allreduce_op: zenflow averages gradients across ranks; only 'mean' is "
            f"supported, got {data['gradient_allreduce_op']!r}"
        )
    checked = {}
    for key, value in data.items():
        where = f"{path}.{_key_name(key)}" if path else _key_name(key)
        field = model.model_fields.get(key)
        if field is not None:
            section = _section_type(field.annotation)
            if section is not None and not (value is None and field.default is None):
                value = _check_keys(value, section, where)
            checked[key] = value
        elif key in model.ignored_keys:
            notice(f"{where}: DeepSpeed setting not used by zenflow; ignored")
        elif key in model.key_hints:
            raise ConfigError(f"{where}: {model.key_hints[key]}")
        else:
            known = model.model_fields.keys() | model.ignored_keys
            raise ConfigError(
                f"{where}: unknown key{did_you_mean(str(key), known)}; allowed: "
                f"{', '.join(sorted(model.model_fields))}"
            )
    return checked


def _key_name(key: Any) -> str:
    """``key`` as written in a message: quoted as JSON when it would not read as one key (empty,
    blank at an end, or holding a control character, a dot or ": ")."""
    key = str(key)
    plain = key and key.strip() == key and key.isprintable() and "." not in key
    return key if plain and ": " not in key else json.dumps(key)


def _section_type(annotation: Any) -> type[Section] | None:
    """The Section class of a field annotated ``Section`` or ``Section | None``."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, Section):
            return candidate
    return None
