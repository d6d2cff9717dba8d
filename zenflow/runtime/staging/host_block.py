"""Staging for one process with the weight on the CPU and the window's sums on the host.

The device is the host, so the host block is where the gradient is formed: each micro-batch's
rows go straight into a block in natural column order (``[columns, out]``, the gradient
transposed; later micro-batches are added into it in fp32) and stay there. The step takes the
selected rows, the scores and the norm from the block as it is, and the CPU pool reads the
unselected rows in place (``GatheredRows``), so nothing is ever reordered, and a reselection in
the middle of a step moves no staged row: they are all in their natural places.

A batch much smaller than the weight (``factors_pay``) is kept as its matmul's two factors
instead, ``G.T == x.T @ dy``: then the selected rows are a product formed in the step, after
its checks, the window's sum one product formed when the window closes, and the scores and the
norm come from batch-by-batch matrices (``s_j = x_j.T (dy dy.T) x_j``, ``||x.T dy||^2 ==
sum((x x.T) * (dy dy.T))``). Micro-batches concatenate along the batch.
"""

import torch

from zenflow.runtime.cpu_adam import GatheredRows
from zenflow.runtime.gradient_rows import factors_pay
from zenflow.runtime.staging.base import Staging, refuse_mixed_forms, squared_row_norms
from zenflow.runtime.staging.contributions import Contribution, Factors, HostRows


class HostBlockStaging(Staging):
    """Owns the step's block (``[columns, out]``, natural order) or its factors, and the
    scores taken from them."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._block: torch.Tensor | None = None
        self._factors: list[tuple[torch.Tensor, torch.Tensor]] = []  # (x, dy) per micro-batch
        self._scores: torch.Tensor | None = None

    def stage_matmul(self, columns_by_batch, out_grad, lookup=None) -> None:
        keep = lookup is None and (
            self._factors or (not self.staged and factors_pay(columns_by_batch, out_grad))
        )
        if not keep:
            super().stage_matmul(columns_by_batch, out_grad, lookup)
            return
        # Copies: the graph may reuse the operands' memory once the op returns.
        x = columns_by_batch.t().to(torch.float32, copy=True)
        self._factors.append((x, out_grad.to(torch.float32, copy=True)))
        self.staged_bytes += (columns_by_batch.numel() + out_grad.numel()) * (
            columns_by_batch.element_size()
        )
        self.micro_batches += 1

    def stage_rows(self, rows_at, dtype: torch.dtype) -> None:
        if self._factors:
            refuse_mixed_forms()
        formed = rows_at(None, out=self.blocks.take(dtype))
        if self._block is None:
            self._block = formed
        else:
            if self._block.dtype != torch.float32:  # micro-batches sum in fp32
                widened = self.blocks.take(torch.float32)
                widened.copy_(self._block)
                self.blocks.give(self._block)
                self._block = widened
            self._block += formed
            self.blocks.give(formed)
        layout = self.layout
        self.staged_bytes += (layout.columns - layout.k) * self.out * formed.element_size()
        self.micro_batches += 1
        self._scores = None

    def host_row_count(self) -> int:
        return 0 if self._block is None else self.layout.host_columns.numel()

    def finish(self) -> None:
        if self.offload:  # the selected rows' gradient "goes" where their state is: counted
            self.staged_bytes += self.layout.k * self.out * 4

    def land(self) -> None:
        """Nothing travels: the rows were formed where they are read."""

    def _x_dy(self) -> tuple[torch.Tensor, torch.Tensor]:
        if len(self._factors) > 1:
            xs, dys = zip(*self._factors, strict=True)
            self._factors = [(torch.cat(xs), torch.cat(dys))]
        return self._factors[0]

    def scores(self) -> torch.Tensor:
        if self._scores is None:
            if self._factors:
                x, dy = self._x_dy()
                self._scores = ((x.t() @ (dy @ dy.t())) * x.t()).sum(1).clamp_min(0.0)
            else:
                self._scores = squared_row_norms(self._block)
        return self._scores

    def norm_sq(self) -> torch.Tensor:
        if self._factors:
            x, dy = self._x_dy()
            return ((x @ x.t()).double() * (dy @ dy.t()).double()).sum()
        return self.scores().double().sum()

    def selected_rows(self) -> torch.Tensor:
        selected = self.layout.device_columns
        if self._factors:
            x, dy = self._x_dy()
            return x.index_select(1, selected).t() @ dy
        rows = self._block.index_select(0, selected)
        return rows if rows.dtype == torch.float32 else rows.float()

    def hand_over(self) -> Contribution:
        host_columns = self.layout.host_columns
        if self._factors:
            x, dy = self._x_dy()
            self._factors = []
            return Factors(x, dy, host_columns)
        block, self._block = self._block, None
        return HostRows(GatheredRows(block, host_columns), lambda: self.blocks.give(block))

    def move_staged(self, migration) -> tuple[int, int]:
        """Nothing moves: every staged row is in its natural place, selected or not."""
        return 0, 0

    def discard(self) -> None:
        if self._block is not None:
            self.blocks.give(self._block)
            self._block = None
        self._factors = []
        self._scores = None
        self.micro_batches = 0
        self.staged_bytes = 0
