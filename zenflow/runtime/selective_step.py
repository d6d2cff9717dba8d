"""The optimizer graph: fp32 AdamW of the device-resident rows, compiled so Inductor fuses it.

Rows are per-column state (``[k, out]``; a 1-D parameter is one row) and ``steps`` holds each
row's step count, so columns with different histories get their own bias correction. ``lr`` and
``coefficient`` (the clip factor) are 0-d tensors: as Python floats every new learning rate
from a schedule would specialize the graph and recompile it.

``destinations``: where each updated master goes in the model, in the same pass: ``(rows,
index)`` writes master row i to ``rows[index[i]]`` (a weight's selected columns, as rows of its
column-major storage), ``(rows, None)`` copies the master to ``rows``, None writes nothing.
"""

import functools

import torch


def selective_adamw_(
    masters: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    grads: list[torch.Tensor],
    lr: torch.Tensor,
    coefficient: torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    destinations: list[tuple[torch.Tensor, torch.Tensor | None] | None],
) -> None:
    for master, exp_avg, exp_avg_sq, step, grad, destination in zip(
        masters, exp_avgs, exp_avg_sqs, steps, grads, destinations, strict=True
    ):
        step.add_(1)
        grad = grad * coefficient.to(torch.float32)
        master.mul_((1 - lr * weight_decay).to(torch.float32))
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step64 = step.to(torch.float64)
        step_size = (lr / (1 - beta1**step64)).to(torch.float32)
        bias_correction2_sqrt = (1 - beta2**step64).sqrt().to(torch.float32)
        denom = exp_avg_sq.sqrt() / bias_correction2_sqrt[:, None] + eps
        master.sub_(step_size[:, None] * exp_avg / denom)
        if destination is not None:
            rows, index = destination
            if index is None:
                rows.copy_(master)
            else:
                rows.index_copy_(0, index, master.to(rows.dtype))


@functools.cache
def compiled_selective_adamw(backend: str):
    """``selective_adamw_`` compiled with ``backend`` ("inductor"), or as is for "eager"."""
    if backend == "eager":
        return selective_adamw_
    return torch.compile(selective_adamw_, backend=backend, fullgraph=True, dynamic=False)
