"""zenflow.config: reading DeepSpeed JSON configs, errors that name the key, DeepSpeed parity."""

import copy
import inspect
import json
import logging
import re

import pytest
import torch

from zenflow.config import (
    ConfigError,
    ZenFlowConfig,
    ZeroConfig,
    build_lr_scheduler,
    load_config,
)
from zenflow.notices import reset_notices
from zenflow.settings import ZenFlowSettings, resolve_select_interval

# Shaped like DeepSpeed's ZenFlow example (docs/_tutorials/zenflow.md).
DEEPSPEED_ZENFLOW_EXAMPLE = {
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 8,
    "bf16": {"enabled": True},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 2e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
    },
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "zenflow": {
            "topk_ratio": 0.1,
            "update_interval": 4,
            "select_interval": "auto",
            "overlap_step": True,
            "full_warm_up_rounds": 0,
        },
    },
    "steps_per_print": 10,
    "wall_clock_breakdown": False,
}


def zenflow_config(**zenflow):
    """A small valid config with the given zenflow block."""
    return {
        "train_batch_size": 4,
        "zero_optimization": {
            "stage": 1,
            "offload_optimizer": {"device": "cpu"},
            "zenflow": zenflow,
        },
    }


def with_keys(base, **changes):
    """A deep copy of ``base`` with dotted keys (a__b = a.b) set; None deletes."""
    config = copy.deepcopy(base)
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        node = config
        for key in parents:
            node = node.setdefault(key, {})
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    return config


@pytest.fixture(autouse=True)
def _fresh_notices():
    reset_notices()


def notices(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "zenflow"]


# --------------------------------------------------------------------------------------------
# bad configs: each error names the dotted key and says what is allowed

EX = DEEPSPEED_ZENFLOW_EXAMPLE
BAD_CONFIGS = [
    (
        "zero_stage_3",
        with_keys(EX, zero_optimization__stage=3),
        "zero_optimization.stage: ZeRO stage 3 is not supported by zenflow; use 1 or 2",
    ),
    (
        "zero_stage_7",
        with_keys(EX, zero_optimization__stage=7),
        "zero_optimization.stage: must be 0, 1 or 2",
    ),
    (
        "zenflow_with_stage_0",
        with_keys(EX, zero_optimization__stage=0),
        "zero_optimization.stage: zenflow requires ZeRO stage 1 or 2",
    ),
    (
        "topk_ratio_above_1",
        with_keys(EX, zero_optimization__zenflow__topk_ratio=1.5),
        "zero_optimization.zenflow.topk_ratio: Input should be less than or equal to 1",
    ),
    (
        "topk_ratio_negative",
        with_keys(EX, zero_optimization__zenflow__topk_ratio=-0.1),
        "zero_optimization.zenflow.topk_ratio: Input should be greater than or equal to 0",
    ),
    (
        "select_interval_below_update_interval",
        with_keys(
            EX,
            zero_optimization__zenflow__select_strategy="step",
            zero_optimization__zenflow__select_interval=2,
        ),
        "zero_optimization.zenflow.select_interval: 2 steps is less than update_interval 4; "
        "selection happens at update boundaries, so use a multiple of update_interval (4, 8, ...)",
    ),
    (
        "step_strategy_with_auto_interval",
        with_keys(EX, zero_optimization__zenflow__select_strategy="step"),
        'zero_optimization.zenflow.select_interval: select_strategy "step" needs an integer '
        "select_interval (a number of steps)",
    ),
    (
        "unknown_select_strategy",
        with_keys(EX, zero_optimization__zenflow__select_strategy="batch"),
        "zero_optimization.zenflow.select_strategy: Input should be 'auto', 'step' or 'epoch'",
    ),
    (
        "update_interval_zero",
        with_keys(EX, zero_optimization__zenflow__update_interval=0),
        'zero_optimization.zenflow.update_interval: must be a positive integer or "auto", got 0',
    ),
    (
        "update_interval_bad_string",
        with_keys(EX, zero_optimization__zenflow__update_interval="often"),
        'zero_optimization.zenflow.update_interval: must be a positive integer or "auto"',
    ),
    (
        "pt_reserved_cores_perc_above_1",
        with_keys(EX, zero_optimization__zenflow__pt_reserved_cores_perc=2.0),
        "zero_optimization.zenflow.pt_reserved_cores_perc: Input should be less than or equal to 1",
    ),
    (
        "misspelled_zenflow_key",
        with_keys(EX, zero_optimization__zenflow__topk_ration=0.2),
        "zero_optimization.zenflow.topk_ration: unknown key (did you mean 'topk_ratio'?); allowed: "
        "accumulate_on_device, auto_ratio, bind_cores, full_warm_up_rounds, max_update_interval, "
        "min_update_interval, offload, overlap_step, pt_reserved_cores_perc, select_interval, "
        "select_strategy, steps_per_epoch, topk_ratio, update_interval",
    ),
    (
        "auto_interval_floor_above_its_ceiling",
        with_keys(
            EX,
            zero_optimization__zenflow__min_update_interval=8,
            zero_optimization__zenflow__max_update_interval=6,
        ),
        "zero_optimization.zenflow: min_update_interval (8) must be <= max_update_interval (6)",
    ),
    (
        "zenflow_without_offload",
        with_keys(EX, zero_optimization__offload_optimizer=None),
        'zero_optimization.offload_optimizer: zenflow requires "offload_optimizer": {"device": "cpu"}',
    ),
    (
        "zenflow_with_offload_none",
        with_keys(EX, zero_optimization__offload_optimizer__device="none"),
        'zero_optimization.offload_optimizer: zenflow requires "offload_optimizer": {"device": "cpu"}',
    ),
    (
        "offload_to_nvme",
        with_keys(EX, zero_optimization__offload_optimizer__device="nvme"),
        "zero_optimization.offload_optimizer.device: Input should be 'none' or 'cpu'",
    ),
    (
        "offload_without_zero",
        {
            "train_batch_size": 4,
            "zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}},
        },
        "zero_optimization.stage: offload_optimizer needs ZeRO stage 1 or 2, got 0",
    ),
    (
        "deprecated_cpu_offload",
        with_keys(EX, zero_optimization__cpu_offload=True),
        'zero_optimization.cpu_offload: deprecated; write "offload_optimizer": {"device": "cpu"}',
    ),
    (
        "unknown_optimizer_type",
        with_keys(EX, optimizer__type="SGD"),
        "optimizer.type: 'SGD' is not supported by zenflow; use 'Adam' or 'AdamW' (case-insensitive)",
    ),
    (
        "optimizer_without_type",
        with_keys(EX, optimizer__type=None),
        "optimizer.type: Field required",
    ),
    (
        "non_dict_optimizer",
        with_keys(EX, optimizer=["AdamW"]),
        'optimizer: expected a JSON object {...}, got a list (["AdamW"])',
    ),
    (
        "negative_lr",
        with_keys(EX, optimizer__params__lr=-1e-4),
        "optimizer.params.lr: Input should be greater than or equal to 0",
    ),
    (
        "lr_as_boolean",
        with_keys(EX, optimizer__params__lr=True),
        "optimizer.params.lr: Input should be a valid number, got a boolean (true)",
    ),
    (
        "betas_out_of_range",
        with_keys(EX, optimizer__params__betas=[0.9, 1.0]),
        "optimizer.params.betas: each beta must be in [0, 1), got [0.9, 1.0]",
    ),
    (
        "betas_one_value",
        with_keys(EX, optimizer__params__betas=[0.9]),
        "optimizer.params.betas.1: Field required",
    ),
    (
        "eps_nan",
        with_keys(EX, optimizer__params__eps=float("nan")),
        "optimizer.params.eps: Input should be a finite number",
    ),
    (
        "l2_adam_with_weight_decay",
        with_keys(EX, optimizer__type="Adam", optimizer__params__adam_w_mode=False),
        "optimizer.params.adam_w_mode: false (Adam with L2 weight decay) is not supported by zenflow, "
        "which implements AdamW (decoupled weight decay); remove adam_w_mode or set weight_decay to 0",
    ),
    (
        "amsgrad",
        with_keys(EX, optimizer__params__amsgrad=True),
        "optimizer.params.amsgrad: true is not supported by zenflow; remove it",
    ),
    (
        "max_grad_norm_in_optimizer",
        with_keys(EX, optimizer__params__max_grad_norm=1.0),
        "optimizer.params.max_grad_norm: not an optimizer parameter; use the top-level gradient_clipping",
    ),
    (
        "inconsistent_batch_sizes",
        with_keys(EX, gradient_accumulation_steps=4),
        "train_batch_size: 8 must equal train_micro_batch_size_per_gpu 1 x gradient_accumulation_steps 4 "
        "x world size 1 = 4; fix one of them or leave one out",
    ),
    (
        "indivisible_batch_size",
        {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4},
        "train_batch_size: 10 is not divisible by train_micro_batch_size_per_gpu 4 x world size 1",
    ),
    (
        "no_batch_size",
        {"gradient_accumulation_steps": 2},
        "train_batch_size: give train_batch_size or train_micro_batch_size_per_gpu (or both)",
    ),
    (
        "batch_size_as_string",
        with_keys(EX, train_batch_size="8"),
        'train_batch_size: Input should be a valid integer, got a string ("8")',
    ),
    (
        "batch_size_zero",
        with_keys(EX, train_batch_size=0),
        "train_batch_size: Input should be greater than 0",
    ),
    (
        "bf16_and_fp16",
        with_keys(EX, fp16={"enabled": True}),
        "bf16: bf16 and fp16 cannot both be enabled; enable one of them",
    ),
    (
        "bf16_and_bfloat16",
        with_keys(EX, bfloat16={"enabled": True}),
        "bfloat16: is the old name of bf16",
    ),
    (
        "negative_loss_scale",
        with_keys(EX, bf16=None, fp16={"enabled": True, "loss_scale": -1}),
        "fp16.loss_scale: Input should be greater than or equal to 0",
    ),
    (
        "dynamic_loss_scale_window_zero",
        with_keys(EX, bf16=None, fp16={"enabled": True, "loss_scale_window": 0}),
        "fp16.loss_scale_window: must be >= 1 with dynamic loss scaling (loss_scale 0), got 0",
    ),
    (
        "null_zero_optimization",
        {**EX, "zero_optimization": None},
        "zero_optimization: expected a JSON object {...}, got null",
    ),
    (
        "list_zenflow_block",
        with_keys(EX, zero_optimization__zenflow=[0.1]),
        "zero_optimization.zenflow: expected a JSON object {...}, got a list ([0.1])",
    ),
    (
        "misspelled_top_level_key",
        with_keys(EX, steps_per_prnt=10),
        "steps_per_prnt: unknown key (did you mean 'steps_per_print'?); allowed: bf16, fp16,",
    ),
    (
        "unknown_top_level_key",
        with_keys(EX, learning_rate=1e-4),
        "learning_rate: unknown key; allowed: bf16, fp16, gradient_accumulation_steps,",
    ),
    (
        "gradient_allreduce_sum",
        with_keys(EX, gradient_allreduce_op="sum"),
        "gradient_allreduce_op: zenflow averages gradients across ranks; only 'mean' is supported, "
        "got 'sum'",
    ),
    (
        "unknown_scheduler",
        with_keys(EX, scheduler={"type": "WarmupCosinLR", "params": {}}),
        "scheduler.type: 'WarmupCosinLR' is not a DeepSpeed LR schedule (did you mean "
        "'WarmupCosineLR'?); use one of WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest",
    ),
    (
        "misspelled_scheduler_param",
        with_keys(EX, scheduler={"type": "WarmupLR", "params": {"warmup_num_step": 10}}),
        "scheduler.params.warmup_num_step: not a parameter of WarmupLR (did you mean "
        "'warmup_num_steps'?); allowed: last_batch_iteration, warmup_max_lr, warmup_min_lr, "
        "warmup_num_steps, warmup_type",
    ),
    (
        "scheduler_missing_required_param",
        with_keys(EX, scheduler={"type": "WarmupCosineLR", "params": {"warmup_num_steps": 10}}),
        "scheduler.params.total_num_steps: required by WarmupCosineLR",
    ),
]


@pytest.mark.parametrize(
    "config, message", [c[1:] for c in BAD_CONFIGS], ids=[c[0] for c in BAD_CONFIGS]
)
def test_bad_config_names_key_and_fix(config, message):
    with pytest.raises(ConfigError) as error:
        load_config(config)
    assert type(error.value) is ConfigError  # never a raw pydantic, Key or Type error
    assert message in str(error.value)


def test_several_problems_are_reported_one_per_line():
    config = with_keys(EX, optimizer__params__lr=-1, optimizer__params__eps="tiny")
    with pytest.raises(ConfigError) as error:
        load_config(config)
    lines = str(error.value).splitlines()
    assert [line.split(":")[0] for line in lines] == ["optimizer.params.lr", "optimizer.params.eps"]


def test_invalid_json_file_names_file_and_line(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text('{\n  "train_batch_size": 8,\n  "zero_optimization": {"stage": 2,}\n}\n')
    with pytest.raises(
        ConfigError, match=re.escape(f"config: {path} line 3 column 36: invalid JSON")
    ):
        load_config(path)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"config: file '.*nowhere.json' does not exist"):
        load_config(str(tmp_path / "nowhere.json"))


def test_duplicate_json_key_is_an_error(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    with pytest.raises(ConfigError, match="key 'train_batch_size' appears twice"):
        load_config(path)


def test_json_that_is_not_an_object(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"config: expected a JSON object \{...\}, got a list"):
        load_config(path)


@pytest.mark.parametrize("argument", [{"world_size": 0}, {"steps_per_epoch": 2.5}])
def test_bad_loader_arguments(argument):
    with pytest.raises(ConfigError, match=f"{next(iter(argument))}: must be a positive integer"):
        load_config(EX, **argument)


def test_epoch_strategy_without_steps_per_epoch_is_an_error():
    config = with_keys(
        EX,
        zero_optimization__zenflow__select_strategy="epoch",
        zero_optimization__zenflow__select_interval=1,
    )
    loaded = load_config(config)  # the data loader may still tell the epoch length ...
    assert loaded.zenflow.select_interval_steps is None
    with pytest.raises(ConfigError) as error:  # ... but a run without one cannot select by epoch
        loaded.with_steps_per_epoch(None)
    assert str(error.value).startswith(
        'zero_optimization.zenflow.select_strategy: "epoch" needs the epoch length, which is not '
        "known: pass steps_per_epoch"
    )


# --------------------------------------------------------------------------------------------
# good configs

# Configs zenflow accepts that DeepSpeed accepts too (checked below with DeepSpeed itself).
GOOD_CONFIGS = {
    "deepspeed_example": EX,
    "minimal": {"train_micro_batch_size_per_gpu": 2},
    "plain_offload_no_zenflow": {
        "train_batch_size": 4,
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    },
    "stage_1_epoch_strategy": zenflow_config(
        topk_ratio=0.05, select_strategy="epoch", select_interval=2, update_interval=2
    ),
    "step_strategy": zenflow_config(select_strategy="step", select_interval=8, update_interval=4),
    "everything": {
        "train_batch_size": 32,
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {
            "type": "adam",
            "params": {"lr": 3e-4, "weight_decay": 0.1, "torch_adam": False},
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {"total_num_steps": 1000, "warmup_num_steps": 100, "warmup_max_lr": 3e-4},
        },
        "gradient_clipping": 0.5,
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "hysteresis": 1},
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": False},
            "reduce_bucket_size": 5e7,
            "allgather_bucket_size": 5e8,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "zenflow": {
                "topk_ratio": 0.2,
                "select_strategy": "step",
                "select_interval": 12,
                "update_interval": 3,
                "overlap_step": True,
                "offload": True,
                "auto_ratio": 0.95,
                "full_warm_up_rounds": 5,
                "pt_reserved_cores_perc": 0.25,
            },
        },
        "steps_per_print": 100,
        "wandb": {"enabled": False},
    },
}


@pytest.mark.parametrize("name", GOOD_CONFIGS)
def test_good_configs_load_and_deepspeed_accepts_them(name):
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.zenflow.zenflow_config import ZenFlowConfig as DeepSpeedZenFlowConfig

    config = GOOD_CONFIGS[name]
    ours = load_config(config, world_size=1)
    theirs = DeepSpeedConfig(copy.deepcopy(config))
    assert (ours.train_batch_size, ours.micro_batch_size, ours.gradient_accumulation_steps) == (
        theirs.train_batch_size,
        theirs.train_micro_batch_size_per_gpu,
        theirs.gradient_accumulation_steps,
    )
    assert ours.zero_stage == theirs.zero_optimization_stage
    assert ours.gradient_clipping == theirs.gradient_clipping
    assert ours.zenflow_enabled == (theirs.zero_config.zenflow is not None)
    block = config.get("zero_optimization", {}).get("zenflow")
    if block is not None:
        DeepSpeedZenFlowConfig(**block)


def test_deepspeed_example_values(tmp_path, caplog):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(EX))
    with caplog.at_level(logging.WARNING, logger="zenflow"):
        config = load_config(path, world_size=1)
    assert isinstance(config, ZenFlowConfig)
    assert config.zenflow_enabled and config.cpu_offload and config.zero_stage == 2
    assert config.bf16.enabled and not config.fp16.enabled
    assert (config.lr, config.betas, config.eps, config.weight_decay) == (
        2e-5,
        (0.9, 0.999),
        1e-8,
        0.01,
    )
    assert config.optimizer.type == "AdamW"
    block = config.zenflow
    assert (block.topk_ratio, block.update_interval, block.select_interval) == (0.1, 4, "auto")
    assert block.overlap_step and block.full_warm_up_rounds == 0
    assert block.select_interval_steps is None  # "auto": once per epoch, when the loader tells
    assert config.with_steps_per_epoch(20).zenflow.select_interval_steps == 20
    assert notices(caplog) == [
        "zenflow: steps_per_print: DeepSpeed setting not used by zenflow; ignored",
        "zenflow: wall_clock_breakdown: DeepSpeed setting not used by zenflow; ignored",
    ]


def test_ignored_deepspeed_keys_load_with_one_notice_each(caplog):
    ignored = {
        "steps_per_print": 10,
        "wall_clock_breakdown": True,
        "prescale_gradients": False,
        "gradient_predivide_factor": 1.0,
        "dump_state": False,
        "flops_profiler": {"enabled": False},
        "tensorboard": {"enabled": True, "output_path": "runs"},
        "wandb": {"enabled": False},
        "comms_logger": {"enabled": False},
        "activation_checkpointing": {"partition_activations": False},
        "zero_allow_untested_optimizer": True,
        "amp": {"enabled": False},
    }
    zero_ignored = {
        "contiguous_gradients": True,
        "allgather_bucket_size": 5e8,
        "reduce_scatter": True,
    }
    config = with_keys(
        EX, **ignored, **{f"zero_optimization__{k}": v for k, v in zero_ignored.items()}
    )
    config["optimizer"]["params"]["torch_adam"] = True
    config["bf16"]["immediate_grad_update"] = True
    with caplog.at_level(logging.WARNING, logger="zenflow"):
        loaded = load_config(config)
        load_config(config)
    paths = [*ignored, *(f"zero_optimization.{k}" for k in zero_ignored)]
    paths += ["optimizer.params.torch_adam", "bf16.immediate_grad_update"]
    assert sorted(notices(caplog)) == sorted(
        f"zenflow: {path}: DeepSpeed setting not used by zenflow; ignored" for path in paths
    )
    assert loaded.zenflow_enabled


def test_input_dict_is_not_modified():
    config = with_keys(EX, bfloat16={"enabled": True}, bf16=None)
    before = copy.deepcopy(config)
    loaded = load_config(config, steps_per_epoch=10)
    assert config == before
    assert loaded.bf16.enabled  # the old "bfloat16" spelling is read as bf16
    assert loaded.zenflow.steps_per_epoch == 10


@pytest.mark.parametrize(
    "given, world_size, expected",
    [
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
        ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 2, (32, 8, 2)),
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, 2, (24, 4, 3)),
        (
            {
                "train_batch_size": 24,
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": 3,
            },
            2,
            (24, 4, 3),
        ),
        ({"train_batch_size": 16}, 4, (16, 4, 1)),
        ({"train_micro_batch_size_per_gpu": 5}, 3, (15, 5, 1)),
    ],
)
def test_batch_size_derivation(given, world_size, expected):
    config = load_config(given, world_size=world_size)
    assert (
        config.train_batch_size,
        config.micro_batch_size,
        config.gradient_accumulation_steps,
    ) == expected
    assert config.world_size == world_size


def test_world_size_defaults_to_one_without_torch_distributed():
    assert not torch.distributed.is_initialized()
    assert load_config({"train_batch_size": 8}).micro_batch_size == 8


def test_batch_sizes_written_as_floats_are_integers():
    config = load_config(
        {"train_batch_size": 8.0, "zero_optimization": {"reduce_bucket_size": 5e8}}
    )
    assert config.train_batch_size == 8 and isinstance(config.train_batch_size, int)
    assert config.zero_optimization.reduce_bucket_size == 500_000_000


@pytest.mark.parametrize("spelling", ["adam", "ADAMW", "AdamW", "Adam"])
def test_optimizer_type_is_case_insensitive(spelling):
    assert load_config(with_keys(EX, optimizer__type=spelling)).optimizer.type == spelling


def test_l2_adam_without_weight_decay_is_adamw():
    config = with_keys(
        EX,
        optimizer__type="Adam",
        optimizer__params__adam_w_mode=False,
        optimizer__params__weight_decay=0,
    )
    assert load_config(config).weight_decay == 0


def test_defaults_without_optimizer_block_are_deepspeed_cpu_adam_defaults():
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    config = load_config({"train_batch_size": 8})
    defaults = inspect.signature(DeepSpeedCPUAdam).parameters
    assert config.lr == defaults["lr"].default
    assert config.betas == defaults["betas"].default
    assert config.eps == defaults["eps"].default
    assert config.weight_decay == defaults["weight_decay"].default
    assert not config.zenflow_enabled and config.zenflow is None and not config.cpu_offload


@pytest.mark.parametrize("ratio", [0.0, 1.0])
def test_topk_ratio_extension_beyond_deepspeed(ratio):
    from deepspeed.runtime.zenflow.zenflow_config import ZenFlowConfig as DeepSpeedZenFlowConfig

    assert load_config(zenflow_config(topk_ratio=ratio)).zenflow.topk_ratio == ratio
    with pytest.raises(ValueError):
        DeepSpeedZenFlowConfig(topk_ratio=ratio)


# --------------------------------------------------------------------------------------------
# select interval resolution (docs/algorithm.md, "Boundaries and selection")


@pytest.mark.parametrize(
    "strategy, interval, update, steps_per_epoch, expected",
    [
        ("step", 8, 4, None, 8),  # "step": steps
        ("step", 8, 4, 50, 8),  # ... the epoch length does not matter
        ("step", 5, "auto", None, 5),  # adaptive update interval: no multiple rule
        ("epoch", 2, 4, 10, 20),  # "epoch": epochs x steps_per_epoch
        ("epoch", 1, "auto", 7, 7),
        ("auto", "auto", 4, 12, 12),  # "auto": every epoch when its length is known
        ("auto", "auto", 4, None, 100),  # ... otherwise every max(update_interval, 100) steps
        ("auto", "auto", 250, None, 250),
        ("auto", "auto", "auto", None, 100),
        ("auto", 16, 4, None, 16),  # an int interval with "auto" means "step"
    ],
)
def test_select_interval_table(strategy, interval, update, steps_per_epoch, expected):
    assert resolve_select_interval(strategy, interval, update, steps_per_epoch) == expected
    block = {"select_strategy": strategy, "select_interval": interval, "update_interval": update}
    config = load_config(zenflow_config(**block), steps_per_epoch=steps_per_epoch)
    resolved = config.with_steps_per_epoch(steps_per_epoch)
    assert resolved.zenflow.select_interval_steps == expected


def test_auto_fallback_gives_a_notice(caplog):
    with caplog.at_level(logging.WARNING, logger="zenflow"):
        assert resolve_select_interval("auto", "auto", 3, None) == 102
    assert notices(caplog) == [
        'zenflow: select_strategy "auto" without a known epoch length: reselecting every 102 steps'
    ]


@pytest.mark.parametrize(
    "strategy, interval, update, steps_per_epoch, expected",
    [
        ("step", 10, 4, None, 12),
        ("epoch", 1, 4, 10, 12),
        ("auto", "auto", 4, 10, 12),
        ("epoch", 1, 8, 3, 8),  # an epoch shorter than update_interval: one window
    ],
)
def test_select_interval_rounds_up_to_update_interval_with_notice(
    caplog, strategy, interval, update, steps_per_epoch, expected
):
    with caplog.at_level(logging.WARNING, logger="zenflow"):
        assert resolve_select_interval(strategy, interval, update, steps_per_epoch) == expected
    unrounded = (
        interval
        if steps_per_epoch is None
        else steps_per_epoch * (1 if interval == "auto" else interval)
    )
    assert notices(caplog) == [
        f"zenflow: select interval of {unrounded} steps is not a multiple of update_interval {update}; "
        f"rounded up to {expected} steps"
    ]


def test_select_interval_multiple_needs_no_notice(caplog):
    with caplog.at_level(logging.WARNING, logger="zenflow"):
        assert load_config(
            zenflow_config(select_strategy="step", select_interval=12, update_interval=4)
        )
    assert notices(caplog) == []


@pytest.mark.parametrize(
    "arguments, message",
    [
        (("step", 2, 4, None), "select_interval: 2 steps is less than update_interval 4"),
        (("auto", 2, 4, None), "select_interval: 2 steps is less than update_interval 4"),
        (("epoch", 1, 4, None), 'select_strategy: "epoch" needs the epoch length'),
        (("epoch", "auto", 4, 10), 'select_interval: select_strategy "epoch" needs an integer'),
        (("weekly", 1, 4, None), 'select_strategy: must be "auto", "step" or "epoch"'),
        (
            ("step", True, 1, None),
            'select_interval: must be a positive integer or "auto", got True',
        ),
        (("step", 4, -4, None), 'update_interval: must be a positive integer or "auto", got -4'),
        (("auto", "auto", 4, 0), "steps_per_epoch: must be a positive integer or None, got 0"),
    ],
)
def test_resolve_select_interval_errors(arguments, message):
    with pytest.raises(ValueError, match=message):
        resolve_select_interval(*arguments)


def test_steps_per_epoch_resolution_paths():
    block = {"select_strategy": "epoch", "select_interval": 2, "update_interval": 2}
    assert load_config(zenflow_config(**block)).zenflow.select_interval_steps is None
    assert (
        load_config(zenflow_config(**block), steps_per_epoch=5).zenflow.select_interval_steps == 10
    )
    # the loader's value wins over one written in the block
    in_block = zenflow_config(**block, steps_per_epoch=3)
    assert load_config(in_block).zenflow.select_interval_steps == 6
    assert load_config(in_block, steps_per_epoch=4).zenflow.select_interval_steps == 8
    # "auto" without any epoch length becomes a fixed step interval
    resolved = load_config(zenflow_config(update_interval=4)).with_steps_per_epoch(None)
    assert (resolved.zenflow.select_strategy, resolved.zenflow.select_interval) == ("step", 100)
    assert resolved.zenflow.select_interval_steps == 100
    plain = load_config({"train_batch_size": 2})
    assert plain.with_steps_per_epoch(None) is plain


def test_with_steps_per_epoch_rejects_bad_values():
    config = load_config(zenflow_config())
    with pytest.raises(
        ConfigError,
        match="zero_optimization.zenflow.steps_per_epoch: Input should be greater than 0",
    ):
        config.with_steps_per_epoch(0)


# --------------------------------------------------------------------------------------------
# parity with DeepSpeed's own definitions


def test_zenflow_block_has_every_deepspeed_field_with_the_same_default():
    from deepspeed.runtime.zenflow.zenflow_config import ZenFlowConfig as DeepSpeedZenFlowConfig

    ours = ZenFlowSettings.model_fields
    for name, field in DeepSpeedZenFlowConfig.model_fields.items():
        assert name in ours, name
        assert ours[name].get_default() == field.get_default(), name
    assert set(ours) - ZenFlowSettings.extensions == set(DeepSpeedZenFlowConfig.model_fields)


def test_every_deepspeed_zero_key_is_known():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    known = ZeroConfig.model_fields.keys() | ZeroConfig.ignored_keys | ZeroConfig.key_hints.keys()
    for name, field in DeepSpeedZeroConfig.model_fields.items():
        assert name in known, name
        assert field.alias is None or field.alias in known, field.alias


def test_every_deepspeed_precision_and_offload_key_is_known():
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadOptimizerConfig

    from zenflow.config import BF16Config, FP16Config, OffloadOptimizerConfig

    for theirs, ours in [
        (DeepSpeedBF16Config, BF16Config),
        (DeepSpeedFP16Config, FP16Config),
        (DeepSpeedZeroOffloadOptimizerConfig, OffloadOptimizerConfig),
    ]:
        known = ours.model_fields.keys() | ours.ignored_keys
        assert set(theirs.model_fields) <= known, theirs.__name__
        for name in ours.model_fields.keys() & theirs.model_fields.keys():
            assert (
                ours.model_fields[name].get_default() == theirs.model_fields[name].get_default()
            ), name


def test_removed_deepspeed_keys_still_load():
    from deepspeed.runtime import config as deepspeed_config

    known = ZenFlowConfig.ignored_keys
    assert set(deepspeed_config._REMOVED_TOP_LEVEL_CONFIG_KEYS) <= known
    assert set(deepspeed_config._REMOVED_ZERO_CONFIG_KEYS) <= ZeroConfig.ignored_keys


def test_scheduler_parameter_table_matches_deepspeed():
    from deepspeed.runtime import lr_schedules

    from zenflow.config import _SCHEDULER_PARAMS

    assert set(_SCHEDULER_PARAMS) == set(lr_schedules.VALID_LR_SCHEDULES)
    for name, (required, optional) in _SCHEDULER_PARAMS.items():
        parameters = list(inspect.signature(getattr(lr_schedules, name)).parameters.values())[1:]
        assert {p.name for p in parameters if p.default is inspect.Parameter.empty} == required, (
            name
        )
        assert {
            p.name for p in parameters if p.default is not inspect.Parameter.empty
        } == optional, name


# --------------------------------------------------------------------------------------------
# build_lr_scheduler

SCHEDULES = [
    ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 10}),
    ("WarmupLR", {"warmup_num_steps": 5, "warmup_type": "linear"}),
    ("WarmupCosineLR", {"total_num_steps": 40, "warmup_num_steps": 8, "warmup_min_ratio": 0.1}),
    ("WarmupDecayLR", {"total_num_steps": 30, "warmup_num_steps": 5, "warmup_max_lr": 2e-3}),
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 5}),
    ("LRRangeTest", {"lr_range_test_min_lr": 1e-5, "lr_range_test_step_size": 3}),
]


@pytest.mark.parametrize(
    "name, params", SCHEDULES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(SCHEDULES)]
)
def test_build_lr_scheduler_matches_deepspeed(name, params):
    from deepspeed.runtime import lr_schedules

    def lrs(make_scheduler):
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
        scheduler = make_scheduler(optimizer)
        sequence = []
        for _ in range(45):
            optimizer.step()
            scheduler.step()
            sequence.append(optimizer.param_groups[0]["lr"])
        return sequence

    config = load_config(with_keys(EX, scheduler={"type": name, "params": params}))
    ours = lrs(lambda optimizer: build_lr_scheduler(config, optimizer))
    theirs = lrs(lambda optimizer: getattr(lr_schedules, name)(optimizer, **params))
    assert ours == theirs
    assert len(set(ours)) > 2  # the schedule really changes the lr


def test_build_lr_scheduler_without_scheduler():
    assert (
        build_lr_scheduler(load_config(EX), torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))]))
        is None
    )


def test_build_lr_scheduler_reports_bad_values_as_config_errors():
    config = load_config(
        with_keys(EX, scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 0}})
    )
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(
        ConfigError, match="scheduler.params: warmup_num_steps must be a positive integer"
    ):
        build_lr_scheduler(config, optimizer)


def test_public_names():
    import zenflow

    assert zenflow.load_config is load_config
    assert zenflow.ZenFlowConfig is ZenFlowConfig
    assert zenflow.ConfigError is ConfigError
    assert zenflow.build_lr_scheduler is build_lr_scheduler


def test_pin_memory_false_loads_with_a_notice_that_it_is_ignored(caplog):
    config = copy.deepcopy(EX)
    config["zero_optimization"]["offload_optimizer"]["pin_memory"] = False
    reset_notices()
    with caplog.at_level(logging.WARNING, logger="zenflow"):
        load_config(config)
    assert [n for n in notices(caplog) if "offload_optimizer" in n] == [
        "zenflow: zero_optimization.offload_optimizer.pin_memory: false is ignored; zenflow "
        "pins its host buffers whenever the weights are on a GPU"
    ]
