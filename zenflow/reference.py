"""Plain eager ZenFlow: slow, obviously correct, the numerical oracle for everything else.

One process, any device, no offloading: "device" and "host" state are the same tensors here, so
what this file pins down is the arithmetic and the schedule of ZENFLOW.md's exact semantics:

* step ``t`` counts committed optimizer steps; a skipped step (a non-finite gradient) commits
  nothing and does not count.
* The first ``full_warm_up_rounds`` steps update every parameter every step (plain AdamW).
* After warm-up, ``s = t - full_warm_up_rounds``. The first step after warm-up picks, for
  every weight, the top-k columns by the squared L2 norm of its gradient, before the step is
  committed (so topk_ratio 1 is AdamW from the first step).
* Each step, selected columns and every 1-D parameter take an AdamW step; the other columns'
  (clipped) gradients are summed into an accumulator.
* A window closes after every ``update_interval``-th step (``(s + 1) % update_interval == 0``):
  unselected columns take one AdamW step on the window's mean gradient (sum / committed steps)
  with the lr of the closing step; each column counts its own steps for bias correction.
* update_interval "auto": the window closes when at least ``auto_ratio`` of the weights with
  both kinds of columns need an update (their accumulated unselected sum carries, per column,
  as much squared norm as a selected column's step on average over the window), never before
  ``min_update_interval`` steps, at the latest after ``max_update_interval``, and at every
  select boundary; a window of n steps updates with ``lr * sqrt(n)``.
* With ``overlap_step`` the result of window w reaches the parameters at the end of window w + 1
  (one window stale).
* A select boundary (``(s + 1) % select_interval == 0``) closes its window as above, then picks
  the next selection from the boundary step's gradient. Columns that enter the selection take
  the closing window's update at once (they are updated every step from now on); the columns
  that stay unselected receive theirs as any window's (one window later with
  ``overlap_step``); the columns that leave join the next window.
"""

import math
from collections.abc import Callable, Iterable

import torch

from zenflow.columns import (
    as_matrix,
    column_importance,
    has_columns,
    select_top_columns,
    topk_count,
)
from zenflow.settings import resolve_select_interval

Selector = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


def adamw_update(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor | int,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """In-place AdamW on fp32 tensors. ``step`` is the step number after this update: an int, or
    one count per column (last dim) when columns have different histories."""
    master.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step = torch.as_tensor(step, dtype=torch.float64, device=master.device)
    step_size = (lr / (1 - beta1**step)).float()
    bias_correction2_sqrt = (1 - beta2**step).sqrt().float()
    denom = exp_avg_sq.sqrt() / bias_correction2_sqrt + eps
    master.sub_(step_size * exp_avg / denom)


class ReferenceZenFlowAdamW(torch.optim.Optimizer):
    """ZenFlow AdamW, eagerly and readably. See the module docstring for the exact schedule.

    ``selector(param, scores, k)`` may replace the top-k rule (tests inject selections with it).
    ``max_grad_norm`` clips by the global norm of each step's gradients before they are committed.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        *,
        topk_ratio: float = 0.1,
        update_interval: int | str = "auto",
        select_interval: int | str = "auto",
        select_strategy: str = "auto",
        steps_per_epoch: int | None = None,
        overlap_step: bool = False,
        full_warm_up_rounds: int = 0,
        auto_ratio: float = 0.99,
        min_update_interval: int | None = None,
        max_update_interval: int = 16,
        max_grad_norm: float | None = None,
        selector: Selector | None = None,
    ):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.topk_ratio = topk_ratio
        self.update_interval = update_interval
        self.select_interval = resolve_select_interval(
            select_strategy, select_interval, update_interval, steps_per_epoch
        )
        self.overlap_step = overlap_step
        self.full_warm_up_rounds = full_warm_up_rounds
        self.auto_ratio = auto_ratio
        self.max_update_interval = max_update_interval
        if min_update_interval is None:
            min_update_interval = min(4, max_update_interval)
        self.min_update_interval = min_update_interval
        # update_interval "auto": per weight, (piled energy per column, sum over the window's
        # steps of the selected energy per column).
        self._auto_energies: dict[torch.Tensor, tuple[float, float]] = {}
        self.max_grad_norm = max_grad_norm
        self.selector = selector or (lambda param, scores, k: select_top_columns(scores, k))
        self.committed_steps = 0
        self.window_steps = 0
        self.skipped_steps = 0
        self.reselections = 0
        self.cpu_updates = 0

    def _params(self):
        for group in self.param_groups:
            for p in group["params"]:
                yield group, p

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            master = p.detach().float().clone()
            state["master"] = master
            state["exp_avg"] = torch.zeros_like(master)
            state["exp_avg_sq"] = torch.zeros_like(master)
            if has_columns(p):
                columns = as_matrix(master).shape[1]
                state["column_steps"] = torch.zeros(columns, dtype=torch.int64, device=p.device)
                state["selected"] = None
                state["accumulator"] = torch.zeros_like(as_matrix(master))
                state["pending"] = None
            else:
                state["step"] = 0
        return state

    def _clip_coefficient(self, grads: list[torch.Tensor]) -> float:
        if self.max_grad_norm is None:
            return 1.0
        total_norm = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])
        )
        return min(1.0, self.max_grad_norm / (total_norm.item() + 1e-6))

    @torch.no_grad()
    def step(self) -> bool:
        """One optimizer step. Returns False when the step was skipped (non-finite gradient)."""
        live = [(group, p) for group, p in self._params() if p.grad is not None]
        grads = [p.grad for _, p in live]
        if any(not torch.isfinite(g).all() for g in grads):
            self.skipped_steps += 1
            return False
        coefficient = self._clip_coefficient(grads)
        warm_up = self.committed_steps < self.full_warm_up_rounds
        s = self.committed_steps - self.full_warm_up_rounds
        for group, p in live:
            grad = p.grad.float() * coefficient
            if warm_up or not has_columns(p):
                self._full_step(group, p, grad)
            else:
                if self._state(p)["selected"] is None:
                    self._select(p, p.grad)
                self._selective_step(group, p, grad)
        if not warm_up and s == 0:
            self.reselections += 1
        self.committed_steps += 1
        if not warm_up:
            self.window_steps += 1
            select_boundary = (s + 1) % self.select_interval == 0
            if self.update_interval == "auto":
                closes = self._auto_window_full(live, coefficient) or select_boundary
            else:
                closes = (s + 1) % self.update_interval == 0
            if closes:
                self._close_window()
            if select_boundary and self.topk_ratio > 0:
                self._reselect_after_boundary(live)
        return True

    def _auto_window_full(self, live, coefficient: float) -> bool:
        considered = needing = 0
        for _, p in live:
            state = self._state(p)
            if not has_columns(p):
                continue
            columns, k = state["column_steps"].numel(), state["selected"].numel()
            if k in (0, columns):
                continue
            committed = as_matrix(p.grad).double() * coefficient
            selected = float(committed[:, state["selected"]].square().sum()) / k
            piled = float(state["accumulator"].double().square().sum()) / (columns - k)
            _, selected_sum = self._auto_energies.get(p, (0.0, 0.0))
            self._auto_energies[p] = (piled, selected_sum + selected)
            considered += 1
            needing += piled >= (selected_sum + selected) / self.window_steps
        if self.window_steps >= self.max_update_interval:
            return True
        if self.window_steps < self.min_update_interval:
            return False
        return considered > 0 and needing >= self.auto_ratio * considered

    def _hyper(self, group: dict, lr: float | None = None) -> dict:
        beta1, beta2 = group["betas"]
        return dict(
            lr=group["lr"] if lr is None else lr,
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
        )

    def _full_step(self, group: dict, p: torch.Tensor, grad: torch.Tensor) -> None:
        state = self._state(p)
        if has_columns(p):
            state["column_steps"] += 1
            steps = state["column_steps"]
            matrices = [as_matrix(state[k]) for k in ("master", "exp_avg", "exp_avg_sq")]
            adamw_update(
                matrices[0], as_matrix(grad), matrices[1], matrices[2], steps, **self._hyper(group)
            )
        else:
            state["step"] += 1
            adamw_update(
                state["master"],
                grad,
                state["exp_avg"],
                state["exp_avg_sq"],
                state["step"],
                **self._hyper(group),
            )
        p.copy_(state["master"])

    def _select(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        state = self._state(p)
        scores = column_importance(grad)
        k = topk_count(self.topk_ratio, scores.numel())
        state["selected"] = self.selector(p, scores, k).to(p.device)

    def _unselected(self, state: dict) -> torch.Tensor:
        keep = torch.ones_like(state["column_steps"], dtype=torch.bool)
        keep[state["selected"]] = False
        return keep.nonzero().flatten()

    def _update_columns(self, group, state, columns, grad, lr=None) -> None:
        """AdamW on a subset of columns, written back into the full-size state."""
        master, exp_avg, exp_avg_sq = (
            as_matrix(state[k]) for k in ("master", "exp_avg", "exp_avg_sq")
        )
        state["column_steps"][columns] += 1
        sub = [t[:, columns] for t in (master, exp_avg, exp_avg_sq)]
        adamw_update(
            sub[0], grad, sub[1], sub[2], state["column_steps"][columns], **self._hyper(group, lr)
        )
        for full, part in zip((master, exp_avg, exp_avg_sq), sub, strict=True):
            full[:, columns] = part

    def _selective_step(self, group: dict, p: torch.Tensor, grad: torch.Tensor) -> None:
        state = self._state(p)
        g = as_matrix(grad)
        selected = state["selected"]
        unselected = self._unselected(state)
        state["accumulator"][:, unselected] += g[:, unselected]
        state["window_has_grad"] = True
        if selected.numel():
            self._update_columns(group, state, selected, g[:, selected])
            as_matrix(p)[:, selected] = as_matrix(state["master"])[:, selected].to(p.dtype)

    def _close_window(self) -> None:
        """The CPU update of the unselected columns on the window's mean gradient."""
        if self.window_steps == 0:
            return
        for group, p in self._params():
            state = self.state.get(p)
            if not state or not has_columns(p) or not state.pop("window_has_grad", False):
                continue
            self._apply_pending(p, state)
            unselected = self._unselected(state)
            mean = state["accumulator"][:, unselected] / self.window_steps
            lr = group["lr"]
            if self.update_interval == "auto":
                lr *= math.sqrt(self.window_steps)
            self._update_columns(group, state, unselected, mean, lr)
            state["accumulator"].zero_()
            values = as_matrix(state["master"])[:, unselected].clone()
            state["pending"] = (unselected, values)
            if not self.overlap_step:
                self._apply_pending(p, state)
        self.cpu_updates += 1
        self.window_steps = 0
        self._auto_energies = {}

    def _reselect_after_boundary(self, live) -> None:
        """A new selection from the boundary step's gradient. The closing window's update of
        the entering columns reaches the parameter now; the rest of it stays pending."""
        for _, p in live:
            if not has_columns(p):
                continue
            state = self._state(p)
            self._select(p, p.grad)
            if state.get("pending") is not None:
                columns, values = state["pending"]
                entering = torch.isin(columns, state["selected"])
                as_matrix(p)[:, columns[entering]] = values[:, entering].to(p.dtype)
                state["pending"] = (columns[~entering], values[:, ~entering])
        self.reselections += 1

    @staticmethod
    def _apply_pending(p: torch.Tensor, state: dict) -> None:
        if state.get("pending") is not None:
            columns, values = state["pending"]
            as_matrix(p)[:, columns] = values.to(p.dtype)
            state["pending"] = None

    @torch.no_grad()
    def flush(self) -> None:
        """Apply everything pending: the open window's update and any overlapped result."""
        if self.window_steps:
            self._close_window()
        for _, p in self._params():
            state = self.state.get(p)
            if state and has_columns(p):
                self._apply_pending(p, state)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip this step's gradients by their global norm (as torch.nn.utils.clip_grad_norm_)."""
        params = [p for _, p in self._params() if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def selected_columns(self, p: torch.Tensor) -> torch.Tensor:
        return self._state(p)["selected"]
