"""accumulate_on_device "auto": the rule, as the optimizer reports it and as it decides."""

import pytest
import torch
from torch import nn

import zenflow
from zenflow.optimizer import ZenFlowAdamW
from zenflow.runtime.device_sums import DEVICE_SUMS_SHARE, device_sums_for

GPU = torch.device("cuda", 0)  # a device object: nothing here touches a GPU


def trained_steps(**settings) -> ZenFlowAdamW:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    optimizer = ZenFlowAdamW(
        model.parameters(), lr=1e-2, topk_ratio=0.25, update_interval=2, select_interval=4,
        step_backend="eager", **settings,
    )  # fmt: skip
    for i in range(4):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(i))
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return optimizer


@pytest.mark.parametrize(("requested", "on"), [("auto", False), (True, True), (False, False)])
def test_the_decision_is_reported_and_auto_is_off_on_the_cpu(requested, on):
    optimizer = trained_steps(accumulate_on_device=requested)
    assert optimizer.stats()["accumulate_on_device"] is on
    assert optimizer.stats()["cpu_updates"] == 2


def test_device_sums_change_no_value():
    on, off = trained_steps(accumulate_on_device=True), trained_steps(accumulate_on_device=False)
    for a, b in zip(on.param_groups[0]["params"], off.param_groups[0]["params"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_auto_is_on_for_one_gpu_rank_while_the_sums_fit_a_quarter_of_free_memory():
    free = 4 << 30
    fits = int(DEVICE_SUMS_SHARE * free)
    assert device_sums_for("auto", GPU, 1, fits, free).on
    too_big = device_sums_for("auto", GPU, 1, fits + 1, free)
    assert not too_big.on and "at most 25%" in too_big.reason
    assert not device_sums_for("auto", GPU, 2, 1, free).on
    assert not device_sums_for("auto", GPU, 1, 1, free, offload=True).on
    assert not device_sums_for("auto", torch.device("cpu"), 1, 1, free).on
    assert device_sums_for(True, torch.device("cpu"), 1, 1 << 40, free).on


def test_a_bad_value_names_the_key():
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu"},
            "zenflow": {"accumulate_on_device": "sometimes"},
        },
    }
    with pytest.raises(zenflow.ConfigError, match="accumulate_on_device"):
        zenflow.initialize(model=nn.Linear(2, 2), config=config)
