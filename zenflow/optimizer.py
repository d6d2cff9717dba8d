"""``ZenFlowAdamW``: the optimizer a user creates next to ``torch.compile(model, backend="zenflow")``.

Per step (after ``full_warm_up_rounds``), for every weight: the ``k`` most important columns
take an fp32 AdamW step on the device; the other columns' gradients go to the host and are
summed; every ``update_interval`` steps (or when update_interval "auto" decides) the C++ CPU
AdamW updates those columns from the window's mean gradient, asynchronously with
``overlap_step``. 1-D parameters take a device AdamW step every step. The exact semantics:
docs/algorithm.md; the runtime that carries it out: ``zenflow.runtime.conductor``.

Gradients of weights arrive through the ops the backend compiles into the backward graph (then
``.grad`` is a ``zenflow.StagedGradient`` that stands for the staged rows: torch's
``clip_grad_norm_`` takes its norm and scales it), or through ``.grad`` on a model that is not
compiled. Either way they are staged and committed only after the overflow check and the clip
coefficient are known.
"""

import math
from collections.abc import Iterable

import torch

from zenflow.runtime import optimizer_state
from zenflow.runtime.comm import DataParallel
from zenflow.runtime.conductor import Conductor
from zenflow.runtime.nonfinite import NONFINITE_POLICIES, NonFiniteGradientError
from zenflow.runtime.reshard import reshard
from zenflow.settings import ZenFlowSettings, settings_from

__all__ = ["NonFiniteGradientError", "ZenFlowAdamW"]


class ZenFlowAdamW(torch.optim.Optimizer):
    """AdamW with ZenFlow's importance-aware split between device and host.

    Keyword arguments beyond AdamW's are ZenFlow's settings, the fields of
    ``zenflow.settings.ZenFlowSettings`` (DeepSpeed's ``zero_optimization.zenflow`` block, same
    names, defaults and validation, and zenflow's extensions), given one by one or as
    ``settings=`` (fields given beside it replace its own); an int ``select_interval`` means
    every that many steps. Then ``max_grad_norm`` (clip by global norm each step);
    ``step_backend``: "inductor" compiles the device update's element loop, "eager" runs it as
    ``torch._foreach`` ops, "auto" (default) picks eager for parameters on a GPU and Inductor
    on the CPU (see ``zenflow.runtime.selective_step.step_backend_for``; settable later, as
    ``opt.step_backend = "auto"``; reads back the backend it resolved to); ``nonfinite``: a
    step whose gradient norm is NaN or infinite raises ``NonFiniteGradientError`` ("raise",
    default) or is skipped ("skip", counted in ``stats()["skipped_steps"]``, see
    ``last_step_skipped``), as fp16 loss scaling needs; either way nothing is committed;
    ``zero_stage`` (1 or 2) and ``process_group`` under ``torch.distributed``.

    A failed CPU AdamW job or collective leaves host state undefined: the optimizer then refuses
    ``step()``, ``flush()`` and ``state_dict()`` (so that no checkpoint holds that state) until
    ``load_state_dict()`` restores a checkpoint.

    Holds the param groups (torch's); everything else is its runtime's
    (``zenflow.runtime.conductor.Conductor``).
    """

    # Its fp32 master weights are optimizer state: a checkpoint cannot resume without them.
    holds_master_weights = True

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        *,
        settings: ZenFlowSettings | None = None,
        max_grad_norm: float | None = None,
        step_backend: str = "auto",
        nonfinite: str = "raise",
        zero_stage: int = 2,
        process_group=None,
        **zenflow_settings,
    ):
        if not 0.0 <= lr:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm}")
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f'nonfinite must be "raise" or "skip", got {nonfinite!r}')
        settings = settings_from(settings, zenflow_settings, "ZenFlowAdamW")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        _check_one_device(self.param_groups)
        self._runtime = Conductor(
            self.param_groups,
            settings,
            max_grad_norm=max_grad_norm,
            step_backend=step_backend,
            nonfinite=nonfinite,
            comm=DataParallel(zero_stage, process_group),
        )

    @property
    def settings(self) -> ZenFlowSettings:
        """The ZenFlow settings in effect (validated, defaults filled in)."""
        return self._runtime.settings

    @property
    def max_grad_norm(self) -> float | None:
        return self._runtime.max_grad_norm

    @property
    def step_backend(self) -> str:
        """How the selected columns' AdamW update runs: "inductor" or "eager"."""
        return self._runtime.step_backend

    @step_backend.setter
    def step_backend(self, requested: str) -> None:
        self._runtime.step_backend = requested

    @property
    def failure(self) -> BaseException | None:
        """The error of a failed CPU job or collective that stopped the optimizer (None while
        it is usable)."""
        return self._runtime.failure

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last ``step()`` committed nothing (a non-finite gradient, "skip")."""
        return self._runtime.last_step_skipped

    # Gradients.

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip this step's gradients to ``max_norm`` by their global norm, as
        ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` does (through the
        owned weights' ``StagedGradient``); replaces ``max_grad_norm`` for this step. Returns
        the norm before clipping."""
        self._runtime.clip_next_step = max_norm
        return torch.tensor(math.sqrt(self._runtime.staged_norm_sq()))

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self._runtime.discard_staged()

    # The step.

    def check_usable(self) -> None:
        """Raise if an earlier failure left host state undefined (see the class docstring)."""
        self._runtime.check_usable()

    @torch.no_grad()
    def step(self, closure=None, *, grad_divisor: float = 1.0):
        """One optimizer step; returns the closure's loss.

        ``grad_divisor`` divides the gradients before clipping and the update (a loss scale).
        A step whose gradient is not finite commits nothing; with ``nonfinite="skip"`` it is
        counted in ``stats()["skipped_steps"]`` and reported by ``last_step_skipped``, with
        "raise" it raises ``NonFiniteGradientError``.
        """
        runtime = self._runtime
        runtime.check_usable()
        runtime.check_params_unchanged()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with runtime.failing_for_good(), runtime.timing_after_sync():
            runtime.step(grad_divisor)
        return loss

    @torch.no_grad()
    def flush(self) -> None:
        """Apply everything pending now: an overlapped CPU update, and the open window, whose
        update then runs early (the next window starts afresh). For evaluation at an exact
        point, export and the end of training."""
        self._runtime.check_usable()
        with self._runtime.failing_for_good():
            self._runtime.flush()

    # Checkpoints.

    def state_dict(self) -> dict:
        """Everything needed to resume exactly, taken between steps (tensors and plain values:
        it loads with ``torch.load(weights_only=True)``). An overlapped CPU update still
        running is waited for but not applied: its result reaches the parameters at the next
        window boundary, after a load as without one."""
        self._runtime.check_usable()
        with self._runtime.failing_for_good():
            return optimizer_state.state_dict(self._runtime)

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``'s result into an optimizer built over the same parameters
        (also after a failure: the loaded state replaces the undefined one)."""
        with self._runtime.failing_for_good():
            optimizer_state.load_state_dict(self._runtime, state)

    def load_resharded(self, states: list[dict]) -> None:
        """Restore a run saved at another world size: ``states`` are the state dicts of all its
        ranks, in rank order. This rank takes its block of every saved rank's host rows (see
        ``zenflow.runtime.reshard``); the run continues as at the saved world size, up to the
        order of floating-point sums."""
        comm = self._runtime.comm
        self.load_state_dict(reshard(states, comm.world_size, comm.rank, comm.block))

    # Numbers and values.

    def stats(self) -> dict:
        """Counters since the optimizer was created (restored with a checkpoint):

        steps (committed), selected_fraction (of the owned weights' elements, now), window_steps
        (steps in the open window), updates_in_flight (overlapped CPU updates not yet applied),
        host_columns (columns whose host state this rank holds), skipped_steps, reselections,
        cpu_updates, blocking_updates (CPU updates that the step(), flush() or state dict call
        which submitted them also waited for: warm-up steps, updates without overlap_step,
        flushes), device_syncs (the times the training thread waited for the device or read a
        value it computed: ``zenflow.runtime.host_sync``), d2h_bytes and h2d_bytes (staging,
        migration, write-backs), optimizer_wait_s (the training thread blocked on the CPU pool)
        and its share per phase, optimizer_wait_s_<phase> for ordinary, select (the first
        selection), window_close, select_boundary, warm_up, flush and state_dict; cpu_adam_s
        (the CPU AdamW updates' run time in the pool, overlapped or not), cpu_accumulate_s (the
        pool's run time adding steps into the windows' host-side sums), host_after_sync_s (the
        training thread's time in step() after each step's last synchronization with the device:
        on a GPU the device waits for the host about that long), hand_over_s (the training
        thread's time in the rewritten backward graphs' hand-overs of gradients to zenflow: what
        zenflow adds to a compiled backward's host time), accumulate_on_device (whether the
        windows' sums stay on the device), cpu_pool_threads and cpu_pool_cpus (the CPU pool's
        workers for overlapped updates and the logical CPUs they are pinned to, empty where they
        are not: ``bind_cores``).
        """
        return self._runtime.stats()

    def selected_columns(self, param: torch.Tensor) -> torch.Tensor:
        """The columns of ``param`` (an owned weight) updated on the device now, ascending."""
        for w in self._runtime.weights:
            if w.param is param:
                return w.layout.selected_columns()
        raise ValueError(f"the parameter of shape {list(param.shape)} is not an owned weight")

    def staged_host_rows(self) -> list[int]:
        """Per owned weight, the gradient rows this rank holds staged on the host now (between
        backward and step; 0 where none): under ZeRO-2 a rank's share of the reduced rows."""
        return [w.staging.host_row_count() for w in self._runtime.weights]

    def fp32_parameters(self) -> dict[torch.nn.Parameter, torch.Tensor]:
        """Every owned parameter's fp32 master value, shaped like the parameter, on the host.

        For export: with a 16-bit model these are the exact values the 16-bit weights were
        rounded from. Collective (each rank contributes the host rows it owns). Call
        ``flush()`` first, so that no update is pending or running.
        """
        runtime = self._runtime
        if runtime.updates.pending or runtime.window_steps:
            raise RuntimeError("fp32_parameters() with updates pending: call flush() first")
        values = {w.param: w.fp32_value() for w in runtime.weights}
        for v in runtime.vectors:
            values[v.param] = v.master.cpu().reshape(v.param.shape).clone()
        return values


def _check_one_device(param_groups: list[dict]) -> None:
    # The runtime (streams, host-device copies, the compiled backward) is built and tested for
    # one device; refuse a model spread over several rather than train it wrongly.
    devices = {}
    for group_index, group in enumerate(param_groups):
        for i, p in enumerate(group["params"]):
            if p.requires_grad:
                devices.setdefault(p.device, (group_index, i, tuple(p.shape)))
                if p.dim() >= 2 and not p.is_contiguous():
                    raise ValueError(
                        f"ZenFlowAdamW needs contiguous weights; got one of shape "
                        f"{tuple(p.shape)} with strides {p.stride()}: make it contiguous before "
                        "creating the optimizer"
                    )
    if len(devices) > 1:
        found = ", ".join(
            f"param {i} of group {g} (shape {list(shape)}) on {device}"
            for device, (g, i, shape) in devices.items()
        )
        raise ValueError(
            f"ZenFlowAdamW needs every trained parameter on one device; found {found}: move "
            "the model to one device (model.to(device)) before creating the optimizer"
        )
