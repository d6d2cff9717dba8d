"""Staging for one process with the weight on a GPU and the window's sums on the host.

Each micro-batch's unselected rows start for the host at once, on the copy stream (into a
pinned host block), and overlap with the rest of the backward pass; a later micro-batch's are
added into the staged sum (fp32) once landed: at the next micro-batch, or at ``land()``. The
step queues its device update before it calls ``land()``, so the device does not idle through
the copies' tail. On the CPU the copy stream's twin is a worker thread, so this path runs, and
is tested, without a GPU.
"""

import torch

from zenflow.runtime.staging.ordered import StagedInHostBlock
from zenflow.runtime.streams import PendingCopy, copy_stream


class CopyStreamStaging(StagedInHostBlock):
    """Owns, beside its host block (the first micro-batch's dtype, fp32 once summed), the copy
    into it in flight, and a later micro-batch's copy with its own block."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._copy: PendingCopy | None = None
        self._part: tuple[PendingCopy, torch.Tensor] | None = None

    def stage_unselected(self, unselected: torch.Tensor, first: bool) -> None:
        self.send_to_host(unselected, first)

    def send_to_host(self, unselected: torch.Tensor, first: bool) -> None:
        """Start this rank's unselected rows (made for this alone: nothing writes them
        again) for the host block; a later micro-batch's are added to the earlier ones'."""
        if not first:
            self.land()
        block = self.blocks.take(unselected.dtype)
        copy = copy_stream(self.device).copy_to_host(
            unselected, out=block[self.layout.k_local :], owned=True
        )
        if first:
            self._block, self._copy = block, copy
        else:
            self._part = (copy, block)
        self.staged_bytes += unselected.numel() * unselected.element_size()

    def land(self) -> None:
        if self._copy is not None:
            self._copy.wait(self.sync)
            self._copy = None
        if self._part is not None:
            copy, block = self._part
            self._part = None
            k_local = self.layout.k_local
            if self._block.dtype != torch.float32:  # micro-batches sum in fp32
                widened = self.blocks.take(torch.float32)
                widened[k_local:] = self._block[k_local:]
                self.blocks.give(self._block)
                self._block = widened
            self._block[k_local:] += copy.wait(self.sync)
            self.blocks.give(block)
