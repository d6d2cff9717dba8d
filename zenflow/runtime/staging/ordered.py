"""What the strategies that form a gradient's rows in the layout's order share.

Where the weight is not on the host (a GPU), or the rows must be reduced over ranks, or summed
on the device, a micro-batch's rows are formed as one tensor on the weight's device, in the
layout's ``order`` (the selected columns first): the selected rows are kept there in fp32
(summed over micro-batches), and each strategy sends the unselected ones on its way
(``stage_unselected``). With one rank and one micro-batch every column's importance is taken
next to the rows as they are formed, so the step's norm needs no wait for the host.

A reselection in the middle of a step moves staged rows with their columns: the staged
unselected rows are kept as this rank's host block in local order (``[block rows, out]``, the
first ``k_local`` rows unused) so that the same moves as the column state's apply to them.
"""

import torch

from zenflow.runtime.migration import move_rows
from zenflow.runtime.staging.base import Staging, squared_row_norms
from zenflow.runtime.staging.contributions import HostRows
from zenflow.runtime.streams import PendingCopy, copy_stream, sent_to


def sum_in_fp32(total: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    """Micro-batches' rows summed in fp32: a copy of the first one's, the later ones added."""
    if total is None:
        return rows.to(torch.float32, copy=True)
    return total.add_(rows)


class OrderedStaging(Staging):
    """Owns the selected rows (``[k, out]`` fp32, device row order), the staged unselected
    rows as a strategy keeps them, and the scores when staging took them."""

    # Take every column's score as the rows are formed (one rank, one micro-batch): a strategy
    # that sends the rows away would otherwise have to read them back for the step's norm.
    scores_at_staging = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._selected: torch.Tensor | None = None
        # ``offload``: the selected rows on their way to the host, where their state is.
        self._selected_landing: PendingCopy | None = None
        # Every column's score in row order: taken at staging (one rank, one micro-batch) or
        # once the parts are summed over ranks.
        self._scores_in_order: torch.Tensor | None = None
        # This rank's unselected rows' scores, taken where the rows were reduced over ranks
        # (before they land on the host); None where they are taken from the host rows.
        self._chunk_scores: torch.Tensor | None = None

    def _index(self) -> torch.Tensor | None:
        return None if self.layout.natural_order else self.layout.on(self.device, "order")

    def stage_rows(self, rows_at, dtype: torch.dtype) -> None:
        # The caller hands ``rows`` over (formed for this alone, written by nothing else), so
        # an asynchronous copy needs no device-side snapshot of them.
        rows = rows_at(self._index())
        first = not self.staged
        self.stage_parts(rows, first)
        single = first and self.comm.world_size == 1 and self.scores_at_staging
        self._scores_in_order = squared_row_norms(rows) if single else None
        self.micro_batches += 1

    def stage_parts(self, rows: torch.Tensor, first: bool) -> None:
        """A micro-batch's rows (in row order, handed over): the selected ones are kept, the
        unselected ones sent on their way."""
        k = self.layout.k
        self._selected = sum_in_fp32(self._selected, rows[:k])
        self.stage_unselected(rows[k:], first)

    def stage_unselected(self, unselected: torch.Tensor, first: bool) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        self.comm.all_reduce_mean_(self._selected)
        if self.offload:
            # Updated where their state is, on the host: they cross on the copy stream, landed
            # by the step's one synchronization (which waits for the stream's copies).
            self.staged_bytes += self._selected.numel() * self._selected.element_size()
            stream = copy_stream(self.device)
            self._selected_landing = stream.copy_to_host(self._selected, owned=True)

    def _landed_selected(self) -> torch.Tensor:
        """The selected rows where the step reads them (``offload``: on the host, landed)."""
        if self._selected_landing is not None:
            self._selected = self._selected_landing.wait(self.sync)
            self._selected_landing = None
        return self._selected

    def land(self) -> None:
        """Rows on their way to the host: none, unless a strategy sends them."""

    def host_rows(self) -> torch.Tensor:
        """This rank's staged unselected rows in host row order (landed)."""
        raise NotImplementedError

    def rank_scores(self) -> torch.Tensor | None:
        """With several ranks, while the scores are not known: this rank's share of the
        unselected columns' scores (fp32, in row order over every rank's unselected rows,
        zero but for its own), for the step to sum over ranks together with every other
        weight's, in one collective (``adopt_summed_scores``); None where no sum is needed."""
        if self._scores_in_order is not None or self.comm.world_size == 1:
            return None
        layout = self.layout
        mine = self._chunk_scores
        if mine is None:
            self.land()
            mine = squared_row_norms(self.host_rows())
        part = mine.new_zeros(layout.columns - layout.k)
        start = sum(layout.unselected_counts[: layout.rank])
        part[start : start + mine.numel()] = mine
        return part

    def adopt_summed_scores(self, unselected: torch.Tensor) -> None:
        """The unselected columns' scores, summed over ranks: with the selected rows' (the
        same on every rank), every column's score."""
        selected = squared_row_norms(self._selected)
        unselected = sent_to(unselected, selected.device)
        self._scores_in_order = torch.cat([selected, unselected])

    def _take_scores(self) -> torch.Tensor:
        if self._scores_in_order is None:
            part = self.rank_scores()
            if part is None:  # one rank: the host rows of several micro-batches' sum
                self.land()
                part = squared_row_norms(self.host_rows())
            else:
                (part,) = self.comm.sum_over_ranks([part], part.device)
            self.adopt_summed_scores(part)
        return self._scores_in_order

    def scores(self) -> torch.Tensor:
        return self.layout.in_column_order(self._take_scores())

    def norm_sq(self) -> torch.Tensor:
        """On the device when staging took the scores there: the step sums every weight's
        there and reads one number, not one per weight."""
        return self._take_scores().sum(dtype=torch.float64)

    def selected_rows(self) -> torch.Tensor:
        return self._landed_selected()

    def staged_host_block(self) -> torch.Tensor:
        """The staged unselected rows as this rank's host block in local order (landed)."""
        raise NotImplementedError

    def keep_host_block(self, block: torch.Tensor, k_local: int) -> None:
        """Adopt ``block`` (local order, ``k_local`` selected rows first) as the staged
        unselected rows."""
        raise NotImplementedError

    def move_staged(self, migration) -> tuple[int, int]:
        self.land()
        block = self.staged_host_block()
        pairs = [(block, self._landed_selected())]
        (self._selected,), to_host, to_device = move_rows(migration, pairs, self.comm, self.pin)
        self.keep_host_block(block, migration.layout.k_local)
        self._scores_in_order = None
        self._chunk_scores = None
        return to_host, to_device

    def discard(self) -> None:
        self._selected = None
        self._selected_landing = None
        self._scores_in_order = None
        self._chunk_scores = None
        self.micro_batches = 0
        self.staged_bytes = 0


class StagedInHostBlock(OrderedStaging):
    """An ordered strategy that keeps this rank's staged unselected rows in a host block (its
    rows in local order, the first ``k_local`` unused); owns that block."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._block: torch.Tensor | None = None

    def host_row_count(self) -> int:
        return 0 if self._block is None else self.layout.host_columns.numel()

    def host_rows(self) -> torch.Tensor:
        return self._block[self.layout.k_local :]

    def staged_host_block(self) -> torch.Tensor:
        return self._block

    def keep_host_block(self, block: torch.Tensor, k_local: int) -> None:
        self._block = block

    def hand_over(self) -> HostRows:
        self.land()
        block, self._block = self._block, None
        return HostRows(block[self.layout.k_local :], lambda: self.blocks.give(block))

    def discard(self) -> None:
        self.land()  # a copy still writing a block must end before the block is taken again
        if self._block is not None:
            self.blocks.give(self._block)
            self._block = None
        super().discard()
