"""Staging for device-side window sums (``accumulate_on_device``, one rank).

The unselected rows stay on the weight's device in fp32 (summed over micro-batches) and are
added into the window's sum there; only each window's sum crosses to the host. A sum over ranks
would need its own reduction, so this strategy takes one rank. A step's first product of the
weight goes into a block it shares with the optimizer's other weights of its width
(``zenflow.runtime.staging.product_blocks``), which puts the rows in order for all of them at
the step.
"""

import torch

from zenflow.runtime.staging.base import squared_norm_totals
from zenflow.runtime.staging.contributions import DeviceRows
from zenflow.runtime.staging.ordered import OrderedStaging
from zenflow.runtime.staging.product_blocks import ProductBlocks


class DeviceSumStaging(OrderedStaging):
    """Owns the step's unselected rows on the device (fp32, host row order), whether its first
    product waits in the optimizer's ``products`` blocks for its rows to be put in order
    (``_in_products``), and the gathered block they were put in and the row they start at
    there (``_block``, ``_block_offset``)."""

    # The rows stay on the device until the step: the step's norm is taken from them for every
    # weight at once (``norm_parts``), and the columns' scores only where a selection or the
    # "auto" rule asks for them, not for each weight in every backward.
    scores_at_staging = False

    def __init__(self, *args, products: ProductBlocks, **kwargs):
        super().__init__(*args, **kwargs)
        self.products = products
        self._in_products = False
        self._unselected: torch.Tensor | None = None
        # Two attributes, not a tuple: a new container per weight and step would live until the
        # next, one more object for the garbage collector's young passes to find alive.
        self._block: torch.Tensor | None = None
        self._block_offset = 0

    def stage_matmul(self, columns_by_batch, out_grad, lookup=None) -> None:
        if lookup is not None or self.staged:
            super().stage_matmul(columns_by_batch, out_grad, lookup)
            return
        rows = self.products.region(self, self.out, columns_by_batch.dtype, columns_by_batch.device)
        torch.mm(columns_by_batch, out_grad, out=rows)
        self._in_products = True
        self.micro_batches = 1

    def take_product_rows(
        self, selected: torch.Tensor, unselected: torch.Tensor, rows: torch.Tensor, offset: int
    ) -> None:
        """This step's first product's rows, in the layout's order, fp32, as the selected and
        the unselected ones: views of ``rows`` (the block ``products`` gathered) from row
        ``offset``."""
        self._in_products = False
        self._selected, self._unselected = selected, unselected
        self._block, self._block_offset = rows, offset

    def rows_in_block(self) -> tuple[torch.Tensor, int] | None:
        """The gathered block this step's rows are still views of, and the row they start at
        (later micro-batches add into them there); None where the rows are the weight's own
        (a lookup's gradient, a migration, a discarded step). For the columns' scores of
        every weight of a block at once."""
        self._products_taken()
        block, selected, unselected = self._block, self._selected, self._unselected
        if block is None or selected is None or unselected is None:
            return None
        row_bytes = block.stride(0) * block.element_size()
        start = block.data_ptr() + self._block_offset * row_bytes
        if selected.data_ptr() != start:
            return None
        if unselected.data_ptr() != start + selected.shape[0] * row_bytes:
            return None
        return block, self._block_offset

    def _products_taken(self) -> None:
        """Every weight's first product put in order: before a later micro-batch adds to the
        rows, at ``finish()`` (every read comes after it) and before a migration moves them."""
        if self._in_products:
            self.products.gather()

    def stage_rows(self, rows_at, dtype: torch.dtype) -> None:
        self._products_taken()
        super().stage_rows(rows_at, dtype)

    def finish(self) -> None:
        self._products_taken()
        super().finish()

    def move_staged(self, migration) -> tuple[int, int]:
        self._products_taken()
        return super().move_staged(migration)

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
        if self._in_products:
            self.products.drop(self)
            self._in_products = False
        self._unselected = None
        self._block = None
        super().discard()
