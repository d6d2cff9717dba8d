"""Staging for ZeRO stage 1: the gradient waits on the device and is reduced in the step.

Micro-batches' unselected rows are summed on the device (fp32); ``finish`` averages the
selected rows over ranks and reduces the unselected ones into this rank's chunk (stage 1 keeps
no partition of gradients: an all-reduce, of which each rank keeps its chunk), which alone goes
to the host.
"""

import torch

from zenflow.runtime.staging.base import squared_row_norms
from zenflow.runtime.staging.ordered import sum_in_fp32
from zenflow.runtime.staging.reduce_scatter import ReduceScatterStaging


class ReduceAtStepStaging(ReduceScatterStaging):
    """Owns the device-side sum of the unselected rows until ``finish``, then this rank's
    reduced chunk as its host block (as ZeRO-2's)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._on_device: torch.Tensor | None = None

    def stage_unselected(self, unselected: torch.Tensor, first: bool) -> None:
        self._on_device = sum_in_fp32(self._on_device, unselected)

    def finish(self) -> None:
        super().finish()
        mine = self.comm.reduce_scatter_mean(self._on_device, self.layout.unselected_counts)
        self._on_device = None
        self._chunk_scores = squared_row_norms(mine)
        self.send_to_host(mine, first=True)

    def discard(self) -> None:
        self._on_device = None
        super().discard()
