"""The DeepSpeed-compatible engine: ``zenflow.initialize`` and the ``Engine`` it returns.

    engine, optimizer, loader, scheduler = zenflow.initialize(
        model=model, model_parameters=model.parameters(), config="ds_config.json")
    for batch in loader:
        loss = engine(batch)
        engine.backward(loss)
        engine.step()

The same call shape, return tuple, JSON config and step semantics as ``deepspeed.initialize``:
``backward`` scales the loss by 1 / gradient_accumulation_steps (and the fp16 loss scale);
``step`` counts micro-steps and runs the optimizer and the LR schedule only at the end of each
accumulation window.

Which optimizer the config asks for:

* a ``zero_optimization.zenflow`` block: ``ZenFlowAdamW`` with the block as its settings;
* no block, ``offload_optimizer.device`` "cpu" (ZeRO-Offload): ``ZenFlowAdamW`` with
  topk_ratio 0 and update_interval 1, which is exactly offloaded AdamW;
* no block, no offload, bf16 or fp16: ``ZenFlowAdamW`` with topk_ratio 1 (AdamW on the device
  with fp32 masters, the role of DeepSpeed's mixed-precision optimizers);
* otherwise ``zenflow.adamw.PlainAdamW``: torch's AdamW, the plain baseline.

Either way the engine talks to one interface (``step(grad_divisor=)``, ``last_step_skipped``,
``flush``, ``stats``, ``fp32_parameters``, ``check_usable``, ``load_resharded``), and the finite
check and clipping happen inside the optimizer's step, after the overflow check.

``ZenFlowAdamW``'s device step is built eager: a run that is not compiled pays no Inductor
compile time. ``engine.compile()`` switches it to Inductor when the model itself is compiled
with Inductor (``options={"inner": "eager"}`` keeps both eager).
"""

import datetime
import os
import random

import numpy as np
import torch
import torch.distributed as dist

# Imported before the engine creates a process group, never after: its functions' default
# argument ``group=group.WORLD`` is bound at import, and bound to a live group it keeps that
# group from ever being freed (torch.compile imports the module). destroy_process_group would
# then leave gloo's threads running into interpreter teardown, where they can abort the
# process (SIGABRT, "terminate called without an active exception") after training succeeded.
import torch.distributed.nn.functional  # noqa: F401

from zenflow.adamw import PlainAdamW
from zenflow.config import ZenFlowConfig, build_lr_scheduler, load_config
from zenflow.loss_scaler import LossScaler
from zenflow.notices import notice
from zenflow.optimizer import ZenFlowAdamW
from zenflow.runtime import checkpoint
from zenflow.runtime.nonfinite import NonFiniteGradientError
from zenflow.settings import ZenFlowSettings

# Set by torchrun and by the deepspeed launcher.
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")

# ZeRO-Offload without ZenFlow: nothing on the device, every column updated on the CPU every step.
_OFFLOAD_ONLY = ZenFlowSettings(topk_ratio=0.0, update_interval=1, select_interval=1)
# Mixed precision without offload: AdamW on the device with fp32 masters. Every column is
# selected at the first step and stays selected, so the selection is never recomputed (a
# reselection would only move state around).
_ON_DEVICE_ONLY = ZenFlowSettings(topk_ratio=1.0, update_interval=1, select_interval=2**62)

_CHECKPOINT_FORMAT = "zenflow.Engine/1"


def initialize(
    *,
    model: torch.nn.Module,
    model_parameters=None,
    config: dict | str | os.PathLike | None = None,
    training_data: torch.utils.data.Dataset | None = None,
    lr_scheduler=None,
    args=None,
    collate_fn=None,
):
    """Build the engine for ``model`` from a DeepSpeed config, like ``deepspeed.initialize``.

    ``config`` is a dict or the path of a JSON file; alternatively ``args.deepspeed_config``
    (as DeepSpeed's launcher scripts pass it). ``model_parameters`` is an iterable of parameters
    or of param-group dicts (default: all of the model's). ``lr_scheduler`` is a scheduler or a
    callable that builds one from the optimizer; it takes precedence over the config's. With
    ``training_data`` a DataLoader of micro-batches is built (``collate_fn`` passed through).

    Returns ``(engine, optimizer, dataloader, lr_scheduler)``; the last two may be None.
    Arguments are keyword-only: DeepSpeed's positional order differs from this one.
    """
    from_args = getattr(args, "deepspeed_config", None)
    if from_args is not None:
        if config is not None:
            raise ValueError(
                "two configs given: args.deepspeed_config and config=; pass only one of them"
            )
        config = from_args
    if config is None:
        raise ValueError("no config: pass config= (a dict or a JSON path) or args.deepspeed_config")
    world_size = _world_size()
    loaded = load_config(config, world_size=world_size)
    _init_distributed(loaded.process_group_timeout_s)
    engine = Engine(
        model,
        model_parameters,
        loaded,
        training_data=training_data,
        lr_scheduler=lr_scheduler,
        collate_fn=collate_fn,
    )
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _launched() -> bool:
    return all(name in os.environ for name in _LAUNCHER_ENV)


def _world_size() -> int:
    """The world size of the process group, or the one a launcher is about to set up."""
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ["WORLD_SIZE"]) if _launched() else 1


def _init_distributed(timeout_s: float) -> None:
    """Join the process group a launcher set up (gloo on CPU, nccl on CUDA), once. A collective
    that waits more than ``timeout_s`` for another rank fails instead of hanging."""
    if dist.is_initialized() or not _launched():
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl", timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Engine:
    """Wraps the model, its optimizer, LR schedule, loss scaler and data loader.

    The model is moved to ``device`` (this rank's GPU, else the CPU); inputs are the caller's
    to move, as with DeepSpeed.

    Counters (DeepSpeed's names): ``global_steps`` optimizer steps taken (skipped ones
    included, as in DeepSpeed), ``micro_steps`` calls of ``step()``, ``skipped_steps`` steps
    skipped for a non-finite gradient.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        model_parameters,
        config: ZenFlowConfig,
        *,
        training_data=None,
        lr_scheduler=None,
        collate_fn=None,
    ):
        self.device = _device()
        self.module = model.to(self.device)
        self.training_dataloader = None
        steps_per_epoch = None
        if training_data is not None:
            self.training_dataloader = _dataloader(
                training_data, config.micro_batch_size, collate_fn
            )
            steps_per_epoch = _steps_per_epoch(
                self.training_dataloader, config.gradient_accumulation_steps
            )
        self.config = config.with_steps_per_epoch(steps_per_epoch)
        params = model.parameters() if model_parameters is None else model_parameters
        # Built on the fp32 parameters: ZenFlowAdamW takes its fp32 masters from them.
        self.optimizer = _build_optimizer(self.config, params)
        self._owned_by_name = self._owned_parameters()
        self._cast_to_16_bit()
        if lr_scheduler is None:
            self.lr_scheduler = build_lr_scheduler(self.config, self.optimizer)
        elif callable(lr_scheduler):  # as DeepSpeed: a callable builds it from the optimizer
            self.lr_scheduler = lr_scheduler(self.optimizer)
        else:
            self.lr_scheduler = lr_scheduler
        self.loss_scaler = LossScaler.from_config(self.config.fp16)
        self._forward = self.module
        self.global_steps = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._backward_in_window = False

    def _owned_parameters(self) -> dict[str, torch.nn.Parameter]:
        """The module's parameters the optimizer trains, by name."""
        owned = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
        return {
            name: p
            for name, p in self.module.named_parameters(remove_duplicate=False)
            if id(p) in owned
        }

    def _check_model_unchanged(self) -> None:
        # A parameter replaced after initialize (module.weight = nn.Parameter(...), or
        # module.to() with overwrite_module_params_on_conversion) gets gradients the optimizer
        # never sees: it would silently train nothing.
        if self._owned_parameters().keys() != self._owned_by_name.keys():
            current = dict(self.module.named_parameters(remove_duplicate=False))
            for name in self._owned_by_name:
                if name not in current or id(current[name]) != id(self._owned_by_name[name]):
                    raise RuntimeError(
                        f"the model's parameter {name!r} was replaced (or removed) after "
                        "zenflow.initialize: the optimizer still holds the old one and would "
                        "not train the new one; change the model before zenflow.initialize, "
                        "or initialize again"
                    )

    def _cast_to_16_bit(self) -> None:
        if not self._mixed_precision():
            return
        if torch.__future__.get_overwrite_module_params_on_conversion():
            raise RuntimeError(
                "torch.__future__.set_overwrite_module_params_on_conversion(True) makes "
                "module.to() replace parameters, which would detach them from the optimizer; "
                "turn it off for bf16/fp16 training"
            )
        # In place: the Parameter objects the optimizer holds stay the model's.
        self.module.to(self._16_bit_dtype())

    def _mixed_precision(self) -> bool:
        return self.config.bf16.enabled or self.config.fp16.enabled

    def _16_bit_dtype(self) -> torch.dtype:
        return torch.float16 if self.config.fp16.enabled else torch.bfloat16

    # Training.

    def __call__(self, *args, **kwargs):
        return self._forward(*args, **kwargs)

    forward = __call__

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> torch.Tensor:
        """Backpropagate ``loss`` / gradient_accumulation_steps (times the fp16 loss scale).
        Returns the loss divided by gradient_accumulation_steps, as DeepSpeed does."""
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
            raise RuntimeError(
                "engine.backward(loss): the loss does not require grad (was it computed under "
                "torch.no_grad(), or detached?); pass the loss returned by the forward pass"
            )
        loss = loss.float() / self.gradient_accumulation_steps()
        (loss * self.loss_scaler.scale).backward(retain_graph=retain_graph)
        self._backward_in_window = True
        return loss

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next ``step()`` ends an accumulation window (runs the optimizer)."""
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def step(self) -> None:
        """End a micro-step; at the end of an accumulation window take an optimizer step.

        A NaN or infinite gradient skips the step (fp16, or nonfinite_gradients "skip") or
        raises ``zenflow.NonFiniteGradientError`` after dropping the window's gradients (catch
        it to go on with the next batch). After a ``CPUAdamError`` or ``CollectiveError`` the
        engine refuses to step or save until ``load_checkpoint``."""
        self.optimizer.check_usable()
        if not self._backward_in_window:
            raise RuntimeError(
                "engine.step() before any engine.backward() in this gradient accumulation "
                "window: call engine.backward(loss) first"
            )
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return
        self._check_model_unchanged()
        try:
            skipped = self._optimizer_step()
        except NonFiniteGradientError:
            self.zero_grad()  # the window's gradients are unusable; the next window starts clean
            raise
        self.loss_scaler.update(overflow=skipped)
        if skipped:
            self.skipped_steps += 1
        elif self.lr_scheduler is not None:
            self.lr_scheduler.step()  # as DeepSpeed: a skipped step does not advance the schedule
        self.zero_grad()
        self.global_steps += 1

    def _optimizer_step(self) -> bool:
        """Run the optimizer; returns whether the step was skipped (non-finite gradient and
        nonfinite_gradients "skip"), raises NonFiniteGradientError for "raise". Clipping
        (gradient_clipping) and unscaling happen inside, after the overflow check."""
        self.optimizer.step(grad_divisor=self.loss_scaler.scale)
        return self.optimizer.last_step_skipped

    def zero_grad(self) -> None:
        """Drop the gradients of the current accumulation window."""
        self.optimizer.zero_grad(set_to_none=True)
        self.module.zero_grad(set_to_none=True)
        self._backward_in_window = False

    def compile(self, backend: str = "zenflow", **kwargs) -> None:
        """``torch.compile`` the module (``kwargs`` go to torch.compile); calls of the engine go
        through the compiled module, ``engine.module`` stays the original."""
        self._forward = torch.compile(self.module, backend=backend, **kwargs)
        inner = (kwargs.get("options") or {}).get("inner", "inductor")
        uses_inductor = backend == "inductor" or (backend == "zenflow" and inner == "inductor")
        if uses_inductor:
            # The device update as step_backend "auto" runs it (Inductor on the CPU, torch's
            # multi-tensor kernels on a GPU); uncompiled engines keep it eager.
            self.optimizer.step_backend = "auto"

    def flush(self) -> None:
        """Apply every pending ZenFlow update (overlapped CPU update, open window)."""
        self.optimizer.flush()

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        return self.train(False)

    # Settings and numbers.

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def stats(self) -> dict:
        """The optimizer's stats and the engine's."""
        stats = self.optimizer.stats()
        stats.update(
            global_steps=self.global_steps,
            micro_steps=self.micro_steps,
            skipped_steps=self.skipped_steps,
            loss_scale=self.loss_scaler.scale,
        )
        return stats

    # Checkpoints (layout: zenflow.runtime.checkpoint).

    def save_checkpoint(
        self, save_dir, tag=None, client_state: dict | None = None, save_latest: bool = True
    ) -> bool:
        """Save everything needed to resume exactly; ``tag`` defaults to global_step<N>.

        Collective: every rank calls it. Only between accumulation windows (after the step()
        that ends one): accumulated gradients are not part of a checkpoint.
        """
        self.optimizer.check_usable()  # a failed run must not overwrite good checkpoints
        if self._backward_in_window or self.micro_steps % self.gradient_accumulation_steps():
            raise RuntimeError(
                "save_checkpoint() inside a gradient accumulation window: the gradients "
                "accumulated so far would be lost; save after the step() that ends the window"
            )
        state = {
            "format": _CHECKPOINT_FORMAT,
            "module": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "lr_scheduler": None if self.lr_scheduler is None else self.lr_scheduler.state_dict(),
            "loss_scaler": self.loss_scaler.state_dict(),
            "counters": {
                "global_steps": self.global_steps,
                "micro_steps": self.micro_steps,
                "skipped_steps": self.skipped_steps,
            },
            "rng": _rng_state(),
            "client_state": client_state or {},
        }
        tag = f"global_step{self.global_steps}" if tag is None else str(tag)
        checkpoint.save(save_dir, tag, state, _rank(), self.config.world_size, save_latest)
        return True

    def load_checkpoint(
        self,
        load_dir,
        tag=None,
        *,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        client_state_from_trusted_file: bool = False,
    ):
        """Resume from a committed checkpoint (``tag`` None: the one ``latest`` names).

        Returns ``(path of this rank's file, client_state)``, or ``(None, None)`` when there is
        no checkpoint to load.

        Files are read with ``torch.load(weights_only=True)``: tensors and plain values only,
        nothing that runs code. A ``client_state`` that held other objects (instances of your
        classes) needs ``client_state_from_trusted_file=True``, which unpickles the files as
        they are: only for checkpoints you trust, since a crafted file can then run code.
        """
        resolved = checkpoint.resolve_tag(load_dir, None if tag is None else str(tag))
        if resolved is None:
            notice(f"no checkpoint to load in {os.fspath(load_dir)} (tag {tag!r})")
            return None, None
        if not load_optimizer_states and self.optimizer.holds_master_weights:
            raise ValueError(
                "load_optimizer_states=False with ZenFlowAdamW: its fp32 master weights are "
                "optimizer state, so the model cannot resume without it; load them too"
            )
        saved_world_size = checkpoint.saved_world_size(load_dir, resolved)
        # Every rank saved the same module, scheduler and counters; the optimizer's host state is
        # each rank's own, and at another world size it is cut anew from all of them.
        mine = _rank() % saved_world_size
        reshard = saved_world_size != self.config.world_size and load_optimizer_states
        trusted = client_state_from_trusted_file
        if reshard:
            notice(
                f"resharding checkpoint {resolved!r}: saved by {saved_world_size} processes, "
                f"loaded by {self.config.world_size}"
            )
            # Mapped, not read: of every saved rank's file only this rank's columns are touched.
            saved = [
                _load_state(load_dir, resolved, r, trusted, mmap=True)
                for r in range(saved_world_size)
            ]
            path, state = saved[mine]
            optimizers = [rank_state["optimizer"] for _, rank_state in saved]
        else:
            path, state = _load_state(load_dir, resolved, mine, trusted)
        self.zero_grad()
        # The optimizer first: loading it applies this engine's own pending updates to the
        # parameters, which the module's saved values then replace.
        if reshard:
            self.optimizer.load_resharded(optimizers)
        elif load_optimizer_states:
            self.optimizer.load_state_dict(state["optimizer"])
        self.module.load_state_dict(state["module"])
        if load_lr_scheduler_states and self.lr_scheduler is not None:
            if state["lr_scheduler"] is None:
                raise RuntimeError(f"{path} holds no LR scheduler state for this run's scheduler")
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.loss_scaler.load_state_dict(state["loss_scaler"])
        counters = state["counters"]
        self.global_steps = counters["global_steps"]
        self.micro_steps = counters["micro_steps"]
        self.skipped_steps = counters["skipped_steps"]
        _set_rng_state(state["rng"])
        return path, state["client_state"]

    # Export.

    def save_16bit_model(self, save_dir, save_filename: str = "pytorch_model.bin") -> bool:
        """Write the module's state dict in 16 bits (fp16 when fp16 is on, else bf16), after
        applying pending updates. Rank 0 writes; returns True, as DeepSpeed."""
        self.flush()
        dtype = self._16_bit_dtype()
        state = {
            name: (value.to(dtype) if value.is_floating_point() else value).contiguous()
            for name, value in self.module.state_dict().items()
        }
        if _rank() == 0:
            os.makedirs(save_dir, exist_ok=True)
            path = os.path.join(save_dir, save_filename)
            checkpoint.write_atomically(path, lambda file: torch.save(state, file))
        return True

    def consolidated_fp32_state_dict(self) -> dict[str, torch.Tensor]:
        """The module's state dict with every parameter's fp32 value, after applying pending
        updates; loads into a plain fp32 copy of the model. Trained parameters come from the
        optimizer's fp32 masters (not from 16-bit weights); the rest are cast from the module."""
        self.flush()
        masters = self.optimizer.fp32_parameters()
        state = {
            name: value.float() if value.is_floating_point() else value
            for name, value in self.module.state_dict().items()
        }
        # remove_duplicate=False: a tied parameter appears under each of its names.
        for name, param in self.module.named_parameters(remove_duplicate=False):
            if param in masters:
                state[name] = masters[param]
        return {
            name: value.detach().cpu().clone(memory_format=torch.contiguous_format)
            for name, value in state.items()
        }


def _build_optimizer(config: ZenFlowConfig, params) -> ZenFlowAdamW | PlainAdamW:
    hyper = dict(lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay)
    common = dict(max_grad_norm=config.gradient_clipping or None, nonfinite=config.nonfinite)
    settings = config.zenflow
    if settings is None and config.cpu_offload:
        settings = _OFFLOAD_ONLY
    elif settings is None and (config.bf16.enabled or config.fp16.enabled):
        settings = _ON_DEVICE_ONLY  # 16-bit weights need fp32 masters, fp16 an overflow check
    if settings is None:
        return PlainAdamW(params, **hyper, **common, **config.adamw_kernel)
    return ZenFlowAdamW(
        params,
        **hyper,
        **common,
        settings=settings,
        step_backend="eager",
        # Stage 0 (mixed precision without offload) averages gradients over ranks as stage 1
        # does; partitioning the host state as well changes no value.
        zero_stage=max(config.zero_stage, 1),
    )


def _dataloader(dataset, micro_batch_size: int, collate_fn) -> torch.utils.data.DataLoader:
    """DeepSpeed's training loader: shuffled micro-batches, each rank its own share."""
    if dist.is_initialized():
        sampler = torch.utils.data.DistributedSampler(dataset)
    else:
        sampler = torch.utils.data.RandomSampler(dataset)
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=micro_batch_size,
        sampler=sampler,
        collate_fn=collate_fn,
        pin_memory=torch.cuda.is_available(),
    )


def _steps_per_epoch(loader: torch.utils.data.DataLoader, accumulation: int) -> int | None:
    """Optimizer steps per epoch, or None for a loader without a length (an iterable dataset)."""
    try:
        batches = len(loader)
    except TypeError:
        return None
    if batches < accumulation:
        raise ValueError(
            f"the training data gives {batches} micro-batches per epoch, fewer than "
            f"gradient_accumulation_steps {accumulation}: not one optimizer step per epoch; "
            "use more data or a smaller train_micro_batch_size_per_gpu"
        )
    return batches // accumulation


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _load_state(load_dir, tag: str, rank: int, trusted: bool, mmap: bool = False):
    path, state = checkpoint.load(load_dir, tag, rank, trusted=trusted, mmap=mmap)
    if not isinstance(state, dict) or state.get("format") != _CHECKPOINT_FORMAT:
        raise RuntimeError(f"{path} is not a {_CHECKPOINT_FORMAT} checkpoint")
    return path, state


def _rng_state() -> dict:
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    return {
        "python": random.getstate(),
        # As a tensor and plain values, not numpy's array: the file then loads with
        # torch.load(weights_only=True).
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "position": position,
            "has_gauss": has_gauss,
            "cached_gaussian": cached_gaussian,
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    if isinstance(numpy_state, dict):
        numpy_state = (
            numpy_state["kind"],
            numpy_state["keys"].numpy().astype(np.uint32),
            numpy_state["position"],
            numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    # Else numpy's own tuple: a checkpoint written before the state was stored as a tensor
    # (loaded with client_state_from_trusted_file=True).
    np.random.set_state(numpy_state)
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
