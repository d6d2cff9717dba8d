"""What every gradient-staging strategy shares: the interface, and the host blocks it stages in.

A strategy holds one weight's gradient from backward until the step commits or drops it. The
backward hands each micro-batch over in one of three forms (``stage_matmul``, ``stage_lookup``,
``stage_columns``); then the step calls, in order:

* ``finish()``: every micro-batch is in; reduce over ranks (collectives). Nothing waits for a
  copy here, so that the step can queue device work first;
* ``rank_scores()`` with several ranks: this rank's share of the columns' scores, which the
  step sums over ranks for every weight in one collective and hands back
  (``adopt_summed_scores``); None where there is nothing to sum;
* ``norm_parts()`` or ``norm_sq()``, and ``scores()``: tensors whose squared L2 norms add up
  to the staged gradient's (for the step to take every weight's in one multi-tensor norm;
  None where the strategy only knows its total), the staged gradient's squared norm (a float64
  0-d tensor, on the device where it was formed) and each column's squared norm (natural
  order, fp32, where they were taken: the conductor brings every weight's to the host at
  once);
* ``migrate(migration)`` if the step reselects: staged rows change side with their columns;
* ``selected_rows()``: the selected columns' rows, ``[k, out]`` fp32, where their state is;
* ``land()``: wait for rows still on their way to the host (an explicit call: nothing else
  blocks); then ``hand_over()``: this rank's unselected rows for the window's sum
  (``zenflow.runtime.staging.contributions``), after which the strategy forgets them;
* ``discard()``: drop whatever is left (a skipped step, ``zero_grad``).

Rows are per-column (``G.T``: ``[columns, out]``). Host blocks hold a whole block of this
rank's rows (``[block rows, out]``, pinned on a GPU machine) and are reused from step to step:
a fresh allocation of a weight's size costs more in page faults than the copy into it.
"""

import functools

import torch

from zenflow.runtime.comm import DataParallel
from zenflow.runtime.gradient_rows import (
    gather_rows,
    lookup_grad_rows,
    matmul_rows,
    with_lookup_added,
)
from zenflow.runtime.host_sync import HostSync
from zenflow.runtime.layout import ColumnLayout, Migration
from zenflow.runtime.side_by_side import indices_by


class HostBlocks:
    """Free host blocks of one shape, by dtype; owns the ones given back."""

    def __init__(self, rows: int, out: int, pin: bool):
        self.rows, self.out, self.pin = rows, out, pin
        self._free: list[torch.Tensor] = []

    def take(self, dtype: torch.dtype) -> torch.Tensor:
        for i, block in enumerate(self._free):
            if block.dtype == dtype:
                return self._free.pop(i)
        return torch.empty(self.rows, self.out, dtype=dtype, pin_memory=self.pin)

    def give(self, block: torch.Tensor) -> None:
        self._free.append(block)


class Staging:
    """One weight's staged gradient (see the module docstring for the calls' order).

    Owns: the layout it stages for (``layout``, replaced by ``migrate`` and ``adopt``), the
    micro-batch count, the bytes staging moved (``staged_bytes``, counted as device-to-host
    traffic, also where the device is the CPU, like every count) and its host blocks; waits
    and reads of device values go through the optimizer's ``sync``."""

    def __init__(
        self,
        layout: ColumnLayout,
        out: int,
        device: torch.device,
        comm: DataParallel,
        pin: bool,
        offload: bool,
        sync: HostSync,
    ):
        self.layout = layout
        self.sync = sync
        self.out = out
        self.device = device
        self.comm = comm
        self.pin = pin
        self.offload = offload  # the selected rows' state lives on the host
        self.blocks = HostBlocks(layout.block_rows, out, pin)
        self.micro_batches = 0
        self.staged_bytes = 0

    @property
    def staged(self) -> bool:
        return self.micro_batches > 0

    def host_row_count(self) -> int:
        """Rows of this rank's unselected columns staged on the host now (0 where none)."""
        return 0

    # The gradient's forms, as zenflow.compile.ops hands them over.

    def stage_matmul(self, columns_by_batch, out_grad, lookup=None) -> None:
        """``G.T == columns_by_batch @ out_grad`` (``[columns, batch]``, ``[batch, out]``), plus
        for a tied table a lookup's gradient ``(rows, ids)``: ``rows[t]`` added into column
        ``ids[t]``."""
        rows_at = functools.partial(matmul_rows, columns_by_batch, out_grad)
        if lookup is not None:
            rows_at = functools.partial(with_lookup_added, rows_at, *lookup)
        self.stage_rows(rows_at, columns_by_batch.dtype)

    def stage_lookup(self, lookup_rows: torch.Tensor, lookup_ids: torch.Tensor) -> None:
        """An embedding table's gradient: zero but for ``lookup_rows[t]`` added into column
        ``lookup_ids[t]``."""
        rows_at = functools.partial(lookup_grad_rows, lookup_rows, lookup_ids, self.out)
        self.stage_rows(rows_at, lookup_rows.dtype)

    def stage_columns(self, columns_by_out: torch.Tensor) -> None:
        """``G.T`` itself (``[columns, out]``, natural column order, any strides)."""
        self.stage_rows(functools.partial(gather_rows, columns_by_out), columns_by_out.dtype)

    def stage_rows(self, rows_at, dtype: torch.dtype) -> None:
        """``rows_at(index, out=None)``: the gradient's rows at the columns ``index`` (every
        column in its natural place for None), formed into ``out`` when given."""
        raise NotImplementedError

    def rows_in_block(self) -> tuple[torch.Tensor, int] | None:
        """A block of several weights' rows that this step's rows are views of, in the layout's
        order, and the row they start at, where a strategy keeps them so; None otherwise."""
        return None

    def norm_parts(self) -> list[torch.Tensor] | None:
        """Tensors whose squared L2 norms add up to the staged gradient's squared norm, where
        the rows are kept whole on their device; None: ask ``norm_sq()``."""
        return None

    def rank_scores(self) -> torch.Tensor | None:
        """This rank's share of the columns' scores, to be summed over ranks; None (one rank
        or no share left: the strategy knows its scores)."""
        return None

    def adopt_summed_scores(self, unselected: torch.Tensor) -> None:
        raise NotImplementedError

    def adopt(self, layout: ColumnLayout) -> None:
        """A new layout while nothing is staged (a checkpoint loaded)."""
        assert not self.staged, "a layout adopted with a gradient staged"
        self.layout = layout

    def migrate(self, migration: Migration) -> tuple[int, int]:
        """A reselection: staged rows, if any, change side with their columns. Returns the
        bytes this rank moved (to the host, to the device)."""
        moved = self.move_staged(migration) if self.staged else (0, 0)
        self.layout = migration.layout
        return moved

    def move_staged(self, migration: Migration) -> tuple[int, int]:
        raise NotImplementedError


def squared_norm_totals(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The squared L2 norm of all ``tensors`` together, one float64 0-d tensor per device and
    dtype among them: a multi-tensor norm (each tensor's in fp32, as ``clip_grad_norm_`` takes
    them; in fp64 the CPU's takes twice as long), the norms stacked before anything else is made
    of them (a list of 0-d tensors per tensor would be as many more Python objects per step),
    their squares summed in fp64."""
    totals = []
    for members in indices_by((t.device, t.dtype) for t in tensors).values():
        norms = torch._foreach_norm([tensors[i] for i in members], 2, dtype=torch.float32)
        totals.append(torch.stack(norms).square().sum(dtype=torch.float64))
    return totals


def squared_row_norms(rows: torch.Tensor) -> torch.Tensor:
    """Each row's squared L2 norm in fp32: one read of ``rows``, no temporary of its size."""
    return torch.linalg.vector_norm(rows, dim=1, dtype=torch.float32).square_()


def refuse_mixed_forms():
    raise RuntimeError(
        "zenflow: a weight's gradient arrived both as rows and as factors in one step (a "
        "compiled and an uncompiled model, or two compiled variants, sharing an optimizer "
        "within a step); give each step's micro-batches one path"
    )
