"""Staging for ZeRO stage 2: the unselected rows are reduce-scattered as backward produces them.

Weight by weight, each micro-batch's unselected rows are averaged over ranks at once and only
this rank's chunk (its host rows' columns) goes on, to the host, on the copy stream as a single
process's rows do. The chunk's scores are taken on the device as it is formed (the first
micro-batch's: a later one's are added on the host), so that the step's norm, summed over ranks
with every weight's, waits for no copy. The selected rows are averaged over ranks in
``finish``.
"""

import torch

from zenflow.runtime.staging.base import squared_row_norms
from zenflow.runtime.staging.copy_stream import CopyStreamStaging


class ReduceScatterStaging(CopyStreamStaging):
    """Its host block holds this rank's reduced unselected rows (fp32)."""

    def stage_unselected(self, unselected: torch.Tensor, first: bool) -> None:
        mine = self.comm.reduce_scatter_mean(
            unselected.to(torch.float32), self.layout.unselected_counts
        )
        self._chunk_scores = squared_row_norms(mine) if first else None
        self.send_to_host(mine, first)
