"""Config fuzzing: whatever JSON reaches ``zenflow.initialize``, the outcome is an engine that
trains, or a ``ConfigError`` whose message names the offending key; never another exception.

Configs are built around the real keys (valid values, near misses, wrong types, unknown keys)
so that most examples get past the first check."""

import json
import math

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import zenflow
from zenflow.config import ConfigError, ZenFlowConfig

EXAMPLES = 250

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-3, 2**40)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=6)
    | st.sampled_from(["auto", "step", "epoch", "cpu", "none", "nvme", "AdamW", "Adam", "skip"])
)
anything = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)


def either(good: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly a plausible value, sometimes any JSON value."""
    return st.one_of(good, good, good, anything)


small_int = st.integers(-1, 6)
ratio = st.floats(-0.5, 1.5) | st.sampled_from([0, 1, 0.0, 1.0, 0.25])
interval = small_int | st.just("auto") | st.sampled_from([2.0, 4.0, 1e9])
positive = st.floats(0, 10) | st.sampled_from([0, 1e-3, 1e9, -1.0])


def section(fields: dict, unknown: bool = True) -> st.SearchStrategy:
    """A JSON object with any subset of ``fields``, sometimes with an unknown key."""
    base = st.fixed_dictionaries({}, optional={k: either(v) for k, v in fields.items()})
    if not unknown:
        return base
    extra = st.dictionaries(
        st.sampled_from(["typo_key", "stage3_x", "Zenflow"]), anything, max_size=1
    )
    return st.builds(lambda a, b: {**a, **b}, base, extra | st.just({}) | st.just({}))


zenflow_block = section(
    {
        "topk_ratio": ratio,
        "select_strategy": st.sampled_from(["auto", "step", "epoch", "Step"]),
        "select_interval": interval,
        "update_interval": interval,
        "overlap_step": st.booleans(),
        "offload": st.booleans(),
        "auto_ratio": ratio,
        "full_warm_up_rounds": small_int,
        "pt_reserved_cores_perc": ratio,
        "steps_per_epoch": small_int | st.none(),
    }
)
zero = section(
    {
        "stage": st.integers(-1, 4),
        "offload_optimizer": section(
            {"device": st.sampled_from(["cpu", "none", "nvme"]), "pin_memory": st.booleans()}
        ),
        "reduce_bucket_size": st.integers(-1, 10**9) | st.just(5e8),
        "overlap_comm": st.booleans(),
        "contiguous_gradients": st.booleans(),
        "zenflow": zenflow_block | st.none(),
        "cpu_offload": st.booleans(),
    }
)
optimizer = section(
    {
        "type": st.sampled_from(["AdamW", "Adam", "adamw", "SGD", "Lamb"]),
        "params": section(
            {
                "lr": positive,
                "betas": st.lists(ratio, min_size=0, max_size=3),
                "eps": positive,
                "weight_decay": positive,
                "adam_w_mode": st.booleans(),
                "bias_correction": st.booleans(),
                "amsgrad": st.booleans(),
                "torch_adam": st.booleans(),
                "max_grad_norm": positive,
            }
        ),
    }
)
schedule_params = st.dictionaries(
    st.sampled_from(
        [
            "warmup_min_lr",
            "warmup_max_lr",
            "warmup_num_steps",
            "warmup_type",
            "total_num_steps",
            "cycle_min_lr",
            "cycle_max_lr",
            "cos_min_ratio",
            "warmup_min_ratio",
            "last_batch_iteration",
            "lr_range_test_min_lr",
            "lr_range_test_step_size",
        ]
    ),
    either(small_int | positive | st.sampled_from(["log", "linear"])),
    max_size=4,
)
scheduler = section(
    {
        "type": st.sampled_from(
            ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest", "Cosine"]
        ),
        "params": schedule_params,
    }
)
fp16 = section(
    {
        "enabled": st.booleans(),
        "loss_scale": positive,
        "initial_scale_power": st.integers(-1, 40),
        "loss_scale_window": small_int,
        "hysteresis": small_int,
        "min_loss_scale": small_int,
        "auto_cast": st.booleans(),
    }
)
configs = section(
    {
        "train_batch_size": st.integers(-1, 16) | st.just(8.0),
        "train_micro_batch_size_per_gpu": st.integers(-1, 8),
        "gradient_accumulation_steps": st.integers(-1, 4),
        "optimizer": optimizer,
        "scheduler": scheduler | st.none(),
        "gradient_clipping": positive,
        "bf16": section({"enabled": st.booleans(), "check_grad_overflow": st.booleans()}),
        "bfloat16": section({"enabled": st.booleans()}),
        "fp16": fp16,
        "zero_optimization": zero,
        "nonfinite_gradients": st.sampled_from(["raise", "skip", "warn"]),
        "process_group_timeout_s": positive,
        "steps_per_print": small_int,
        "gradient_allreduce_op": st.sampled_from(["mean", "sum"]),
    }
)


good_zenflow = st.fixed_dictionaries(
    {},
    optional={
        "topk_ratio": st.sampled_from([0.0, 0.1, 0.5, 1.0]),
        "select_strategy": st.sampled_from(["auto", "step"]),
        "select_interval": st.sampled_from(["auto", 2, 4, 8]),
        "update_interval": st.sampled_from(["auto", 1, 2]),
        "overlap_step": st.booleans(),
        "full_warm_up_rounds": st.integers(0, 2),
        "pt_reserved_cores_perc": st.sampled_from([0.0, 0.5, 0.9]),
    },
)
good_zero = st.one_of(
    st.fixed_dictionaries({"stage": st.just(0)}),
    st.fixed_dictionaries(
        {"stage": st.sampled_from([1, 2]), "offload_optimizer": st.just({"device": "cpu"})},
        optional={"zenflow": good_zenflow},
    ),
)
good_configs = st.fixed_dictionaries(
    {"train_micro_batch_size_per_gpu": st.integers(1, 4)},
    optional={
        "gradient_accumulation_steps": st.integers(1, 3),
        "optimizer": st.fixed_dictionaries(
            {"type": st.sampled_from(["AdamW", "Adam"])},
            optional={
                "params": st.fixed_dictionaries(
                    {},
                    optional={
                        "lr": st.sampled_from([1e-3, 1e-2]),
                        "weight_decay": st.sampled_from([0.0, 0.01]),
                        "betas": st.just([0.9, 0.99]),
                    },
                )
            },
        ),
        "scheduler": st.fixed_dictionaries(
            {
                "type": st.just("WarmupLR"),
                "params": st.fixed_dictionaries({"warmup_num_steps": st.integers(1, 5)}),
            }
        ),
        "gradient_clipping": st.sampled_from([0.0, 1.0]),
        "bf16": st.fixed_dictionaries({"enabled": st.booleans()}),
        "fp16": st.fixed_dictionaries(
            {"enabled": st.booleans(), "initial_scale_power": st.integers(0, 16)}
        ),
        "zero_optimization": good_zero,
        "nonfinite_gradients": st.sampled_from(["raise", "skip"]),
        "process_group_timeout_s": st.sampled_from([1.0, 600]),
    },
)


REQUIRED_SCHEDULE_PARAMS = {
    "WarmupLR": {},
    "WarmupDecayLR": {"total_num_steps": 10},
    "WarmupCosineLR": {"total_num_steps": 10},
    "OneCycle": {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2},
}


@st.composite
def schedules(draw) -> dict:
    """A good config with a DeepSpeed schedule whose parameters take any values: DeepSpeed's
    classes check some of them only when stepping."""
    config = draw(good_configs)
    kind = draw(st.sampled_from(sorted(REQUIRED_SCHEDULE_PARAMS)))
    params = dict(REQUIRED_SCHEDULE_PARAMS[kind])
    name = draw(st.sampled_from(sorted(zenflow.config._SCHEDULER_PARAMS[kind][1])))
    params[name] = draw(anything | small_int | positive)
    config["scheduler"] = {"type": kind, "params": params}
    return config


@st.composite
def near_misses(draw) -> dict:
    """A good config with one value somewhere replaced by any JSON value, or one key added."""
    config = json.loads(json.dumps(draw(good_configs)))
    sections = [config]
    for value in list(config.values()):
        if isinstance(value, dict):
            sections.append(value)
            sections.extend(v for v in value.values() if isinstance(v, dict))
    target = draw(st.sampled_from(sections))
    key = draw(st.sampled_from(sorted(target)) | st.text(max_size=6)) if target else "x"
    target[key] = draw(anything)
    return config


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


def names_a_key(message: str, config: dict) -> bool:
    """``dotted.key: problem`` on every line, the path starting at a key of the config (or a key
    it should have had)."""
    keys = set(map(str, config)) | set(ZenFlowConfig.model_fields)
    known = keys | {json.dumps(k) for k in keys} | {"config"}
    for line in message.split("\n"):
        path, sep, problem = line.partition(": ")
        if not sep or not problem or not any(path == k or path.startswith(k + ".") for k in known):
            return False
    return True


def train_one_step(engine) -> None:
    dtype = next(engine.module.parameters()).dtype
    for _ in range(engine.gradient_accumulation_steps()):
        x = torch.randn(4, 6, dtype=dtype, device=engine.device)
        y = torch.randn(4, 2, dtype=dtype, device=engine.device)
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
    assert engine.global_steps == 1
    assert all(torch.isfinite(p).all() for p in engine.module.parameters()) or (
        engine.skipped_steps == 1
    )


outcomes = {"engine": 0, "config_error": 0}


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(st.one_of(good_configs, near_misses(), schedules(), configs))
def test_any_config_gives_an_engine_or_an_error_naming_the_key(config):
    json.dumps(config)  # the strategies produce JSON only
    try:
        engine, *_ = zenflow.initialize(model=tiny_model(), config=config)
    except ConfigError as error:
        assert names_a_key(str(error), config), str(error)
        outcomes["config_error"] += 1
        return
    outcomes["engine"] += 1
    lr = engine.get_lr()
    if all(math.isfinite(v) for v in lr):
        train_one_step(engine)


def test_fuzzing_reached_both_outcomes():
    # Runs after the fuzz test (file order): a strategy that only produced errors (or only
    # engines) would test little.
    assert outcomes["engine"] >= EXAMPLES // 10 and outcomes["config_error"] >= EXAMPLES // 10
