"""The ZeRO block the data-parallel tests share: host offload and a ZenFlow block whose windows
close every 2 steps in the background, with a reselection every 4 (a window then closes
synchronously)."""


def overlapped_zenflow_zero(stage: int = 2) -> dict:
    return {
        "stage": stage,
        "offload_optimizer": {"device": "cpu"},
        "zenflow": {
            "topk_ratio": 0.25,
            "update_interval": 2,
            "select_interval": 4,
            "overlap_step": True,
        },
    }
