"""The device update's AdamW rows packed by width: a few tensors for the multi-tensor ops.

The device update steps every selected row of a param group's owned weights and every 1-D
parameter, each a tensor of its own state (master, moments, step counts). torch's
multi-tensor (``_foreach``) ops cost host time per tensor and op, before and apart from any
kernel: on the CPU each tensor is a loop of its own, on a GPU each is checked and listed for
the kernels. A 354M GPT has ~290 such tensors, and an AdamW step a dozen ops over them. So
the rows of one kind (the owned weights' selected rows, or the 1-D parameters) are kept as
rows of one block per row width, each member's state a view of its rows there: the ops then
run over as many tensors as there are widths (a handful), with the same numbers element by
element.

A member whose state is replaced (a first selection, a change in its number of selected
columns, a loaded checkpoint) or a step without one of the members (a parameter that got no
gradient) asks for a new packing, which copies the members' state into new blocks: correct
whenever it happens, and made again only when the members change.
"""

import torch

from zenflow.runtime.side_by_side import indices_by


class PackedRows:
    """Owns, per row width of its members, blocks of fp32 masters, first and second moments
    and gradients (``[rows, width]``) and of int64 step counts (``[rows]``), and binds its
    members' device rows to views of them (the members: objects with ``device_rows()``,
    ``bind_device_rows()`` and ``gradient_shape()``, in the order given: a weight's
    ``ColumnState`` or a ``VectorState``). The gradients' blocks are scratch the caller's
    gradients are copied into for each update."""

    def __init__(self, members: list):
        rows = [m.device_rows() for m in members]  # master, exp_avg, exp_avg_sq, steps
        self.masters, self.exp_avgs, self.exp_avg_sqs, self.steps = [], [], [], []
        self.gradients = []
        blocks_by_kind = (self.masters, self.exp_avgs, self.exp_avg_sqs, self.steps, self.gradients)
        views = [None] * len(rows)  # per member: its rows in each kind's block
        for members_here in indices_by(r[0].shape[1] for r in rows).values():
            counts = [rows[i][0].shape[0] for i in members_here]
            first = rows[members_here[0]]
            # The gradients' block is shaped like the masters'.
            blocks = [t.new_empty(sum(counts), *t.shape[1:]) for t in (*first, first[0])]
            for kind_blocks, block in zip(blocks_by_kind, blocks, strict=True):
                kind_blocks.append(block)
            for i, *parts in zip(members_here, *(b.split(counts) for b in blocks), strict=True):
                views[i] = parts
        # One multi-tensor copy per kind of state into the blocks, then each member takes its
        # views (holding the same values) as its rows.
        for kind in range(4):
            torch._foreach_copy_([v[kind] for v in views], [r[kind] for r in rows])
        for member, member_views in zip(members, views, strict=True):
            member.bind_device_rows(member_views[:4])
        self._bound = [v[0] for v in views]
        # Shaped like the gradients the members take, for the copy's multi-tensor kernel.
        self._gradient_views = [
            v[4].view(m.gradient_shape()) for m, v in zip(members, views, strict=True)
        ]

    def holds(self, members: list) -> bool:
        """Exactly ``members``, in this order, each still bound to its views here (a view is
        bound to one member only, so that tells the members too)."""
        return len(members) == len(self._bound) and all(
            m.device_rows()[0] is view for m, view in zip(members, self._bound, strict=True)
        )

    def gradients_of(self, gradients: list[torch.Tensor]) -> list[torch.Tensor]:
        """The gradient blocks holding ``gradients`` (one per member, of its
        ``gradient_shape()``, any floating dtype: converted to fp32 as copied), in one
        multi-tensor copy."""
        torch._foreach_copy_(self._gradient_views, gradients)
        return self.gradients


def packed(cache: dict, key, members: list) -> PackedRows:
    """``cache[key]`` if it holds ``members``, else a new packing of them kept there."""
    found = cache.get(key)
    if found is None or not found.holds(members):
        found = cache[key] = PackedRows(members)
    return found
