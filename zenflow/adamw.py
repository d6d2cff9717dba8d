"""``PlainAdamW``: ``torch.optim.AdamW`` behind the interface the engine talks to.

A config with neither a zenflow block, nor offload, nor 16-bit weights trains with torch's
AdamW (the plain baseline). This subclass (LR schedulers take a ``torch.optim.Optimizer``; its
``state_dict`` is torch's) adds what ``ZenFlowAdamW`` offers the engine: ``step(grad_divisor=)``
with the same finite check and clipping (``zenflow.runtime.nonfinite``), ``last_step_skipped``,
``flush``, ``stats``, ``fp32_parameters``. Data parallel without ZeRO: every rank steps on the
mean gradient, as DDP would.
"""

from collections.abc import Iterable

import torch

from zenflow.runtime.comm import DataParallel
from zenflow.runtime.nonfinite import NONFINITE_POLICIES, clip_coefficient
from zenflow.runtime.selective_step import STEP_BACKENDS


class PlainAdamW(torch.optim.AdamW):
    """Owns, beside torch's state, the clipping and non-finite settings and the step counts
    behind ``stats()``."""

    # Its fp32 values are the parameters themselves: a checkpoint may leave its state out.
    holds_master_weights = False

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        *,
        max_grad_norm: float | None = None,
        nonfinite: str = "raise",
        fused: bool | None = None,
        foreach: bool | None = None,
    ):
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f'nonfinite must be "raise" or "skip", got {nonfinite!r}')
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            fused=fused,
            foreach=foreach,
        )
        self.max_grad_norm = max_grad_norm
        self.nonfinite = nonfinite
        self.last_step_skipped = False
        self._data_parallel = DataParallel()
        self._counts = dict(steps=0, skipped_steps=0)

    @property
    def step_backend(self) -> str:
        """torch's AdamW runs its own kernels: "eager" whatever the engine asks for."""
        return "eager"

    @step_backend.setter
    def step_backend(self, requested: str) -> None:
        if requested not in STEP_BACKENDS:
            raise ValueError(f"step_backend must be one of {STEP_BACKENDS}, got {requested!r}")

    def check_usable(self) -> None:
        """Nothing of this optimizer's can be left undefined by a failure."""

    @torch.no_grad()
    def step(self, closure=None, *, grad_divisor: float = 1.0):
        """One AdamW step on the data-parallel mean gradient, divided by ``grad_divisor`` and
        clipped; a non-finite gradient commits nothing (see ``zenflow.runtime.nonfinite``)."""
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        for grad in grads:
            self._data_parallel.all_reduce_mean_(grad)
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        coefficient = clip_coefficient(
            float(norm) ** 2,
            grad_divisor,
            self.max_grad_norm,
            self.nonfinite,
            self._counts["steps"] + 1,
        )
        self.last_step_skipped = coefficient is None
        if self.last_step_skipped:
            self._counts["skipped_steps"] += 1
            return None
        if coefficient != 1.0:
            torch._foreach_mul_(grads, coefficient)
        loss = super().step(closure)
        self._counts["steps"] += 1
        return loss

    def flush(self) -> None:
        """Nothing is ever pending."""

    def stats(self) -> dict:
        return dict(self._counts)

    def fp32_parameters(self) -> dict[torch.nn.Parameter, torch.Tensor]:
        return {
            p: p.detach().float().cpu().clone()
            for group in self.param_groups
            for p in group["params"]
        }

    def load_resharded(self, states: list[dict]) -> None:
        """A state saved at another world size: every rank saved the same (replicated) state."""
        self.load_state_dict(states[0])
