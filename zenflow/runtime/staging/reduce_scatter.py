"""Staging for ZeRO stage 2: the unselected rows are reduce-scattered as backward produces them.

Weight by weight, each micro-batch's unselected rows are averaged over ranks at once and only
this rank's chunk (its host rows' columns) goes on, to the host: no rank holds a whole weight's
gradient past its op. The selected rows are averaged over ranks in ``finish``.
"""

import torch

from zenflow.runtime.staging.ordered import StagedInHostBlock


class ReduceScatterStaging(StagedInHostBlock):
    """Its host block holds this rank's reduced unselected rows (fp32)."""

    def stage_unselected(self, unselected: torch.Tensor, first: bool) -> None:
        mine = self.comm.reduce_scatter_mean(
            unselected.to(torch.float32), self.layout.unselected_counts
        )
        if first:
            self._block = self.blocks.take(torch.float32)
            self.host_rows().copy_(mine)
        else:
            self.host_rows().add_(mine.to(self._block.device))
        self.staged_bytes += mine.numel() * mine.element_size()
