"""A step's finite check and clip coefficient: one rule for every optimizer zenflow runs.

The squared global norm of the step's gradient (every parameter's, after the data-parallel
mean, before dividing out the loss scale ``grad_divisor``) decides: a NaN or infinite norm
commits nothing (raised as ``NonFiniteGradientError``, or skipped for the "skip" policy, which
fp16 loss scaling needs); otherwise the gradient is multiplied by ``1 / grad_divisor``, times
``min(1, max_norm / (norm + 1e-6))`` with clipping.
"""

import math


class NonFiniteGradientError(FloatingPointError):
    """A step's gradient norm is NaN or infinite (with ``nonfinite="raise"``)."""


NONFINITE_POLICIES = ("raise", "skip")


def clip_coefficient(
    norm_sq: float, grad_divisor: float, max_norm: float | None, policy: str, step: int
) -> float | None:
    """The factor the step's gradient is committed with, or None for a skipped step.
    ``step``: the number of the step, for the error message."""
    if not math.isfinite(norm_sq):
        if policy == "raise":
            raise NonFiniteGradientError(
                f"the gradient norm of step {step} is {math.sqrt(norm_sq)}: a NaN or infinite "
                "gradient; nothing was committed. Find the cause, or skip such steps with "
                'nonfinite="skip" (engine config: "nonfinite_gradients": "skip")'
            )
        return None
    coefficient = 1.0 / grad_divisor
    if max_norm is not None:
        norm = math.sqrt(norm_sq) / grad_divisor
        coefficient *= min(1.0, max_norm / (norm + 1e-6))
    return coefficient
