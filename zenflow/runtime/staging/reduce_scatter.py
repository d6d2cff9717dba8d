"""Staging for ZeRO stage 2: the unselected rows are reduce-scattered as backward produces them.

Weight by weight, each micro-batch's unselected rows are averaged over ranks at once and only
this rank's chunk (its host rows' columns) goes on, to the host: no rank holds a whole weight's
gradient past its op. The selected rows are averaged over ranks in ``finish``.
"""

import torch

from zenflow.runtime.staging.contributions import HostRows
from zenflow.runtime.staging.ordered import OrderedStaging


class ReduceScatterStaging(OrderedStaging):
    """Owns this rank's reduced unselected rows: a host block (fp32, local order)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._block: torch.Tensor | None = None

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

    def host_row_count(self) -> int:
        return 0 if self._block is None else self.layout.host_columns.numel()

    def host_rows(self) -> torch.Tensor:
        return self._block[self.layout.k_local :]

    def staged_host_block(self) -> torch.Tensor:
        return self._block

    def keep_host_block(self, block: torch.Tensor, k_local: int) -> None:
        self._block = block

    def hand_over(self) -> HostRows:
        block, self._block = self._block, None
        return HostRows(block[self.layout.k_local :], lambda: self.blocks.give(block))

    def discard(self) -> None:
        if self._block is not None:
            self.blocks.give(self._block)
            self._block = None
        super().discard()
