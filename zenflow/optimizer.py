"""``ZenFlowAdamW``: the optimizer a user creates next to ``torch.compile(model, backend="zenflow")``.

Per step (after ``full_warm_up_rounds``), for every weight: the ``k`` most important columns
take an fp32 AdamW step on the device (the compiled optimizer graph); the other columns'
gradients go to the host and are summed; every ``update_interval`` steps the C++ CPU AdamW
updates those columns from the window's mean gradient, asynchronously with ``overlap_step``.
1-D parameters take a device AdamW step every step. The exact schedule is ``zenflow.reference``'s
(with update_interval "auto", ``zenflow.runtime.auto_interval`` decides the windows and the size
of their steps).

Gradients of weights arrive through the ops the backend compiles into the backward graph (then
``.grad`` stays None), or through ``.grad`` on a model that is not compiled. Either way they are
staged and committed only after the overflow check and the clip coefficient are known.
"""

import contextlib
import functools
import math
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from zenflow.columns import column_count, has_columns, select_top_columns, topk_count
from zenflow.config import resolve_select_interval, zenflow_block
from zenflow.runtime import auto_interval, cpu_adam
from zenflow.runtime.comm import CollectiveError, DataParallel
from zenflow.runtime.reshard import reshard
from zenflow.runtime.selective_step import compiled_selective_adamw, step_backend_for
from zenflow.runtime.split_weight import SplitWeight

# Niceness of the CPU AdamW workers while an overlapped update runs beside training: they take
# the time the training thread leaves idle rather than competing with it for a core (its
# kernel launches on a GPU machine; its compute on a CPU-only one, where on 2 cores this moves
# the cost from the steps inside the window to the wait at its close: the mean step is the same).
BACKGROUND_NICE = 10
# Steps whose unselected rows may wait in the CPU pool's queue: each holds a staging block (a
# pinned copy of the weights' unselected gradient rows on a GPU machine), so one, not more.
ACCUMULATIONS_QUEUED = 1


def _traced(name: str):
    """Run the method inside a ``torch.profiler`` range ``name``: a trace of training shows
    where zenflow's step spends its time (about 5 us per call without a profiler)."""

    def wrap(method):
        @functools.wraps(method)
        def traced(*args, **kwargs):
            with torch.profiler.record_function(name):
                return method(*args, **kwargs)

        return traced

    return wrap


class NonFiniteGradientError(FloatingPointError):
    """A step's gradient norm is NaN or infinite (with ``nonfinite="raise"``)."""


@dataclass
class _Vector:
    """A 1-D parameter: fp32 state on its device, as one row with one step count."""

    param: torch.Tensor
    group_index: int
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    steps: torch.Tensor

    @classmethod
    def of(cls, param: torch.Tensor, group_index: int) -> "_Vector":
        master = param.detach().float().reshape(1, -1).clone()
        steps = torch.zeros(1, dtype=torch.int64, device=param.device)
        return cls(
            param, group_index, master, torch.zeros_like(master), torch.zeros_like(master), steps
        )


@dataclass
class _PendingUpdate:
    """A CPU update running in the background (overlap_step) until the next window closes."""

    handle: cpu_adam.CPUAdamHandle | None  # None: finished before a checkpoint was loaded
    weights: list[SplitWeight]
    accumulators: list[torch.Tensor]
    stage_blocks: list[torch.Tensor | None]  # buffers it reads its last gradient from
    # The updated rows in the parameters' 16-bit dtype, written by the job (None: fp32 weights,
    # or an update restored from a checkpoint, whose rows are converted when written back).
    rounded: list[torch.Tensor | None]


@dataclass
class _Accumulation:
    """A step's unselected rows being added into the windows' sums on the CPU pool."""

    handle: cpu_adam.CPUAdamHandle
    blocks: list[tuple[SplitWeight, torch.Tensor | None]]  # read by the job, given back after


class ZenFlowAdamW(torch.optim.Optimizer):
    """AdamW with ZenFlow's importance-aware split between device and host.

    Args beyond AdamW's are the fields of DeepSpeed's ``zero_optimization.zenflow`` block (same
    meaning and validation; an int ``select_interval`` means every that many steps) and
    zenflow's extensions of it (``accumulate_on_device``, ``min_update_interval``,
    ``max_update_interval``: see ``zenflow.config``), plus ``max_grad_norm`` (clip by global
    norm each step), ``step_backend``: "inductor" compiles the device update, "eager" runs it
    as plain PyTorch (``torch._foreach`` ops), "auto" (default) picks eager for parameters on a
    GPU and Inductor on the CPU (see ``zenflow.runtime.selective_step.step_backend_for``;
    settable later, as ``opt.step_backend = "auto"``; reads back the backend it resolved to),
    and ``nonfinite``: what a step whose gradient norm is NaN or infinite does. "raise"
    (default) raises ``NonFiniteGradientError``; "skip" skips it (counted in
    ``stats()["skipped_steps"]``, see ``last_step_skipped``), as fp16 loss scaling needs. Either
    way nothing is committed.

    A failed CPU AdamW job or collective leaves host state undefined: the optimizer then refuses
    ``step()``, ``flush()`` and ``state_dict()`` (so that no checkpoint holds that state) until
    ``load_state_dict()`` restores a checkpoint.
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
        update_interval: int | str = 4,
        select_interval: int | str = "auto",
        select_strategy: str = "auto",
        steps_per_epoch: int | None = None,
        overlap_step: bool = False,
        offload: bool = False,
        accumulate_on_device: bool = False,
        full_warm_up_rounds: int = 0,
        auto_ratio: float = 0.99,
        min_update_interval: int | None = None,
        max_update_interval: int = 16,
        pt_reserved_cores_perc: float = 0.5,
        max_grad_norm: float | None = None,
        step_backend: str = "auto",
        nonfinite: str = "raise",
        zero_stage: int = 2,
        process_group=None,
    ):
        if not 0.0 <= lr:
            raise ValueError(f"lr must be >= 0, got {lr}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        settings = zenflow_block(
            topk_ratio=topk_ratio,
            update_interval=update_interval,
            select_interval=select_interval,
            select_strategy=select_strategy,
            steps_per_epoch=steps_per_epoch,
            overlap_step=overlap_step,
            offload=offload,
            full_warm_up_rounds=full_warm_up_rounds,
            auto_ratio=float(auto_ratio),
            pt_reserved_cores_perc=float(pt_reserved_cores_perc),
        )
        self._auto = None
        self._scores: dict[SplitWeight, torch.Tensor] = {}
        if settings.update_interval == "auto":
            self._auto = auto_interval.AutoUpdateInterval(
                settings.auto_ratio,
                min_interval=min_update_interval,
                max_interval=max_update_interval,
            )
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm}")
        if nonfinite not in ("raise", "skip"):
            raise ValueError(f'nonfinite must be "raise" or "skip", got {nonfinite!r}')
        self.nonfinite = nonfinite
        self.accumulate_on_device = accumulate_on_device
        self.topk_ratio = settings.topk_ratio
        self.update_interval = settings.update_interval
        self.select_interval = resolve_select_interval(
            settings.select_strategy,
            settings.select_interval,
            settings.update_interval,
            settings.steps_per_epoch,
        )
        self.overlap_step = settings.overlap_step
        self.full_warm_up_rounds = settings.full_warm_up_rounds
        self.max_grad_norm = max_grad_norm
        self.step_backend = step_backend
        self.comm = DataParallel(zero_stage, process_group)
        self._cpu_threads = cpu_adam.threads_from_reserved_cores(settings.pt_reserved_cores_perc)
        cpu_adam.set_num_threads(self._cpu_threads)
        cpu_adam.set_worker_nice(BACKGROUND_NICE)

        self._check_one_device()
        self.weights: list[SplitWeight] = []
        self.vectors: list[_Vector] = []
        for group_index, group in enumerate(self.param_groups):
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                if has_columns(p):
                    self.weights.append(
                        self._split(p, group_index, self.comm, offload, accumulate_on_device)
                    )
                else:
                    self.vectors.append(_Vector.of(p, group_index))

        self.committed_steps = 0
        self.window_steps = 0
        self.last_step_skipped = False
        self._pending: list[_PendingUpdate] = []
        self._accumulating: list[_Accumulation] = []
        self.failure: BaseException | None = None  # set when host state became undefined
        self._clip_next_step: float | None = None
        self._norm_sq: float | None = None
        self._counters = dict(
            skipped_steps=0,
            reselections=0,
            cpu_updates=0,
            d2h_bytes=0,
            h2d_bytes=0,
            optimizer_wait_s=0.0,
            cpu_adam_s=0.0,
            cpu_accumulate_s=0.0,
        )

    def _device_of_params(self) -> torch.device:
        trained = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        return trained[0].device if trained else torch.device("cpu")

    def _check_one_device(self) -> None:
        # The runtime (streams, host-device copies, the compiled backward) is built and tested
        # for one device; refuse a model spread over several rather than train it wrongly.
        devices = {}
        for group_index, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                if p.requires_grad:
                    devices.setdefault(p.device, (group_index, i, tuple(p.shape)))
        if len(devices) > 1:
            found = ", ".join(
                f"param {i} of group {g} (shape {list(shape)}) on {device}"
                for device, (g, i, shape) in devices.items()
            )
            raise ValueError(
                f"ZenFlowAdamW needs every trained parameter on one device; found {found}: "
                "move the model to one device (model.to(device)) before creating the optimizer"
            )

    @staticmethod
    def _split(
        p: torch.Tensor, group_index: int, comm: DataParallel, offload: bool, on_device: bool
    ) -> SplitWeight:
        if not p.is_contiguous():
            raise ValueError(
                f"ZenFlowAdamW needs contiguous weights; got one of shape {tuple(p.shape)} "
                f"with strides {p.stride()}: make it contiguous before creating the optimizer"
            )
        return SplitWeight(p, group_index, comm, True, offload, on_device)

    @property
    def step_backend(self) -> str:
        """How the selected columns' AdamW update runs: "inductor" or "eager"."""
        return self._step_backend

    @step_backend.setter
    def step_backend(self, requested: str) -> None:
        self._step_backend = step_backend_for(requested, self._device_of_params())
        self._device_step = compiled_selective_adamw(self._step_backend)

    # Gradients.

    def _collect_eager_grads(self) -> None:
        for w in self.weights:
            if w.param.grad is not None:
                w.stage_grad(w.param.grad)
                w.param.grad = None

    @_traced("zenflow::gradient_norm")
    def _staged_norm_sq(self) -> float:
        """Squared global norm of this step's gradient (non-finite on overflow)."""
        if self._norm_sq is None:
            self._collect_eager_grads()
            # Summed where the parts are (each device's, then the host's): one transfer per
            # device and step, not one per weight.
            totals: dict[torch.device, torch.Tensor] = {}

            def add(part: torch.Tensor) -> None:
                totals[part.device] = part + totals[part.device] if part.device in totals else part

            self._scores = {}
            for w in self.weights:
                if w.has_staged:
                    w.reduce_staged()
                    add(w.staged_norm_sq())
            for v in self.vectors:
                if v.param.grad is not None:
                    self.comm.all_reduce_mean_(v.param.grad)
                    add(torch.linalg.vector_norm(v.param.grad, dtype=torch.float64) ** 2)
            self._norm_sq = sum(total.item() for total in totals.values())
        return self._norm_sq

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip this step's gradients to ``max_norm`` by their global norm, as
        ``torch.nn.utils.clip_grad_norm_`` would (which cannot: ``.grad`` of owned weights is
        None). Returns the norm before clipping."""
        self._clip_next_step = max_norm
        return torch.tensor(math.sqrt(self._staged_norm_sq()))

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for w in self.weights:
            w.discard_staged()
        self._norm_sq = None

    # The step.

    def check_usable(self) -> None:
        if self.failure is not None:
            raise RuntimeError(
                f"ZenFlowAdamW cannot continue: an earlier step failed ({self.failure}), which "
                "left its host state undefined; reload from a checkpoint (load_state_dict, or "
                "engine.load_checkpoint) before stepping, flushing or saving again"
            ) from self.failure

    def _check_params_unchanged(self) -> None:
        # A parameter resized or re-typed in place (p.data = ...) after the optimizer took its
        # state would otherwise be written with state of the old shape.
        for w in self.weights:
            if w.param.shape[0] != w.out or column_count(w.param.shape) != w.columns:
                raise RuntimeError(
                    f"a weight owned by ZenFlowAdamW changed shape to {list(w.param.shape)} "
                    f"after the optimizer was created (it had {w.out} rows and {w.columns} "
                    "columns); changing the model after creating the optimizer is not "
                    "supported: create the optimizer (and compile) after the last change"
                )
        for v in self.vectors:
            if v.param.numel() != v.master.numel():
                raise RuntimeError(
                    f"a parameter owned by ZenFlowAdamW changed shape to {list(v.param.shape)} "
                    f"after the optimizer was created (it had {v.master.numel()} elements); "
                    "create the optimizer after the last change to the model"
                )

    @torch.no_grad()
    def step(self, closure=None, *, grad_divisor: float = 1.0):
        """One optimizer step; returns the closure's loss.

        ``grad_divisor`` divides the gradients before clipping and the update (a loss scale).
        A step whose gradient is not finite commits nothing; with ``nonfinite="skip"`` it is
        counted in ``stats()["skipped_steps"]`` and reported by ``last_step_skipped``, with
        "raise" it raises ``NonFiniteGradientError``.
        """
        self.check_usable()
        self._check_params_unchanged()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            return self._step(loss, grad_divisor)
        except (cpu_adam.CPUAdamError, CollectiveError) as error:
            self.failure = error
            raise

    @_traced("zenflow::step")
    def _step(self, loss, grad_divisor: float):
        # Blocks of finished sums go back for the next backward; a pool lagging further behind
        # holds the training thread here rather than pin another block per weight and step.
        self._finish_accumulations(keep=ACCUMULATIONS_QUEUED)
        norm_sq = self._staged_norm_sq()
        max_norm = self._clip_next_step or self.max_grad_norm
        self._clip_next_step = None
        self._norm_sq = None
        weights = [w for w in self.weights if w.has_staged]
        vectors = [v for v in self.vectors if v.param.grad is not None]
        if not weights and not vectors:
            raise RuntimeError(
                "ZenFlowAdamW.step() without gradients: no parameter it owns got one since the "
                "last step; call loss.backward() before step() (if the model's parameters were "
                "replaced after the optimizer was created, create the optimizer again)"
            )
        self.last_step_skipped = not math.isfinite(norm_sq)
        if self.last_step_skipped:
            for w in weights:
                w.discard_staged()
            if self.nonfinite == "raise":
                raise NonFiniteGradientError(
                    f"the gradient norm of step {self.committed_steps + 1} is "
                    f"{math.sqrt(norm_sq)}: a NaN or infinite gradient; nothing was committed. "
                    'Find the cause, or skip such steps with nonfinite="skip" (engine config: '
                    '"nonfinite_gradients": "skip")'
                )
            self._counters["skipped_steps"] += 1
            return loss
        coefficient = 1.0 / grad_divisor
        if max_norm is not None:
            norm = math.sqrt(norm_sq) / grad_divisor
            coefficient *= min(1.0, max_norm / (norm + 1e-6))

        warm_up = self.committed_steps < self.full_warm_up_rounds
        s = self.committed_steps - self.full_warm_up_rounds
        # With topk_ratio 0 nothing is ever selected: the identity order stays.
        if not warm_up and s % self.select_interval == 0 and self.topk_ratio > 0:
            self._reselect(weights)
        select_boundary = (s + 1) % self.select_interval == 0
        self._device_commit(weights, vectors, coefficient)
        closes_window = False
        if warm_up:
            self._full_host_update(weights, coefficient)
        elif self._auto is None:
            closes_window = select_boundary or (s + 1) % self.update_interval == 0
            self._accumulate(weights, coefficient, fuse_last=closes_window)
        else:
            self._accumulate(weights, coefficient, fuse_last=False)
            closes_window = self._auto_window_full(weights, coefficient) or select_boundary
        for w in weights:
            self._counters["d2h_bytes"] += w.staged_bytes
            w.discard_staged()
        self.committed_steps += 1
        if not warm_up:
            self.window_steps += 1
            if closes_window:
                self._close_window(select_boundary)
        return loss

    def _auto_window_full(self, weights: list[SplitWeight], coefficient: float) -> bool:
        """update_interval "auto": this step's selected energy against the energy of the
        accumulated unselected sum (its squared norm, summed over ranks)."""
        # Summed in fp64 without an fp64 copy of the accumulator (the model's size, twice).
        accumulated = torch.tensor(
            [
                float(torch.linalg.vector_norm(w.accumulator, dtype=torch.float64)) ** 2
                for w in weights
            ],
            dtype=torch.float64,
        )
        self.comm.all_reduce_sum_(accumulated)
        energies = {}
        for w, piled in zip(weights, accumulated.tolist(), strict=True):
            scores = self._column_scores(w)
            selected = float(scores[w.order[: w.k].cpu()].sum()) * coefficient**2
            energies[self.weights.index(w)] = (selected, piled, w.k, w.columns)
        return self._auto.observe(energies)

    def _column_scores(self, w: SplitWeight) -> torch.Tensor:
        """This step's importance of each of ``w``'s columns (natural order), computed once and
        only when a reselection or the "auto" rule asks for it."""
        if w not in self._scores:
            self._scores[w] = w.column_scores()
        return self._scores[w]

    def _hyper(self, group_index: int) -> dict:
        group = self.param_groups[group_index]
        beta1, beta2 = group["betas"]
        return dict(
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
        )

    @_traced("zenflow::reselect")
    def _reselect(self, weights: list[SplitWeight]) -> None:
        for w in weights:
            k = topk_count(self.topk_ratio, w.columns)
            to_host, to_device = w.reselect(select_top_columns(self._column_scores(w), k))
            # Windows are flushed at select boundaries, so the sums are zero; this rank's share
            # of unselected columns may change size with the selection.
            rows = (w.hi - w.lo - w.k_local, w.out)
            if w.accumulator is not None and w.accumulator.shape != rows:
                w.accumulator = w.spare_accumulator = None
            self._counters["d2h_bytes"] += to_host
            self._counters["h2d_bytes"] += to_device
        self._counters["reselections"] += 1

    @_traced("zenflow::device_update")
    def _device_commit(self, weights, vectors, coefficient: float) -> None:
        """The selected rows and the 1-D parameters: one compiled AdamW call per param group
        and device (with ``offload`` the selected rows are updated on the host)."""
        calls = {}
        for w in weights:
            if w.k > 0:
                calls.setdefault((w.group_index, w.state_device), ([], []))[0].append(w)
        for v in vectors:
            calls.setdefault((v.group_index, v.param.device), ([], []))[1].append(v)
        for (group_index, device), (rows, vecs) in calls.items():
            hyper = self._hyper(group_index)
            self._device_step(
                [w.device_master for w in rows] + [v.master for v in vecs],
                [w.device_exp_avg for w in rows] + [v.exp_avg for v in vecs],
                [w.device_exp_avg_sq for w in rows] + [v.exp_avg_sq for v in vecs],
                [w.device_steps for w in rows] + [v.steps for v in vecs],
                [w.selected_rows() for w in rows]
                + [v.param.grad.float().reshape(1, -1) for v in vecs],
                torch.tensor(hyper["lr"], dtype=torch.float64, device=device),
                torch.tensor(coefficient, dtype=torch.float64, device=device),
                hyper["beta1"],
                hyper["beta2"],
                hyper["eps"],
                hyper["weight_decay"],
                [None] * len(rows) + [v.param.data.view(1, -1) for v in vecs],
            )
            with torch.profiler.record_function("zenflow::write_selected"):
                for w in rows:
                    self._counters["h2d_bytes"] += w.write_selected()

    @contextlib.contextmanager
    def _every_core(self):
        """For CPU updates the training thread waits for: the cores it keeps for itself
        (``pt_reserved_cores_perc``) would idle meanwhile, so the pool uses them too, at normal
        priority."""
        cpu_adam.set_num_threads(os.cpu_count() or 1)
        cpu_adam.set_worker_nice(0)
        try:
            yield
        finally:
            cpu_adam.set_num_threads(self._cpu_threads)
            cpu_adam.set_worker_nice(BACKGROUND_NICE)

    @_traced("zenflow::cpu_update")
    def _full_host_update(self, weights: list[SplitWeight], coefficient: float) -> None:
        """Warm-up: every column of every weight takes a CPU AdamW step now (k is 0)."""
        with self._every_core():
            for group_index, group_weights in self._by_group(weights):
                for w in group_weights:
                    w.host_steps += 1
                self._collect(
                    cpu_adam.submit_adamw_step(
                        [w.host_master for w in group_weights],
                        [w.unselected_rows() for w in group_weights],
                        [w.host_exp_avg for w in group_weights],
                        [w.host_exp_avg_sq for w in group_weights],
                        steps=[w.host_steps for w in group_weights],
                        segment_len=[w.out for w in group_weights],
                        grad_scale=coefficient,
                        **self._hyper(group_index),
                    ),
                    "cpu_adam_s",
                )
                with torch.profiler.record_function("zenflow::write_unselected"):
                    for w in group_weights:
                        self._counters["h2d_bytes"] += w.write_unselected()
        self._counters["cpu_updates"] += bool(weights)

    def _by_group(self, weights: list[SplitWeight]):
        for group_index in range(len(self.param_groups)):
            members = [w for w in weights if w.group_index == group_index]
            if members:
                yield group_index, members

    @_traced("zenflow::window_sums")
    def _accumulate(self, weights: list[SplitWeight], coefficient: float, fuse_last: bool) -> None:
        """Add this step's unselected rows to the window's sum. At a window's last step with no
        clipping the CPU update folds the addition into its own pass instead. Host-side sums
        are added by the CPU pool, behind the update still running there, while the training
        thread goes on ("auto" reads the sums' norms every step: it adds them itself)."""
        sums, rows, blocks = [], [], []
        for w in weights:
            if w.accumulator is None:
                w.accumulator = w.new_accumulator()
            w.in_window = True
            if fuse_last and coefficient == 1.0 and w.can_fold_last_grad:
                w.keep_stage_as_last_grad()
            elif self._auto is not None:
                w.add_unselected_to(w.accumulator, coefficient)
            elif w.defer_unselected(coefficient):
                pass
            elif w.sums_on_the_pool:
                unselected, block = w.hand_over_unselected()
                sums.append(w.accumulator)
                rows.append(unselected)
                blocks.append((w, block))
            else:
                w.add_unselected_to(w.accumulator, coefficient)
        if sums:
            handle = cpu_adam.submit_accumulate(sums, rows, scale=coefficient)
            self._accumulating.append(_Accumulation(handle, blocks))

    def _finish_accumulations(self, keep: int = 0) -> None:
        """Wait until at most ``keep`` accumulations are still queued (the oldest finish first)
        and give their blocks back; finished ones beyond that are collected without waiting."""
        while self._accumulating:
            oldest = self._accumulating[0]
            if len(self._accumulating) <= keep and not oldest.handle.done():
                return
            self._collect(oldest.handle, "cpu_accumulate_s")
            for w, block in oldest.blocks:
                if block is not None:
                    w.release_block(block)
            self._accumulating.pop(0)

    @_traced("zenflow::cpu_update")
    def _close_window(self, select_boundary: bool, force_sync: bool = False) -> None:
        """The CPU update of unselected columns from the window's mean gradient."""
        weights = [w for w in self.weights if w.in_window]
        background = self.overlap_step and not (select_boundary or force_sync)
        if not background:
            self._finish_accumulations()
        # A synchronous update writes its weights' columns to the parameters right after the
        # pending one would have: the pending result is not written for those.
        self._finish_pending(rewritten=() if background else weights)
        with contextlib.nullcontext() if background else self._every_core():
            self._submit_window(weights, background)
        self._counters["cpu_updates"] += bool(weights)
        for w in weights:
            w.in_window = False
            w.last_grad = w.last_grad_block = None
        self.window_steps = 0
        if self._auto is not None:
            self._auto.reset()

    def _submit_window(self, weights: list[SplitWeight], background: bool) -> None:
        for group_index, group_weights in self._by_group(weights):
            for w in group_weights:
                w.sum_deferred_into(w.accumulator)
                w.host_steps[w.k_local :] += 1
            state = dict(
                steps=[w.host_steps[w.k_local :] for w in group_weights],
                segment_len=[w.out for w in group_weights],
                **self._hyper(group_index),
            )
            if self._auto is not None:
                state["lr"] *= auto_interval.lr_scale(self.window_steps)
            masters = [w.host_master[w.k_local :] for w in group_weights]
            exp_avgs = [w.host_exp_avg[w.k_local :] for w in group_weights]
            exp_avg_sqs = [w.host_exp_avg_sq[w.k_local :] for w in group_weights]
            # A 16-bit model's new values are rounded by the job itself, in the same pass, so
            # that writing them back converts nothing on the training thread.
            rounded = [w.new_rounded_rows() for w in group_weights]
            state["out16"] = rounded
            if self.accumulate_on_device:
                sums = [w.ship_window_sum() for w in group_weights]
                self._counters["d2h_bytes"] += sum(t.numel() * t.element_size() for t in sums)
                handle = cpu_adam.submit_adamw_step(
                    masters,
                    sums,
                    exp_avgs,
                    exp_avg_sqs,
                    grad_scale=1.0 / self.window_steps,
                    **state,
                )
            else:
                handle = cpu_adam.submit_boundary_adamw_step(
                    masters,
                    [w.accumulator for w in group_weights],
                    [w.last_grad for w in group_weights],
                    exp_avgs,
                    exp_avg_sqs,
                    n=self.window_steps,
                    **state,
                )
            pending = _PendingUpdate(
                handle,
                group_weights,
                [w.accumulator for w in group_weights],
                [w.last_grad_block for w in group_weights],
                rounded,
            )
            if background:
                if not self.accumulate_on_device:
                    # The job reads (then zeroes) this window's sum while the next window
                    # fills the other buffer. (A device-side sum was shipped: nothing to swap.)
                    for w, used in zip(group_weights, pending.accumulators, strict=True):
                        w.accumulator = w.spare_accumulator
                        if w.accumulator is None:
                            w.accumulator = torch.zeros_like(used)
                        w.spare_accumulator = None
                self._pending.append(pending)
            else:
                self._apply(pending)

    @_traced("zenflow::write_back")
    def _apply(self, pending: _PendingUpdate, rewritten=()) -> None:
        """Wait for ``pending`` and write its result to the parameters, except for the weights
        in ``rewritten`` (a synchronous update is about to write them again)."""
        if pending.handle is not None:
            self._collect(pending.handle, "cpu_adam_s")
        skipped = {id(w) for w in rewritten}
        with torch.profiler.record_function("zenflow::write_unselected"):
            for w, used, block, rounded in zip(
                pending.weights,
                pending.accumulators,
                pending.stage_blocks,
                pending.rounded,
                strict=True,
            ):
                if used is not w.accumulator:
                    w.spare_accumulator = used
                if block is not None:
                    w.release_block(block)
                if id(w) not in skipped:
                    self._counters["h2d_bytes"] += w.write_unselected(rounded)

    def _finish_pending(self, rewritten=()) -> None:
        for pending in self._pending:
            self._apply(pending, rewritten)
        self._pending = []

    def _timed_wait(self, handle: cpu_adam.CPUAdamHandle) -> None:
        started = time.perf_counter()
        try:
            handle.wait()
        except cpu_adam.CPUAdamError as error:
            self.failure = error
            raise
        self._counters["optimizer_wait_s"] += time.perf_counter() - started

    def _collect(self, handle: cpu_adam.CPUAdamHandle, counter: str) -> None:
        """Wait for a job this optimizer is done with and count the time it ran in the pool,
        whether the training thread waited for it or not."""
        self._timed_wait(handle)
        self._counters[counter] += handle.seconds()

    @torch.no_grad()
    def flush(self) -> None:
        """Apply everything pending: an overlapped CPU update and the open window's sum."""
        self.check_usable()
        try:
            if self.window_steps:
                self._close_window(select_boundary=False, force_sync=True)
            self._finish_pending()
            self._finish_accumulations()
        except CollectiveError as error:
            self.failure = error
            raise

    # Checkpoints.

    _FORMAT = "zenflow.ZenFlowAdamW/2"
    _SETTINGS = ("topk_ratio", "update_interval", "select_interval", "overlap_step")

    def state_dict(self) -> dict:
        """Everything needed to resume exactly, taken between steps.

        An overlapped CPU update still running is waited for but not applied: its result reaches
        the parameters at the next window boundary, after a load as without one.
        """
        self.check_usable()
        if any(w.has_staged for w in self.weights):
            raise RuntimeError(
                "ZenFlowAdamW.state_dict() between backward() and step(): gradients are staged "
                "but not committed; save after step() (or zero_grad())"
            )
        self._finish_accumulations()
        for pending in self._pending:
            if pending.handle is not None:
                self._timed_wait(pending.handle)
        pending_weights = {id(w) for p in self._pending for w in p.weights}
        weights = [
            {
                "order": w.order.cpu(),
                "local_orders": w.local_orders,
                "k": w.k,
                "k_locals": w.k_locals,
                "host": [w.host_master, w.host_exp_avg, w.host_exp_avg_sq, w.host_steps],
                "device": [w.device_master, w.device_exp_avg, w.device_exp_avg_sq, w.device_steps],
                "accumulator": w.accumulator,
                "window_factors": list(w.window_factors),
                "in_window": w.in_window,
                "pending": id(w) in pending_weights,
            }
            for w in self.weights
        ]
        vectors = [[v.master, v.exp_avg, v.exp_avg_sq, v.steps] for v in self.vectors]
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        return {
            "format": self._FORMAT,
            "world_size": self.comm.world_size,
            "rank": self.comm.rank,
            "settings": {name: getattr(self, name) for name in self._SETTINGS},
            "param_groups": groups,
            "committed_steps": self.committed_steps,
            "window_steps": self.window_steps,
            "counters": dict(self._counters),
            "auto_interval": None if self._auto is None else self._auto.state_dict(),
            "weights": weights,
            "vectors": vectors,
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``'s result into an optimizer built over the same parameters."""
        if not isinstance(state, dict) or state.get("format") != self._FORMAT:
            raise ValueError(f"not a {self._FORMAT} state dict")
        mine = {name: getattr(self, name) for name in self._SETTINGS}
        if state["settings"] != mine:
            raise ValueError(f"state dict settings {state['settings']} differ from {mine}")
        saved_at = (state["world_size"], state["rank"])
        if saved_at != (self.comm.world_size, self.comm.rank):
            raise ValueError(
                f"state dict of rank {saved_at[1]} of {saved_at[0]} cannot load into rank "
                f"{self.comm.rank} of {self.comm.world_size}; at another world size pass every "
                "saved rank's state dict to load_resharded()"
            )
        shapes = [(w.hi - w.lo, w.out) for w in self.weights]
        saved = [tuple(s["host"][0].shape) for s in state["weights"]]
        if saved != shapes or len(state["vectors"]) != len(self.vectors):
            raise ValueError(
                f"state dict holds weights {saved} and {len(state['vectors'])} vectors; this "
                f"optimizer has {shapes} and {len(self.vectors)}"
            )
        if self.failure is None:
            self._finish_pending()
            self._finish_accumulations()
        else:
            # Their results are undefined and the loaded state replaces everything they touched;
            # jobs still running (other param groups') must not write into it.
            for pending in self._pending:
                if pending.handle is not None:
                    with contextlib.suppress(cpu_adam.CPUAdamError):
                        pending.handle.wait()
            for job in self._accumulating:
                with contextlib.suppress(cpu_adam.CPUAdamError):
                    job.handle.wait()
            self._pending = []
            self._accumulating = []
            self.failure = None
        for group, saved_group in zip(self.param_groups, state["param_groups"], strict=True):
            group.update(saved_group)
        self.committed_steps = state["committed_steps"]
        self.window_steps = state["window_steps"]
        self._counters.update(state["counters"])
        if self._auto is not None:
            self._auto.load_state_dict(state["auto_interval"])
        pending = []
        for w, saved in zip(self.weights, state["weights"], strict=True):
            w.load(
                saved["order"],
                saved["local_orders"],
                saved["k"],
                saved["k_locals"],
                saved["host"],
                saved["device"],
            )
            w.accumulator = None if saved["accumulator"] is None else saved["accumulator"].clone()
            w.window_factors = [(x.clone(), dy.clone()) for x, dy in saved["window_factors"]]
            w.spare_accumulator = None
            w.in_window = saved["in_window"]
            if saved["pending"]:
                pending.append(w)
        for v, (master, exp_avg, exp_avg_sq, steps) in zip(
            self.vectors, state["vectors"], strict=True
        ):
            for mine_t, saved_t in (
                (v.master, master),
                (v.exp_avg, exp_avg),
                (v.exp_avg_sq, exp_avg_sq),
                (v.steps, steps),
            ):
                mine_t.copy_(saved_t)
        for _, group_weights in self._by_group(pending):
            accumulators = [w.accumulator for w in group_weights]
            blocks = [None] * len(group_weights)
            rounded = [None] * len(group_weights)
            self._pending.append(_PendingUpdate(None, group_weights, accumulators, blocks, rounded))

    def load_resharded(self, states: list[dict]) -> None:
        """Restore a run saved at another world size: ``states`` are the state dicts of all its
        ranks, in rank order. This rank takes its block of every saved rank's host rows (see
        ``zenflow.runtime.reshard``); the run continues as at the saved world size, up to the
        order of floating-point sums."""
        self.load_state_dict(reshard(states, self.comm.world_size, self.comm.rank, self.comm.block))

    def stats(self) -> dict:
        """Counters since the optimizer was created (restored with a checkpoint):

        steps (committed), selected_fraction (of the owned weights' elements, now),
        skipped_steps, reselections, cpu_updates, d2h_bytes and h2d_bytes (staging, migration,
        write-backs), optimizer_wait_s (the training thread blocked on the CPU pool),
        cpu_adam_s (the CPU AdamW updates' run time in the pool, overlapped or not),
        cpu_accumulate_s (the pool's run time adding steps into the windows' host-side sums).
        """
        selected = sum(w.k * w.out for w in self.weights)
        total = sum(w.columns * w.out for w in self.weights)
        return dict(
            steps=self.committed_steps,
            selected_fraction=selected / total if total else 0.0,
            **self._counters,
        )

    def fp32_parameters(self) -> dict[torch.nn.Parameter, torch.Tensor]:
        """Every owned parameter's fp32 master value, shaped like the parameter, on the host.

        For export: with a 16-bit model these are the exact values the 16-bit weights were
        rounded from. Collective (each rank contributes the host rows it owns, as in
        ``write_unselected``). Call ``flush()`` first, so that no update is pending or running.
        """
        if self._pending or self.window_steps:
            raise RuntimeError("fp32_parameters() with updates pending: call flush() first")
        values = {}
        for w in self.weights:
            unselected = w.comm.all_gather_rows(w.host_master[w.k_local :], w.unselected_counts)
            rows = torch.cat([w.device_master.cpu(), unselected])  # in w.order
            in_natural_order = torch.empty_like(rows)
            in_natural_order[w.order.cpu()] = rows
            values[w.param] = in_natural_order.t().reshape(w.param.shape).contiguous()
        for v in self.vectors:
            values[v.param] = v.master.cpu().reshape(v.param.shape).clone()
        return values
