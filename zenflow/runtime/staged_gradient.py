"""``StagedGradient``: what ``.grad`` of an owned weight holds while the runtime stages it.

The backend never materializes an owned weight's full gradient: its rows go straight from the
backward to their staging (``zenflow.runtime.staging``). Code written for ordinary optimizers
still reads ``.grad``: ``torch.nn.utils.clip_grad_norm_`` (Hugging Face Trainer and Accelerate
clip through it), ``if p.grad is not None``, ``model.zero_grad()``. This tensor subclass
answers them without storage of its own: it has the weight's shape, dtype and device, takes
its norm from the staged rows, and records a multiplication by a number (the clip
coefficient) as a scale that the step applies to the staged rows. Anything else is refused
with an error that says so, rather than computed on rows that are not there.

``clip_grad_norm_`` uses ``torch._foreach_*`` only for plain tensors; with a subclass among the
gradients it calls ``torch.linalg.vector_norm`` and ``mul_`` per tensor. Both paths are served.
"""

import torch

from zenflow.runtime.streams import sent_to

aten = torch.ops.aten


class StagedGradient(torch.Tensor):
    """The ``.grad`` of one owned weight for one step.

    Owns the scale applied to it since it was staged (``scale``: None, or a 0-d tensor on its
    device). Its ``owner`` (the weight, ``zenflow.runtime.owned_weight.OwnedWeight``) owns the
    staged rows: ``gradient_norm_sq()`` gives their squared norm over every rank, before the
    scale, and ``discard_gradient()`` drops them.
    """

    @staticmethod
    def __new__(cls, owner, param: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, param.shape, dtype=param.dtype, device=param.device, requires_grad=False
        )

    def __init__(self, owner, param: torch.Tensor):
        self.owner = owner
        self.scale: torch.Tensor | None = None

    # Only aten operations reach this class, each through __torch_dispatch__.
    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        scale = ""
        if self.scale is not None:
            scale = f", scaled by {self.owner.sync.values([self.scale])[0]:.6g}"
        return (
            f"StagedGradient(shape={list(self.shape)}, dtype={self.dtype}, "
            f"device={self.device}{scale}: staged by zenflow, see ZenFlowAdamW)"
        )

    def norm(self) -> torch.Tensor:
        """The 2-norm of the gradient as scaled, 0-d in this tensor's dtype, like torch's."""
        norm = sent_to(self.owner.gradient_norm_sq(), self.device).sqrt()
        if self.scale is not None:
            norm = norm * self.scale.abs()
        return norm.to(self.dtype)

    def multiply(self, factor) -> "StagedGradient":
        if isinstance(factor, torch.Tensor):
            if factor.numel() != 1:
                raise _refused(f"mul_ by a tensor of shape {list(factor.shape)}")
            factor = factor.reshape(()).to(self.device, torch.float64)
        else:
            # Filled on the device: a number copied there would wait for its queue.
            factor = torch.full((), factor, dtype=torch.float64, device=self.device)
        self.scale = factor if self.scale is None else self.scale * factor
        return self

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.linalg_vector_norm.default:
            return _norm(*args, **kwargs)
        if func in (aten.mul_.Tensor, aten.mul_.Scalar):
            return _staged(args[0], func).multiply(args[1])
        if func in (aten.div_.Tensor, aten.div_.Scalar):
            divisor = args[1]
            reciprocal = (
                1.0 / divisor if not isinstance(divisor, torch.Tensor) else divisor.reciprocal()
            )
            return _staged(args[0], func).multiply(reciprocal)
        if func is aten.zero_.default:
            # A zeroed gradient is no gradient: the weight then steps as one without .grad.
            staged = _staged(args[0], func)
            staged.owner.discard_gradient()
            return staged
        if func is aten.detach_.default:
            return _staged(args[0], func)
        if func is aten._foreach_norm.Scalar:
            order = args[1] if len(args) > 1 else kwargs.get("ord", 2)
            return [_norm(t, order) for t in args[0]]
        if func in (aten._foreach_mul_.Tensor, aten._foreach_mul_.Scalar):
            for t in args[0]:
                t.mul_(args[1])
            return None
        if func in (aten._foreach_mul_.List, aten._foreach_mul_.ScalarList):
            for t, factor in zip(args[0], args[1], strict=True):
                t.mul_(factor)
            return None
        if func is aten.add_.Tensor:
            raise RuntimeError(
                "an ordinary gradient reached a weight whose gradient zenflow's compiled "
                "backward stages (its .grad is a StagedGradient): run every backward of a step "
                "through the compiled model, or none (an eager model's .grad is ordinary)"
            )
        if func is aten._amp_foreach_non_finite_check_and_unscale_.default:
            raise _refused(
                "GradScaler.unscale_ (a torch.amp.GradScaler)",
                "for fp16 loss scaling use zenflow.initialize, whose engine scales the loss and "
                "unscales inside ZenFlowAdamW.step(grad_divisor=...)",
            )
        raise _refused(str(func), _several_processes_hint())


def _staged(t, func) -> StagedGradient:
    if not isinstance(t, StagedGradient):
        raise _refused(
            f"{func} with a StagedGradient as an argument other than the first",
            _several_processes_hint(),
        )
    return t


def _several_processes_hint() -> str:
    """Under several processes, what most often reaches a staged gradient is a
    DistributedDataParallel wrapper's reducer, which copies every ``.grad`` into its buckets."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return ""
    return (
        "with several processes this is usually a DistributedDataParallel wrapper (Trainer and "
        "Accelerate wrap the model in one when launched on several processes) reducing .grad "
        "itself: ZenFlowAdamW reduces the gradients it stages over ranks itself, so leave the "
        "model unwrapped, or train data-parallel through zenflow.initialize"
    )


def _norm(t: torch.Tensor, ord=2, dim=None, keepdim=False, *, dtype=None) -> torch.Tensor:
    if not isinstance(t, StagedGradient):
        return torch.linalg.vector_norm(t, ord, dim, keepdim, dtype=dtype)
    if ord != 2 or dim is not None:
        raise _refused(
            f"a norm of order {ord} over dims {dim}",
            "clip_grad_norm_ with norm_type=2 (the default) is supported",
        )
    norm = t.norm()
    return norm if dtype is None else norm.to(dtype)


def _refused(what: str, hint: str = "") -> RuntimeError:
    return RuntimeError(
        f"{what} on the .grad of a weight owned by ZenFlowAdamW: its gradient is staged by "
        "zenflow, not stored in .grad, which supports the 2-norm "
        "(torch.nn.utils.clip_grad_norm_), mul_/div_ by a number, zero_() and detach_()"
        + (f"; {hint}" if hint else "")
    )
