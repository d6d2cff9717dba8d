"""The optimizer graph: fp32 AdamW of the device-resident rows, compiled so Inductor fuses it.

Written with ``torch._foreach`` ops over all the step's tensors: eagerly, one call per op
instead of one per op and tensor (3x faster for a small GPT's ~50 tensors on CPU, same bits);
compiled, Inductor's horizontal fusion of the lists.

Rows are per-column state (``[k, out]``; a 1-D parameter is one row) and ``steps`` holds each
row's step count, so columns with different histories get their own bias correction. ``lr`` is
a 0-d tensor: as a Python float every new learning rate from a schedule would specialize the
graph and recompile it. So is ``coefficient`` (a clip factor, or a window's mean), or None for
a step whose gradients are used as they are (no clipping: most steps), which then makes no
scaled copy of them: outside the compiled loop, so that one graph serves both.

``written``: (destinations, sources) pairs, each updated master (a source: a member's rows,
where the lists hold packed blocks, ``zenflow.runtime.packed_rows``) copied into its
destination in the destination's dtype after the update: a 1-D parameter's view, or a 16-bit
weight's ``OwnedWeight.selected_copy()`` (its selected rows are columns of its row-major
parameter: ``zenflow.runtime.param_writes`` writes them from that copy after the step); an fp32
weight's rows are written from the master itself. The copy is one multi-tensor op outside the
compiled loop, whose inputs then share no memory.
"""

import functools
import math

import torch
from torch._dynamo.exc import FailOnRecompileLimitHit

from zenflow.notices import notice
from zenflow.runtime import side_by_side


class StepBuffers:
    """The device step's working memory for one list of row tensors, kept from step to step.

    Owns two fp32 buffers of one value per row, each row's AdamW constants (step sizes, bias
    corrections), and, for an element loop that runs eagerly (``scratch``), two fp32 buffers
    the size of the rows, where it forms its denominators and updates (a view per tensor). All
    are made once for a list of shapes and refilled by every step: new tensors every step would
    be several Python objects per tensor and step, enough to set off the garbage collector,
    whose full passes over a compiled model's objects take a fraction of a second (and on a GPU
    an allocation each). A compiled loop takes no scratch: Inductor keeps those values in
    registers, where scratch would cost it two more passes.

    The constants scale rows (``[rows, 1]`` against ``[rows, width]``), a broadcast that
    torch's multi-tensor kernels do not take: eagerly, ``_foreach_mul_`` of such lists falls
    back to one kernel per tensor (~290 for a 354M GPT, ~4 ms of host time per op on an H200's
    host). So with scratch the rows are laid out by width, tensors of one width side by side,
    and the constants are scaled in per width (``scaled_denoms``, ``scaled_updates``: one
    ``[rows, width]`` block per width, ``step_sizes`` and ``bias_corrections2_sqrt`` their
    ``[rows, 1]`` constants); without it they are per tensor, for Inductor to fuse."""

    def __init__(self, scratch: bool = True):
        self._scratch = scratch
        self._constants: torch.Tensor | None = None
        self._shapes: list[torch.Size] = []
        self._constant_order: list[int] = []  # tensor positions in the constants' row order
        self.step_sizes: list[torch.Tensor] = []
        self.bias_corrections2_sqrt: list[torch.Tensor] = []
        self.denoms: list[torch.Tensor] | None = None
        self.updates: list[torch.Tensor] | None = None
        self.scaled_denoms: list[torch.Tensor] | None = None
        self.scaled_updates: list[torch.Tensor] | None = None

    def advance(
        self,
        rows: list[torch.Tensor],
        steps: list[torch.Tensor],
        lr: torch.Tensor,
        beta1: float,
        beta2: float,
    ) -> None:
        """Fit the buffers to ``rows`` (the masters), advance every row's step count and set
        each row's step size ``lr / (1 - beta1**step)`` and ``sqrt(1 - beta2**step)``, fp32.

        Formed once per row in fp64 (a row's step count may be large), eagerly: inside a
        compiled graph Inductor fuses them into the element loop and computes two fp64 powers
        per element (a 1.9M-element step took 11 ms on the development CPU instead of 2.4 ms)."""
        torch._foreach_add_(steps, 1)
        if not self._fits(rows):
            self._fit([r.shape for r in rows], rows[0].device)
        step64 = torch.cat([steps[i] for i in self._constant_order]).to(torch.float64)
        self._constants[0, :, 0].copy_(lr / (1 - beta1**step64))
        self._constants[1, :, 0].copy_((1 - beta2**step64).sqrt())

    def _fits(self, rows: list[torch.Tensor]) -> bool:
        # Compared without a list of the rows' shapes: one object per tensor and step.
        return (
            len(rows) == len(self._shapes) > 0
            and rows[0].device == self._constants.device
            and all(r.shape == shape for r, shape in zip(rows, self._shapes, strict=True))
        )

    def _fit(self, shapes: list[torch.Size], device: torch.device) -> None:
        self._shapes = shapes
        if self._scratch:
            by_width = side_by_side.indices_by(math.prod(shape[1:]) for shape in shapes)
        else:
            by_width = {None: list(range(len(shapes)))}
        self._constant_order = [i for members in by_width.values() for i in members]
        ordered = [shapes[i] for i in self._constant_order]
        row_counts = [shape[0] for shape in ordered]
        self._constants = torch.empty(2, sum(row_counts), 1, device=device)
        if not self._scratch:
            self.step_sizes = list(self._constants[0].split(row_counts))
            self.bias_corrections2_sqrt = list(self._constants[1].split(row_counts))
            return
        # Per width: the constants of its rows, and a [rows, width] block of each scratch
        # buffer, its tensors' views side by side.
        width_rows = [sum(shapes[i][0] for i in members) for members in by_width.values()]
        self.step_sizes = list(self._constants[0].split(width_rows))
        self.bias_corrections2_sqrt = list(self._constants[1].split(width_rows))
        scratch = torch.empty(2, side_by_side.elements(ordered), device=device)
        self.denoms, self.updates = [None] * len(shapes), [None] * len(shapes)
        self.scaled_denoms, self.scaled_updates = [], []
        block_shapes = list(zip(width_rows, by_width, strict=True))
        for half, per_tensor, blocks in (
            (scratch[0], self.denoms, self.scaled_denoms),
            (scratch[1], self.updates, self.scaled_updates),
        ):
            for block, members in zip(
                side_by_side.views(half, block_shapes), by_width.values(), strict=True
            ):
                blocks.append(block)
                parts = block.split([shapes[i][0] for i in members])
                for i, part in zip(members, parts, strict=True):
                    per_tensor[i] = part.view(shapes[i])


def adamw_elements_(
    masters: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    grads: list[torch.Tensor],
    step_sizes: list[torch.Tensor],
    bias_corrections2_sqrt: list[torch.Tensor],
    denoms: list[torch.Tensor] | None,
    updates: list[torch.Tensor] | None,
    scaled_denoms: list[torch.Tensor] | None,
    scaled_updates: list[torch.Tensor] | None,
    decay: torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
) -> None:
    """The element loop of AdamW, given the rows' constants, scratch for the denominators and
    updates or None, and the blocks the constants scale (None: ``denoms`` and ``updates``
    themselves), as ``StepBuffers`` lays them out, and the 0-d fp32 ``decay``
    (``1 - lr * weight_decay``)."""
    torch._foreach_mul_(masters, decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    denoms = _copied(exp_avg_sqs, denoms)
    torch._foreach_sqrt_(denoms)
    torch._foreach_div_(denoms if scaled_denoms is None else scaled_denoms, bias_corrections2_sqrt)
    torch._foreach_add_(denoms, eps)
    updates = _copied(exp_avgs, updates)
    torch._foreach_mul_(updates if scaled_updates is None else scaled_updates, step_sizes)
    torch._foreach_div_(updates, denoms)
    torch._foreach_sub_(masters, updates)


def _copied(tensors: list[torch.Tensor], scratch: list[torch.Tensor] | None):
    """``tensors`` copied into ``scratch``, or into new tensors where there is none."""
    if scratch is None:
        return [t.clone() for t in tensors]
    torch._foreach_copy_(scratch, tensors)
    return scratch


def selective_adamw_(
    masters: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    grads: list[torch.Tensor],
    lr: torch.Tensor,
    coefficient: torch.Tensor | None,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    written: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
    buffers: StepBuffers | None = None,
    *,
    elements=adamw_elements_,
) -> None:
    """One AdamW step of every row; ``buffers``: the caller's working memory, kept from step
    to step (None: made for this call); ``elements`` runs the element loop (compiled or
    not)."""
    if coefficient is not None:
        grads = torch._foreach_mul(grads, coefficient.to(torch.float32))
    if buffers is None:
        buffers = StepBuffers()
    buffers.advance(masters, steps, lr, beta1, beta2)
    elements(
        masters,
        exp_avgs,
        exp_avg_sqs,
        grads,
        buffers.step_sizes,
        buffers.bias_corrections2_sqrt,
        buffers.denoms,
        buffers.updates,
        buffers.scaled_denoms,
        buffers.scaled_updates,
        (1 - lr * weight_decay).to(torch.float32),
        beta1,
        beta2,
        eps,
    )
    if written is not None and written[0]:
        torch._foreach_copy_(*written)


STEP_BACKENDS = ("auto", "inductor", "eager")


def step_backend_for(requested: str, device: torch.device) -> str:
    """The backend "auto" means for parameters on ``device``: "eager" on a GPU, where torch's
    ``_foreach`` ops are already multi-tensor kernels, and Inductor's compile of this step,
    about 0.4 s per tensor on the development CPU, was most of a 354M GPT's 122 s first step
    on an H200 (~290 tensors; AdamW's whole model compiled in 36 s) to save a dozen passes over
    the selected rows (~1 ms per step for that model, by arithmetic); "inductor" on the CPU,
    where its fused loop ran 2.5x faster than the eager ops (20 tensors)."""
    if requested not in STEP_BACKENDS:
        raise ValueError(f"step_backend must be one of {STEP_BACKENDS}, got {requested!r}")
    if requested != "auto":
        return requested
    return "eager" if device.type == "cuda" else "inductor"


@functools.cache
def compiled_selective_adamw(backend: str):
    """``selective_adamw_`` with its element loop compiled by ``backend`` ("inductor"), or as
    is for "eager".

    One compiled loop serves every optimizer of the process, a graph per set of tensor shapes
    (per param group and model): past Dynamo's recompile limit (8 by default; a sweep that
    builds many optimizers reaches it) a new set runs the same loop eagerly, with a notice,
    where ``fullgraph`` would otherwise fail the step."""
    if backend == "eager":
        return selective_adamw_
    compiled = torch.compile(adamw_elements_, backend=backend, fullgraph=True, dynamic=False)

    def elements(*args):
        try:
            return compiled(*args)
        except FailOnRecompileLimitHit:  # raised before the loop ran: nothing was updated
            notice(
                "the device step's compiled loop reached torch._dynamo's recompile limit; "
                "optimizers with new tensor shapes run it eagerly"
            )
            return adamw_elements_(*args)

    return functools.partial(selective_adamw_, elements=elements)
