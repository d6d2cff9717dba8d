"""One weight's ZenFlow state, split by columns between the device and the host, and on the host
partitioned across data-parallel ranks (ZeRO-1/2).

Layout: per-column quantities are *rows* of a ``[columns, out]`` matrix (the weight transposed,
so each column is contiguous). ``order`` is the weight's global column order: the ``k``
selected columns (in device row order), then the unselected ones grouped by the rank owning
them, each rank's in its host row order. Every
rank holds the device state of all selected rows (they are updated identically everywhere).
The host state (fp32 master, moments, per-column step counts) of the natural column block
``[lo, hi)`` lives on one rank only, in *local order*: that block's selected columns first
(``k_local`` rows, stale while on the device), then its unselected ones. Every rank keeps every
block's local order (they change identically everywhere), since ``order`` is built from them.
Because blocks are fixed, reselection moves state between device and host, never between
ranks, and never resets it.

The parameter itself keeps PyTorch's layout (row-major, contiguous); updated rows are written
into its columns by ``zenflow.runtime.param_writes``.

A step's gradient arrives from a compiled graph as a matmul's two factors (``stage_matmul``) or
as ``G.T`` (``stage_columns``; the eager path hands ``.grad`` over the same way). Its rows are
formed here in ``order``, straight into the buffers that keep them (with one process on the CPU:
in natural order into the host block, where the CPU pool reads the host rows in place);
for a batch much smaller than the weight the factors themselves are kept (``stage_factors``):
then the selected rows and the window's sum are products formed after the step's checks.

Options: ``offload`` keeps the selected rows' state in (pinned) host memory instead, updated
there every step, as DeepSpeed's ``offload`` does; ``accumulate_on_device`` sums the unselected
rows on the device and ships the window's sum to the host once per window instead of every
step's gradient (one rank only: the sum would need its own reduction).
"""

import functools

import torch

from zenflow.columns import column_count, column_rows
from zenflow.runtime import cpu_adam, registry
from zenflow.runtime.comm import DataParallel
from zenflow.runtime.gradient_rows import (
    factors_pay,
    gather_rows,
    lookup_grad_rows,
    matmul_rows,
    with_lookup_added,
)
from zenflow.runtime.param_writes import write_columns
from zenflow.runtime.streams import PendingCopy, copy_stream

# A cached value not computed yet, where None is a value.
_UNKNOWN = object()


class SplitWeight:
    def __init__(
        self,
        param: torch.Tensor,
        group_index: int,
        comm: DataParallel,
        pin: bool,
        offload: bool = False,
        accumulate_on_device: bool = False,
    ):
        if accumulate_on_device and comm.world_size > 1:
            raise ValueError(
                "accumulate_on_device needs a single process: with several ranks the window's "
                "sum would need its own reduction; turn it off or run on one rank"
            )
        self.param = param
        self.offload = offload
        self.state_device = torch.device("cpu") if offload else param.device
        self.accumulate_on_device = accumulate_on_device
        self.group_index = group_index
        self.comm = comm
        self.out = param.shape[0]
        self.columns = column_count(param.shape)
        self.lo, self.hi = comm.block(self.columns)
        self.pin_memory = pin and param.device.type == "cuda"
        self.k = 0
        self.order = torch.arange(self.columns, device=param.device)
        self.local_orders = [
            torch.arange(lo, hi) for lo, hi in map(self._block, range(comm.world_size))
        ]
        self.k_locals = [0] * comm.world_size
        # A copy even where the parameter is an fp32 CPU tensor whose rows are already contiguous.
        rows = column_rows(param.detach())[self.lo : self.hi].to("cpu", torch.float32, copy=True)
        self.host_master = self._host(rows)
        self.host_exp_avg = self._host(torch.zeros_like(rows))
        self.host_exp_avg_sq = self._host(torch.zeros_like(rows))
        self.host_steps = torch.zeros(self.hi - self.lo, dtype=torch.int64)
        self._empty_device_state()
        self.accumulator: torch.Tensor | None = None
        self.spare_accumulator: torch.Tensor | None = None
        self.in_window = False
        self.last_grad: torch.Tensor | None = None
        self.last_grad_block: torch.Tensor | None = None
        self.window_factors: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Host buffers of the whole block's rows ([hi - lo, out]), free to stage into; the staged
        # rows are the block's unselected part of one, so a reselection reorders them in place.
        self._spare_blocks: list[torch.Tensor] = []
        self._stage_block: torch.Tensor | None = None
        # The staged host rows are still in the block's natural order (``_stage_rows``).
        self._host_rows_in_place = False
        self._host_copy = None
        # A later micro-batch's rows on their way to the host, and their block.
        self._part_copy: tuple[PendingCopy, torch.Tensor] | None = None
        # purpose -> (pinned buffer, its transfer to the device in flight), on a GPU.
        self._to_device_buffers: dict[str, tuple[torch.Tensor, PendingCopy | None]] = {}
        self.discard_staged()
        self.slot = registry.register(param, self)

    def _block(self, rank: int) -> tuple[int, int]:
        return self.comm.block(self.columns, rank)

    def _host(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.contiguous()
        return tensor.pin_memory() if self.pin_memory else tensor

    def _empty_device_state(self) -> None:
        device = self.state_device
        self.device_master = torch.empty(0, self.out, device=device)
        self.device_exp_avg = torch.empty(0, self.out, device=device)
        self.device_exp_avg_sq = torch.empty(0, self.out, device=device)
        self.device_steps = torch.empty(0, dtype=torch.int64, device=device)

    @property
    def order(self) -> torch.Tensor:
        """Every column, in the order of the rows the runtime keeps: the selected ones first."""
        return self._order

    @order.setter
    def order(self, order: torch.Tensor) -> None:
        self._order = order
        # Columns in their natural places (no selection yet, or topk 0): a gradient's rows are
        # formed in that order already, with no gather (gradient_rows: index None). Set with
        # ``k`` already set; a selection is taken as reordering (no device sync to compare).
        natural = self.k == 0 and torch.equal(order.cpu(), torch.arange(self.columns))
        self.rows_index = None if natural else order
        # Asked for by every backward and step: one view, not a slice per call (a few us each).
        self.selected_columns = order[: self.k]
        self._host_moves: tuple[torch.Tensor, torch.Tensor] | None | object = _UNKNOWN

    @property
    def local_order(self) -> torch.Tensor:
        """This rank's host rows' columns: its block's selected columns first, then the rest."""
        return self.local_orders[self.comm.rank]

    @property
    def k_local(self) -> int:
        return self.k_locals[self.comm.rank]

    @property
    def unselected_counts(self) -> list[int]:
        return [
            order.numel() - k for order, k in zip(self.local_orders, self.k_locals, strict=True)
        ]

    @property
    def distributed(self) -> bool:
        return self.comm.world_size > 1

    # The runtime side of zenflow.ops: called from compiled backward graphs (or eagerly).

    def stage_matmul(
        self,
        columns_by_batch: torch.Tensor,
        out_grad: torch.Tensor,
        lookup: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """This micro-batch's gradient as a matmul, ``G.T == columns_by_batch @ out_grad``
        (``[columns, batch]`` and ``[batch, out]``), plus, for a tied embedding table, a lookup's
        gradient ``(rows, ids)``: ``rows[t]`` added into column ``ids[t]`` of ``G.T``. A plain
        matmul's two factors are kept when the batch is much smaller than the weight and the
        step can multiply them (``stages_on_host``); otherwise the rows are formed here."""
        if lookup is None and (
            self.factor_parts
            or (
                not self.micro_batches
                and self.stages_on_host
                and factors_pay(columns_by_batch, out_grad)
            )
        ):
            self.stage_factors(columns_by_batch, out_grad)
            return
        rows_at = functools.partial(matmul_rows, columns_by_batch, out_grad)
        if lookup is not None:
            rows_at = functools.partial(with_lookup_added, rows_at, *lookup)
        self._stage_rows(rows_at, columns_by_batch.dtype)

    def stage_lookup(self, lookup_rows: torch.Tensor, lookup_ids: torch.Tensor) -> None:
        """This micro-batch's gradient of an embedding table: ``G.T`` zero but for
        ``lookup_rows[t]`` (``[tokens, columns]``) added into column ``lookup_ids[t]``."""
        rows_at = functools.partial(lookup_grad_rows, lookup_rows, lookup_ids, self.out)
        self._stage_rows(rows_at, lookup_rows.dtype)

    def stage_columns(self, columns_by_out: torch.Tensor) -> None:
        """This micro-batch's gradient as ``G.T`` (``[columns, out]``, natural column order, any
        strides)."""
        rows_at = functools.partial(gather_rows, columns_by_out)
        self._stage_rows(rows_at, columns_by_out.dtype)

    def _stage_rows(self, rows_at, dtype: torch.dtype) -> None:
        """``rows_at(index, out=None)``: the gradient's rows (``[columns, out]``) at the columns
        ``index``, every column in its natural place for None.

        Where the host buffers are the staging buffers (``stages_on_host``: one process, the
        weight on the CPU), the first micro-batch's rows are formed in natural order straight
        into a host block, with no gather, and only the selected rows are copied out (a small
        part). The unselected rows stay where the product put them: the CPU pool reads them
        there (``unselected_staged``), and the step takes every column's importance from the
        block as it is; only what needs them in host row order (``host_stage``) has the few that
        a selection put out of their natural place moved first. Otherwise the rows are formed
        in ``order`` as one tensor and staged (``stage``), their importance taken next to them
        on the device (with one rank; with several it comes from the reduced sum)."""
        if self.factor_parts:
            _refuse_mixed_staging()
        if self.micro_batches or not self.stages_on_host:
            rows = rows_at(self.rows_index)
            self.stage(rows)
            if not self.distributed and self.micro_batches == 1:
                self._scores = _squared_row_norms(rows)
            return
        block = rows_at(None, out=self._take_block(dtype))
        selected = block.index_select(0, self.selected_columns)
        self.device_stage = selected if dtype == torch.float32 else selected.float()
        self._stage_block = block
        self._host_rows_in_place = True
        self.staged_bytes += (self.columns - self.k) * self.out * block.element_size()
        self.micro_batches = 1

    def _put_host_rows_in_order(self) -> None:
        """Staged rows still in natural order in their block: move the few host rows a
        selection put out of their natural place to their host row positions, so that the host
        rows are ``block[k:]``. (The selected rows were copied out at staging: the moves write
        over some of their natural places.)"""
        if not self._host_rows_in_place:
            return
        block = self._stage_block
        moves = self._host_row_moves()
        if moves is not None:
            positions, columns = moves
            block.index_copy_(0, positions, block.index_select(0, columns))
        self._host_stage = block[self.k :]
        self._host_rows_in_place = False

    def _host_row_moves(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One process: the host rows (block positions from ``k`` on) whose column is not the
        natural one of their position, and those columns; None if there are none. Few: a
        reselection swaps misplaced columns pairwise (``_partition``), so they stay about ``k``
        with a stable selection (about ``2 k`` after 40 reselections of random columns)."""
        if self._host_moves is _UNKNOWN:
            host_columns = self.order[self.k :].cpu()
            natural = torch.arange(self.k, self.columns)
            moved = host_columns != natural
            self._host_moves = (natural[moved], host_columns[moved]) if moved.any() else None
        return self._host_moves

    def stage(self, rows: torch.Tensor) -> None:
        """Keep this micro-batch's gradient rows (``[columns, out]`` in ``order``) until the
        step commits them.

        The caller hands ``rows`` over (they were formed for this alone; nothing writes them
        again), so an asynchronous copy to the host needs no device-side snapshot of them.
        With one rank the unselected rows start for the host at once, overlapping with the rest
        of the backward pass. With several, ZeRO-2 reduce-scatters them here and keeps only
        this rank's chunk; ZeRO-1 keeps them on the device until the step reduces them.
        """
        if self.factor_parts:
            _refuse_mixed_staging()
        self._scores = None
        selected, unselected = rows[: self.k], rows[self.k :]
        if self.micro_batches == 0:
            self.device_stage = selected.to(torch.float32, copy=True)
        else:
            self.device_stage += selected
        if self._reduces_in_backward:
            self._stage_reduced_chunk(unselected)
        elif self.micro_batches == 0:
            if self.distributed or self.accumulate_on_device:
                self.host_stage = unselected.to(torch.float32, copy=True)
            else:
                self._stage_block = self._take_block(unselected.dtype)
                self._host_copy = copy_stream(self.param.device).copy_to_host(
                    unselected, out=self._stage_block[self.k_local :], owned=True
                )
                self.staged_bytes += unselected.numel() * rows.element_size()
        else:
            self._finish_host_copy()
            if self._sends_parts_to_host:
                block = self._take_block(unselected.dtype)
                copy = copy_stream(self.param.device).copy_to_host(
                    unselected, out=block[self.k_local :], owned=True
                )
                self._part_copy = (copy, block)
            else:
                self._add_into_host_stage(unselected)
            if not (self.distributed or self.accumulate_on_device):
                self.staged_bytes += unselected.numel() * rows.element_size()
        self.micro_batches += 1

    @property
    def _sends_parts_to_host(self) -> bool:
        """Whether a later micro-batch's unselected rows go to the host like the first one's,
        through the copy stream (one rank, host-side sums, a weight on a GPU): added into the
        staged sum when they have landed (at the next micro-batch or the step), not fetched
        synchronously in the middle of backward."""
        return not (self.distributed or self.accumulate_on_device or self.stages_on_host)

    @property
    def _reduces_in_backward(self) -> bool:
        return self.distributed and self.comm.zero_stage == 2

    def _stage_reduced_chunk(self, unselected: torch.Tensor) -> None:
        """ZeRO-2: reduce-scatter this micro-batch's unselected rows at once, weight by weight
        as backward produces them, so that no rank holds a whole gradient past this op; only
        this rank's chunk (its host rows' columns) goes on, to the host."""
        mine = self.comm.reduce_scatter_mean(unselected.to(torch.float32), self.unselected_counts)
        if self.micro_batches == 0:
            self._keep_reduced_chunk(mine)
        else:
            self.host_stage += mine.to(self.host_stage.device)
            self.staged_bytes += mine.numel() * mine.element_size()

    def _keep_reduced_chunk(self, mine: torch.Tensor) -> None:
        """This rank's reduced chunk becomes the staged host rows, in a host block (where a
        reselection reorders them in place)."""
        self._stage_block = self._take_block(torch.float32)
        self.host_stage = self._stage_block[self.k_local :].copy_(mine)
        self.staged_bytes += mine.numel() * mine.element_size()

    @functools.cached_property
    def stages_on_host(self) -> bool:
        """Whether the host buffers are this weight's staging buffers: with one process, the
        weight on the CPU and host-side sums. Then a gradient's rows are formed straight into
        them, and its factors may be kept for the step to multiply, which costs what the
        product would have cost in backward. Fixed for the weight's life; asked by every
        hand-over."""
        return (
            not self.distributed
            and self.param.device.type == "cpu"
            and not self.accumulate_on_device
        )

    def stage_factors(self, columns_by_batch: torch.Tensor, out_grad: torch.Tensor) -> None:
        """Keep this micro-batch's gradient as its factors, ``G.T == columns_by_batch @
        out_grad``; micro-batches concatenate along the batch. Copies, as ``stage`` does."""
        if self.micro_batches and not self.factor_parts:
            _refuse_mixed_staging()
        batch_by_columns = columns_by_batch.t().to(torch.float32, copy=True)
        out_grad = out_grad.to(torch.float32, copy=True)
        self.factor_parts.append((batch_by_columns, out_grad))
        self.staged_bytes += (columns_by_batch.numel() + out_grad.numel()) * (
            columns_by_batch.element_size()
        )
        self.micro_batches += 1

    def _factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's factors ``(x, dy)``: ``G.T == x.T @ dy``, x ``[batch, columns]``."""
        if len(self.factor_parts) > 1:
            xs, dys = zip(*self.factor_parts, strict=True)
            self.factor_parts = [(torch.cat(xs), torch.cat(dys))]
        return self.factor_parts[0]

    def _host_columns(self) -> torch.Tensor:
        return self.local_order[self.k_local :]

    @property
    def host_stage(self) -> torch.Tensor | None:
        """This rank's staged unselected rows in host row order (on the host; on the device
        with ``accumulate_on_device``). Reading them waits for their copy to the host to land,
        so a step queues its device-side work before that wait, not after."""
        self._finish_host_copy()
        self._put_host_rows_in_order()
        return self._host_stage

    @host_stage.setter
    def host_stage(self, rows: torch.Tensor | None) -> None:
        self._host_stage = rows
        self._host_rows_in_place = False

    def unselected_staged(self) -> torch.Tensor | cpu_adam.GatheredRows:
        """``host_stage``'s rows for a CPU pool job, which reads them where they are: still in
        their staging block's natural order (one process), they are that block's rows at the
        host columns, with nothing moved."""
        if self._host_rows_in_place:
            return cpu_adam.GatheredRows(self._stage_block, self._host_columns())
        return self.host_stage

    def _finish_host_copy(self) -> None:
        """Wait for the rows still on their way to the host; a later micro-batch's are added
        into the staged sum (fp32) and their block given back."""
        if self._host_copy is not None:
            self._host_stage = self._host_copy.wait()
            self._host_copy = None
        if self._part_copy is not None:
            copy, block = self._part_copy
            self._part_copy = None
            self._add_into_host_stage(copy.wait())
            self.release_block(block)

    def _add_into_host_stage(self, rows: torch.Tensor) -> None:
        """A later micro-batch's unselected rows into the staged ones, summed in fp32 (the
        first micro-batch's, staged in their own dtype, are widened once)."""
        self._put_host_rows_in_order()
        if self._host_stage.dtype != torch.float32:
            self._host_stage = self._host_stage.float()
        self._host_stage += rows.to(self._host_stage.device, torch.float32)

    def stage_grad(self, grad: torch.Tensor) -> None:
        """The eager path: a gradient that arrived in ``.grad`` instead of through a graph."""
        self.stage_columns(column_rows(grad))

    def _take_block(self, dtype: torch.dtype) -> torch.Tensor:
        for i, block in enumerate(self._spare_blocks):
            if block.dtype == dtype:
                return self._spare_blocks.pop(i)
        return torch.empty(self.hi - self.lo, self.out, dtype=dtype, pin_memory=self.pin_memory)

    def release_block(self, block: torch.Tensor) -> None:
        """Give back a block nothing reads any more (one handed to a CPU update, once done)."""
        if block.device.type == "cpu" and block.shape == (self.hi - self.lo, self.out):
            self._spare_blocks.append(block)

    def keep_stage_as_last_grad(self) -> None:
        """The window's CPU update folds this step's staged rows in itself (``last_grad``): they,
        and the block they live in (``last_grad_block``, given back by whoever waits for that
        update), outlive the step."""
        self.last_grad, self.last_grad_block = self.hand_over_unselected()

    def discard_staged(self) -> None:
        # A copy still writing the block must end before the block is handed out again.
        self._finish_host_copy()
        if self._stage_block is not None:
            self.release_block(self._stage_block)
            self._stage_block = None
        self.device_stage = None
        self.host_stage = None
        self.micro_batches = 0
        self._scores: torch.Tensor | None = None
        self.factor_parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.staged_bytes = 0

    @property
    def has_staged(self) -> bool:
        return self.micro_batches > 0

    def reduce_staged(self) -> None:
        """Average the staged gradient over ranks: the selected rows everywhere, the unselected
        ones into this rank's chunk, which alone goes to the host. With one rank nothing moves
        (the transfer started in ``stage`` is waited for where the rows are read). Factors (one
        rank only) need nothing."""
        if self.factor_parts:
            return
        if not self.distributed:
            self._stage_selected_where_updated()
            return
        self.comm.all_reduce_mean_(self.device_stage)
        if not self._reduces_in_backward:
            self._keep_reduced_chunk(
                self.comm.reduce_scatter_mean(self.host_stage, self.unselected_counts)
            )
        self._stage_selected_where_updated()

    def _stage_selected_where_updated(self) -> None:
        """With ``offload`` the selected rows are updated on the host: their gradient goes there
        (counted as device-to-host traffic even where the device is the CPU, like every count)."""
        if self.offload:
            self.device_stage = self.device_stage.to(self.state_device)
            self.staged_bytes += self.device_stage.numel() * self.device_stage.element_size()

    def staged_scores(self) -> torch.Tensor:
        """Squared column norms of the staged (summed, reduced) gradient, in global column
        order, fp32 on the host, identical on every rank; computed once per step.

        Taken from the staged rows when first asked for, unless staging already took them
        (``_stage_rows``); with several micro-batches always from their sum, since norms of
        parts do not add up.
        """
        if self._scores is None and self._host_rows_in_place:
            # Every column's row, selected or not, is in the block at its natural place.
            self._scores = _squared_row_norms(self._stage_block)[self.order]
        if self._scores is None:
            device_part = _squared_row_norms(self.device_stage).cpu()
            host_part = torch.zeros(self.columns - self.k)
            start = sum(self.unselected_counts[: self.comm.rank])
            mine = _squared_row_norms(self.host_stage)
            host_part[start : start + mine.numel()] = mine
            self._scores = torch.cat([device_part, self.comm.all_reduce_sum_(host_part)])
        # Kept as returned (staging may have left them on the device): the norm and the
        # selection both ask in a select step, and a second call is no second transfer.
        self._scores = self._scores.float().cpu()
        return self._scores

    def staged_norm_sq(self) -> torch.Tensor:
        """Squared norm of the staged gradient (identical on every rank), a float64 scalar
        tensor where the scores are: on the device when staging took them there (one rank),
        so that a step sums every weight's there and crosses to the host once, not once per
        weight. From factors: ``||x.T dy||^2 == sum((x x.T) * (dy dy.T))``, batch-by-batch
        matrices only."""
        if self.factor_parts:
            x, dy = self._factors()
            return ((x @ x.t()).double() * (dy @ dy.t()).double()).sum()
        if self._scores is not None and self._scores.device.type != "cpu":
            return self._scores.double().sum()
        return self.staged_scores().double().sum()

    def column_scores(self) -> torch.Tensor:
        """Squared norm of each column of the staged gradient, in natural column order, fp32 on
        the host. From factors: ``s_j = x_j.T (dy dy.T) x_j``, x_j column j of x."""
        if self.factor_parts:
            x, dy = self._factors()
            return ((x.t() @ (dy @ dy.t())) * x.t()).sum(1).clamp_min(0.0)
        in_order = self.staged_scores()
        scores = torch.empty_like(in_order)
        scores[self.order.cpu()] = in_order
        return scores

    def selected_rows(self) -> torch.Tensor:
        """The staged gradient's selected rows (``[k, out]``, fp32, in device row order) where
        their state lives."""
        if self.factor_parts:
            x, dy = self._factors()
            selected = x.index_select(1, self.selected_columns.to(x.device))
            return (selected.t() @ dy).to(self.state_device)
        return self.device_stage

    def unselected_rows(self) -> torch.Tensor:
        """This rank's unselected rows of the staged gradient, in host row order."""
        if self.factor_parts:
            x, dy = self._factors()
            return x.index_select(1, self._host_columns()).t() @ dy
        return self.host_stage

    def add_unselected_to(self, accumulator: torch.Tensor, alpha: float) -> None:
        """``accumulator += alpha * unselected_rows()``; from factors in one matmul pass."""
        if self.factor_parts:
            x, dy = self._factors()
            accumulator.addmm_(x.index_select(1, self._host_columns()).t(), dy, alpha=alpha)
        else:
            accumulator.add_(self.host_stage, alpha=alpha)

    @property
    def sums_on_the_pool(self) -> bool:
        """Whether the CPU pool can add this step's unselected rows into the window's sum
        (``hand_over_unselected``): rows staged on the host, a sum on the host."""
        return not (self.accumulate_on_device or self.factor_parts)

    def hand_over_unselected(
        self,
    ) -> tuple[torch.Tensor | cpu_adam.GatheredRows, torch.Tensor | None]:
        """This step's unselected rows (``unselected_staged``), and the block they live in, for
        a job that reads them after the step: the weight forgets the block, so the next backward
        does not stage into it; the job's owner gives it back (``release_block``) once done."""
        rows, block = self.unselected_staged(), self._stage_block
        self._stage_block = None
        # Rows left in place were the block's: none stay staged here without it.
        self._host_rows_in_place = False
        return rows, block

    def defer_unselected(self, alpha: float) -> bool:
        """Factor-staged: keep this step's factors (``dy`` scaled by ``alpha``) instead of adding
        its unselected rows to the window's sum now; ``sum_deferred_into`` forms the window's
        sum in one matmul when it closes, so the sum is written once per window rather than
        read and written every step. False (nothing kept) for a gradient staged as rows."""
        if not self.factor_parts:
            return False
        x, dy = self._factors()
        self.window_factors.append((x, dy * alpha if alpha != 1.0 else dy))
        return True

    def sum_deferred_into(self, accumulator: torch.Tensor) -> None:
        """``accumulator +=`` the unselected rows of every step ``defer_unselected`` kept."""
        if self.window_factors:
            xs, dys = zip(*self.window_factors, strict=True)
            x = torch.cat(xs).index_select(1, self._host_columns())
            accumulator.addmm_(x.t(), torch.cat(dys))
            self.window_factors = []

    def new_accumulator(self) -> torch.Tensor:
        device = self.param.device if self.accumulate_on_device else torch.device("cpu")
        return torch.zeros(self.hi - self.lo - self.k_local, self.out, device=device)

    @property
    def can_fold_last_grad(self) -> bool:
        """Whether the CPU update can read this step's unselected rows as staged
        (``keep_stage_as_last_grad``) instead of their being added to the sum first."""
        return not (self.accumulate_on_device or self.factor_parts)

    # Selection and migration.

    @property
    def _staged_rows(self) -> bool:
        """Whether staged gradient rows (not factors) must move with a reselection."""
        return self.has_staged and not self.factor_parts

    def _row_bytes(self) -> int:
        """Bytes of one column's state as it crosses: fp32 master and moments, int64 step, and
        the staged gradient (in its block's dtype) when the move happens mid-step."""
        staged = self._stage_block.element_size() if self._staged_rows else 0
        return self.out * (4 * 3 + staged) + 8

    def reselect(self, selected_columns: torch.Tensor) -> tuple[int, int]:
        """Adopt a new selection (ascending natural column indices). Only columns whose side
        changes move: a leaving column's device state (and staged gradient) goes to its owner's
        host rows, an entering column's host state to every rank's device rows. Host rows take
        a leaving column's state at its place in the new order (the place an entering column
        left) and device rows replace leaving columns with entering ones in place, so the work
        is proportional to the change, not to the weight.
        Returns the bytes this rank moved (to the host, to the device)."""
        columns, rank = self.columns, self.comm.rank
        old_selected, new_selected = self.selected_columns.cpu(), selected_columns.cpu()
        was = torch.zeros(columns, dtype=torch.bool)
        was[old_selected] = True
        now = torch.zeros(columns, dtype=torch.bool)
        now[new_selected] = True
        mine = torch.zeros(columns, dtype=torch.bool)
        mine[self.lo : self.hi] = True
        device_row = torch.full((columns,), -1, dtype=torch.int64)
        device_row[old_selected] = torch.arange(self.k)
        host_row = torch.empty(columns, dtype=torch.int64)
        host_row[self.local_order] = torch.arange(self.hi - self.lo)

        device_state = [
            self.device_master,
            self.device_exp_avg,
            self.device_exp_avg_sq,
            self.device_steps,
        ]
        host_state = [self.host_master, self.host_exp_avg, self.host_exp_avg_sq, self.host_steps]
        if self._staged_rows:
            device_state.append(self.device_stage)
            host_state.append(self._staged_block())

        entering = new_selected[~was[new_selected]]
        leaving = old_selected[~now[old_selected]]
        entering_rows = []
        owned = mine[entering]
        for host, device in zip(host_state, device_state, strict=True):
            # Gathered into pinned memory on a GPU machine: the copy to the device runs at
            # twice a pageable copy's bandwidth, without holding the host thread.
            shape = (entering.numel(), *host.shape[1:])
            if self.comm.world_size == 1:
                rows = torch.empty(shape, dtype=host.dtype, pin_memory=self.pin_memory)
                torch.index_select(host, 0, host_row[entering], out=rows)
            else:
                rows = torch.zeros(shape, dtype=host.dtype, pin_memory=self.pin_memory)
                rows[owned] = _rows(host, host_row[entering[owned]])
            rows = self.comm.all_reduce_sum_(rows.to(self.param.device, non_blocking=True))
            entering_rows.append(rows.to(self.state_device, device.dtype))
        # This block's new order swaps each misplaced front column (unselected now) with a
        # misplaced back one (selected now). Host rows of selected columns are never read (their
        # state is on the device), so only the columns going behind need rows there: a leaving
        # column's from the device, written at its new place; an unselected one that the swap
        # moves (this block's share of the selection grew) its own row, moved.
        partitions = [_partition(order, now) for order in self.local_orders]
        new_local_order, _, (front, back) = partitions[rank]
        moved = ~was[self.local_order[front]]
        new_host_row = torch.empty(columns, dtype=torch.int64)
        new_host_row[new_local_order] = torch.arange(self.hi - self.lo)
        leaving_mine = leaving[mine[leaving]]
        for host, device in zip(host_state, device_state, strict=True):
            _put_rows(host, back[moved], _rows(host, front[moved]))
            leaving_rows = self._on_host(_rows(device, device_row[leaving_mine]).to(host.dtype))
            _put_rows(host, new_host_row[leaving_mine], leaving_rows)

        if entering.numel() == leaving.numel():
            rows_to_fill = device_row[leaving].to(self.state_device)
            for device, rows in zip(device_state, entering_rows, strict=True):
                _put_rows(device, rows_to_fill, rows)
            selected_order = self.selected_columns.clone()
            selected_order[rows_to_fill.to(selected_order.device)] = entering.to(
                selected_order.device
            )
        else:
            # The selection changed size (the first one): rows in ascending column order.
            new_row = torch.empty(columns, dtype=torch.int64)
            new_row[new_selected] = torch.arange(new_selected.numel())
            staying = new_selected[was[new_selected]]
            for i, (device, rows) in enumerate(zip(device_state, entering_rows, strict=True)):
                placed = device.new_empty(new_selected.numel(), *device.shape[1:])
                placed[new_row[staying].to(device.device)] = device[
                    device_row[staying].to(device.device)
                ]
                placed[new_row[entering].to(device.device)] = rows
                device_state[i] = placed
            selected_order = new_selected.to(self.param.device)

        self.local_orders = [order for order, _, _ in partitions]
        self.k_locals = [k_local for _, k_local, _ in partitions]
        self.k = new_selected.numel()
        self.order = torch.cat(
            [selected_order.to(self.param.device)]
            + [
                order[k_local:].to(self.param.device)
                for order, k_local in zip(self.local_orders, self.k_locals, strict=True)
            ]
        )
        self.host_master, self.host_exp_avg, self.host_exp_avg_sq, self.host_steps = host_state[:4]
        self.device_master, self.device_exp_avg, self.device_exp_avg_sq, self.device_steps = (
            device_state[:4]
        )
        if len(device_state) > 4:
            self.device_stage = device_state[4]
            self.host_stage = host_state[4][self.k_local :]
            if self.accumulate_on_device:
                self.host_stage = self.host_stage.to(self.param.device)
            self._scores = None
        return leaving_mine.numel() * self._row_bytes(), entering.numel() * self._row_bytes()

    def _on_host(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` on the host; from a GPU through pinned memory (twice a pageable copy's
        bandwidth)."""
        if rows.device.type == "cpu":
            return rows
        landed = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=self.pin_memory)
        return landed.copy_(rows)

    def _staged_block(self) -> torch.Tensor:
        """This rank's block of the staged gradient, in host row order (the rows of selected
        columns unset): the block the staged rows already live in when there is one, in its
        dtype, else a new fp32 one. A 16-bit block holds one micro-batch's rows as formed, and
        the selected rows on the device are the same values in fp32, so rows move between the
        two exactly; the 16-bit gradient is not widened whole for a reselection (the size of
        the weight in fp32, per weight)."""
        block = self._stage_block
        in_block = (
            block is not None and self.host_stage.data_ptr() == block[self.k_local :].data_ptr()
        )
        if not in_block:
            block = self._take_block(torch.float32)
            block[self.k_local :] = self.host_stage
            if self._stage_block is not None:
                self.release_block(self._stage_block)
            self._stage_block = block
        return block

    def ship_window_sum(self) -> torch.Tensor:
        """``accumulate_on_device``: the window's sum, in the parameter's dtype, on the host;
        the device accumulator starts the next window at zero."""
        window_sum = self.accumulator.to("cpu", self.param.dtype, copy=True)
        self.accumulator.zero_()
        return window_sum

    # Writing updated values into the parameter the model computes with.

    def write_selected(self) -> int:
        """Write the selected rows' new values into the parameter; returns the bytes that
        crossed to the device: with ``offload`` the state lives on the host and the values are
        sent over (counted even where the device is the CPU, like every count), else none."""
        if not self.offload:
            write_columns(
                self.param, self.selected_columns, self.device_master.to(self.param.dtype)
            )
            return 0
        values = self._to_device(self.device_master, "selected")
        write_columns(self.param, self.selected_columns, values)
        return values.numel() * values.element_size()

    def new_rounded_rows(self) -> torch.Tensor | None:
        """A buffer for this rank's unselected rows in the parameter's 16-bit dtype, for a CPU
        update to round its results into (pinned on a GPU machine: it is sent from there; torch
        keeps it from reuse until the copy is done); None for an fp32 parameter."""
        if self.param.dtype not in (torch.bfloat16, torch.float16):
            return None
        rows = self.hi - self.lo - self.k_local
        return torch.empty(rows, self.out, dtype=self.param.dtype, pin_memory=self.pin_memory)

    def write_unselected(self, rounded: torch.Tensor | None = None) -> int:
        """Write every rank's unselected host rows into the parameter; returns the bytes this
        rank sent from its host to its device. ``rounded``: those rows already in the
        parameter's dtype (``new_rounded_rows``, filled by the update); else they are converted
        here."""
        # Each rank sends its own rows to its device and the ranks gather them there (over
        # NVLink, with NCCL), rather than gathering on the host and each sending them all.
        if rounded is None:
            mine = self._to_device(self.host_master[self.k_local :], "unselected")
        else:
            mine, _ = copy_stream(self.param.device).copy_to_device(rounded)
        rows = self.comm.all_gather_rows(mine, self.unselected_counts)
        write_columns(self.param, self.order[self.k :], rows)
        return mine.numel() * mine.element_size()

    def _to_device(self, rows: torch.Tensor, purpose: str) -> torch.Tensor:
        """Host ``rows`` in the parameter's dtype, on its device, for work queued on the current
        stream. On a GPU they go through a pinned buffer kept for ``purpose`` (converted there:
        the host master itself is rewritten by the next overlapped CPU update as soon as this
        returns) and the copy stream, so the host thread does not wait for the transfer."""
        on_host = self.param.device.type == "cpu"
        if on_host:
            staged = rows.to(self.param.dtype)  # the device is the host: nothing to keep
        else:
            buffer, previous = self._to_device_buffers.get(purpose, (None, None))
            if previous is not None:
                previous.wait()  # the last transfer from this buffer (a window or a step ago)
            if buffer is None or buffer.shape[0] < rows.shape[0]:
                rows_kept = max(rows.shape[0], self.hi - self.lo)  # k may exceed the block
                buffer = torch.empty(rows_kept, self.out, dtype=self.param.dtype, pin_memory=True)
            staged = buffer[: rows.shape[0]].copy_(rows)
        on_device, pending = copy_stream(self.param.device).copy_to_device(staged)
        if not on_host:
            self._to_device_buffers[purpose] = (buffer, pending)
        return on_device

    def load(self, order, local_orders: list, k: int, k_locals: list, host: list, device: list):
        """Adopt saved state (as ``ZenFlowAdamW.state_dict`` lists it)."""
        self.k = k
        self.order = order.to(self.param.device)
        self.local_orders = [o.clone() for o in local_orders]
        self.k_locals = list(k_locals)
        master, exp_avg, exp_avg_sq, steps = host
        self.host_master = self._host(master.clone())
        self.host_exp_avg = self._host(exp_avg.clone())
        self.host_exp_avg_sq = self._host(exp_avg_sq.clone())
        self.host_steps = steps.clone()
        device_tensors = [t.to(self.param.device, copy=True) for t in device]
        self.device_master, self.device_exp_avg, self.device_exp_avg_sq, self.device_steps = (
            device_tensors
        )
        self.discard_staged()


def _squared_row_norms(rows: torch.Tensor) -> torch.Tensor:
    """Each row's squared L2 norm in fp32: one read of ``rows``, no temporary of its size."""
    return torch.linalg.vector_norm(rows, dim=1, dtype=torch.float32).square_()


def _refuse_mixed_staging():
    raise RuntimeError(
        "zenflow: a weight's gradient arrived both as rows and as factors in one step (a "
        "compiled and an uncompiled model, or two compiled variants, sharing an optimizer "
        "within a step); give each step's micro-batches one path"
    )


# Row gathers and scatters as index_select / index_copy_: whole rows copied at once, several
# times faster on CPU than advanced indexing, which goes element by element.


def _rows(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return tensor.index_select(0, index.to(tensor.device))


def _put_rows(tensor: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    tensor.index_copy_(0, index.to(tensor.device), rows.to(tensor.device))


def _partition(local_order: torch.Tensor, selected: torch.Tensor):
    """A block's new host row order for a new selection: selected columns in front, the rest
    behind, by swapping each misplaced front position with a misplaced back one (every other
    column keeps its place). Returns the new order, the front's size, and the swapped positions
    ``(front, back)``: the column at ``front[i]`` goes to ``back[i]`` and the other way round."""
    in_front = selected[local_order]
    size = int(in_front.sum())
    position = torch.arange(local_order.numel())
    front = ((position < size) & ~in_front).nonzero().flatten()
    back = ((position >= size) & in_front).nonzero().flatten()
    order = local_order.clone()
    order[front], order[back] = local_order[back], local_order[front]
    return order, size, (front, back)
