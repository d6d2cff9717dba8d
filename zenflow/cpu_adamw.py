"""``zenflow.CPUAdamW``: AdamW over CPU fp32 tensors, computed by zenflow's C++ kernels.

The math and the state layout (``step``, ``exp_avg``, ``exp_avg_sq`` per parameter) are those of
``torch.optim.AdamW``, so state dicts move between the two. The update runs in C++ threads with
the GIL released; ``step_async()`` returns before it finishes.
"""

from __future__ import annotations

import torch

from zenflow.runtime import cpu_adam

__all__ = ["CPUAdamW", "CPUAdamWStepHandle"]


class CPUAdamWStepHandle:
    """An in-flight ``CPUAdamW.step_async()``: ``wait()`` blocks (GIL released) and raises
    ``CPUAdamError`` if a worker failed; ``done()`` polls."""

    def __init__(self, handles: list[cpu_adam.CPUAdamHandle]):
        self._handles = handles
        self.waited = False

    def done(self) -> bool:
        return all(h.done() for h in self._handles)

    def wait(self) -> None:
        self.waited = True
        errors = []
        for h in self._handles:  # wait for every group, even after one failed
            try:
                h.wait()
            except cpu_adam.CPUAdamError as e:
                errors.append(e)
        if errors:
            raise errors[0]


class CPUAdamW(torch.optim.Optimizer):
    """AdamW with decoupled weight decay and bias correction, as ``torch.optim.AdamW``.

    Parameters must be contiguous fp32 CPU tensors; gradients fp32. Each param group may set its
    own lr, betas, eps and weight_decay (read at every step, so LR schedulers work). ``threads``:
    how many of the process-wide pool's threads run its steps (default: every core of the
    process's affinity mask), at normal priority, as torch's and DeepSpeed's CPU optimizers use
    every core they may; each step sets the pool so (``zenflow.runtime.cpu_adam``).

    While a ``step_async()`` is in flight, parameters, gradients and state must not be modified:
    call its handle's ``wait()`` before the next ``step()`` or ``step_async()`` (which raise
    otherwise: a forward or backward pass in between would have raced with the update).
    ``state_dict()``, ``load_state_dict()`` and ``zero_grad(set_to_none=False)`` wait for it.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        *,
        threads: int | None = None,
    ):
        if threads is not None and threads < 1:
            raise ValueError(f"Invalid thread count: {threads}")
        self.threads = cpu_adam.available_cores() if threads is None else threads
        if not 0.0 <= float(lr):
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        for i, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {beta}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        self._pending: CPUAdamWStepHandle | None = None
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group_index = len(self.param_groups) - 1
        for i, p in enumerate(self.param_groups[-1]["params"]):
            where = f"CPUAdamW: param {i} of param group {group_index}"
            if p.device.type != "cpu":
                raise ValueError(f"{where} is on {p.device}; CPUAdamW updates CPU tensors")
            if p.dtype != torch.float32:
                raise TypeError(f"{where} has dtype {p.dtype}; CPUAdamW needs fp32 parameters")
            if not p.is_contiguous():
                raise ValueError(f"{where} is not contiguous; CPUAdamW needs contiguous tensors")

    def _finish_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None and not pending.waited:
            pending.wait()

    def _check_not_in_flight(self, call: str) -> None:
        if self._pending is not None and not self._pending.waited:
            raise RuntimeError(
                f"CPUAdamW.{call} while the previous step_async() is in flight: call wait() on "
                "its handle first (parameters and gradients must stay untouched until the "
                "update has finished)"
            )

    @torch.no_grad()
    def step(self, closure=None):
        self._check_not_in_flight("step()")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.step_async().wait()
        return loss

    @torch.no_grad()
    def step_async(self) -> CPUAdamWStepHandle:
        """Submits the update of every parameter with a gradient and returns at once; call the
        handle's ``wait()`` before touching parameters or gradients, and before the next step."""
        self._check_not_in_flight("step_async()")
        self._pending = None  # waited for: its failure, if any, was raised there
        cpu_adam.set_num_threads(self.threads)  # each a no-op when already so
        cpu_adam.set_worker_nice(0)
        cpu_adam.set_worker_cpus(None)
        jobs = []
        for group_index, group in enumerate(self.param_groups):
            job = self._group_job(group, group_index)
            if job is not None:
                jobs.append(job)
        handles = []
        try:
            for args, kwargs, step_tensors in jobs:
                handles.append(cpu_adam.submit_adamw_step(*args, **kwargs))
                # A step counts once its update is queued (the job has its own copy of the
                # counts), so a group the binding rejects keeps its state as it was.
                for t in step_tensors:
                    t += 1
        except BaseException:
            CPUAdamWStepHandle(handles).wait()
            raise
        self._pending = CPUAdamWStepHandle(handles)
        return self._pending

    def _group_job(self, group: dict, group_index: int):
        for option in ("amsgrad", "maximize"):  # present in state dicts from torch's AdamW
            if group.get(option):
                raise ValueError(f"CPUAdamW does not implement {option}=True")
        params, grads, exp_avgs, exp_avg_sqs, steps, step_tensors = [], [], [], [], [], []
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            where = f"CPUAdamW: the gradient of param {i} of param group {group_index}"
            if p.grad.is_sparse:
                raise TypeError(f"{where} is sparse; CPUAdamW needs dense gradients")
            if not p.grad.is_contiguous():
                raise ValueError(f"{where} is not contiguous; CPUAdamW needs contiguous tensors")
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(int(state["step"].item()) + 1)
            step_tensors.append(state["step"])
        if not params:
            return None
        beta1, beta2 = group["betas"]
        kwargs = dict(
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            steps=steps,
        )
        return (params, grads, exp_avgs, exp_avg_sqs), kwargs, step_tensors

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not set_to_none:  # zeroing in place would race with a running update
            self._finish_pending()
        super().zero_grad(set_to_none)

    def state_dict(self):
        self._finish_pending()
        return super().state_dict()

    def load_state_dict(self, state_dict) -> None:
        self._finish_pending()
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].contiguous()
