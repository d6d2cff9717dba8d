"""Staging for device-side window sums (``accumulate_on_device``, one rank).

The unselected rows stay on the weight's device in fp32 (summed over micro-batches) and are
added into the window's sum there; only each window's sum crosses to the host. A sum over ranks
would need its own reduction, so this strategy takes one rank.
"""

import torch

from zenflow.runtime.staging.base import squared_norm_totals
from zenflow.runtime.staging.contributions import DeviceRows
from zenflow.runtime.staging.ordered import OrderedStaging


class DeviceSumStaging(OrderedStaging):
    """Owns the step's unselected rows on the device (fp32, host row order)."""

    # The rows stay on the device until the step: the step's norm is taken from them for every
    # weight at once (``norm_parts``), and the columns' scores only where a selection or the
    # "auto" rule asks for them, not for each weight in every backward.
    scores_at_staging = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._unselected: torch.Tensor | None = None

    def stage_parts(self, rows: torch.Tensor, first: bool) -> None:
        # Every row stays on the device here, so the first micro-batch's rows, in fp32, are
        # kept as they are (no copy for an fp32 model, one conversion for a 16-bit one), the
        # selected and the unselected ones as two views; later micro-batches add into them.
        k = self.layout.k
        if first:
            if rows.dtype != torch.float32:  # no call at all for fp32 rows: one per weight
                rows = rows.float()
            self._selected, self._unselected = rows[:k], rows[k:]
        else:
            self._selected.add_(rows[:k])
            self._unselected.add_(rows[k:])

    def host_rows(self) -> torch.Tensor:
        return self._unselected

    def norm_parts(self) -> list[torch.Tensor]:
        return [self._selected, self._unselected]

    def norm_sq(self) -> torch.Tensor:
        """From the rows (one multi-tensor norm), unless a selection took the scores already."""
        if self._scores_in_order is not None:
            return super().norm_sq()
        (total,) = squared_norm_totals(self.norm_parts())
        return total

    def staged_host_block(self) -> torch.Tensor:
        k_local = self.layout.k_local
        block = self._unselected.new_empty(self.layout.block_rows, self.out)
        block[k_local:] = self._unselected
        return block

    def keep_host_block(self, block: torch.Tensor, k_local: int) -> None:
        self._unselected = block[k_local:]

    def hand_over(self) -> DeviceRows:
        rows, self._unselected = self._unselected, None
        return DeviceRows(rows)

    def discard(self) -> None:
        self._unselected = None
        super().discard()
