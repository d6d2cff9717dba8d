"""One weight a ZenFlow optimizer owns, put together from its parts.

The parts: where its columns are kept (``layout``), their AdamW state (``state``), the step's
gradient on its way (``staging``, one strategy chosen here for the weight's life) and the open
window (``window``). The ops the backend compiles into backward reach the weight by its
registry slot and hand the gradient to its staging; while it is staged, the parameter's
``.grad`` is a ``StagedGradient`` that stands for it (``zenflow.runtime.staged_gradient``):
setting ``.grad`` to None (``model.zero_grad()``) drops it. The parameter itself keeps
PyTorch's layout; updated values are written into its columns
(``zenflow.runtime.param_writes``).
"""

import time
from dataclasses import dataclass

import torch

from zenflow.columns import column_count, column_rows
from zenflow.runtime import registry
from zenflow.runtime.column_state import ColumnState
from zenflow.runtime.comm import DataParallel
from zenflow.runtime.host_sync import HostSync
from zenflow.runtime.layout import ColumnLayout, Migration
from zenflow.runtime.migration import EnteringRows, LeavingRows
from zenflow.runtime.param_writes import ColumnValues, write_columns
from zenflow.runtime.staged_gradient import StagedGradient
from zenflow.runtime.staging import ProductBlocks, staging_for
from zenflow.runtime.streams import PendingCopy, copy_stream
from zenflow.runtime.window_sum import WindowSum


class OwnedWeight:
    """Owns the parts above, the pinned buffers its values cross to the device through, the
    buffer the device update copies the selected columns' values into, its registry slot, and
    the step's gradient as ``.grad`` shows it (the ``StagedGradient``, and whether it is
    reduced over ranks, and its squared norm once the step or a clip took it: no micro-batch
    may join after that), and the host time the backward's hand-overs took (``hand_over_s``,
    seconds over its life: on a GPU the backward's share that is zenflow's, unprofiled).
    ``offload``: the selected columns' state lives on the host, and is
    updated there; ``device_sums``: the window's sum is kept on the weight's device; ``sync``:
    the optimizer's counted waits for the device; ``products``: the blocks a step's first
    products of the optimizer's weights with device-side sums share."""

    def __init__(
        self,
        param: torch.Tensor,
        group_index: int,
        comm: DataParallel,
        *,
        offload: bool,
        device_sums: bool,
        sync: HostSync,
        before_norms=lambda: None,
        products: ProductBlocks | None = None,
    ):
        self.param = param
        self.sync = sync
        # Called before the first norm of a step is taken (the conductor reduces the 1-D
        # parameters' gradients over ranks then, as torch's clip_grad_norm_ reads them next,
        # and sums every weight's scores over ranks in one collective).
        self.before_norms = before_norms
        self.group_index = group_index
        self.comm = comm
        self.out = param.shape[0]
        self.columns = column_count(param.shape)
        self.offload = offload
        self.device_sums = device_sums
        self.pin = param.device.type == "cuda"
        blocks = [comm.block(self.columns, r) for r in range(comm.world_size)]
        self.layout = ColumnLayout.natural(self.columns, comm.rank, blocks)
        self.staging = staging_for(
            param,
            self.layout,
            comm,
            pin=self.pin,
            offload=offload,
            accumulate_on_device=device_sums,
            sync=sync,
            products=products,
        )
        self.state = ColumnState(param, self.layout, offload, self.pin, sync)
        self.window = WindowSum(param.device if device_sums else torch.device("cpu"))
        # purpose -> (pinned buffer, its transfer to the device in flight), on a GPU.
        self._to_device_buffers: dict[str, tuple[torch.Tensor, PendingCopy | None]] = {}
        self._selected_copy: torch.Tensor | None = None  # see selected_copy()
        # The last selected_values() and the layout it is of: the same columns and rows step
        # after step, until a reselection or a new copy buffer (one object per weight and step
        # otherwise).
        self._selected_values: tuple[ColumnValues | None, ColumnLayout | None] = None, None
        # The one tensor object ``.grad`` holds while a gradient is staged, made at the first
        # and kept step after step (as torch reuses ``.grad`` under
        # ``zero_grad(set_to_none=False)``): one per weight and step would keep Python's
        # garbage collector busy. Its scale is cleared whenever the gradient is dropped.
        self._gradient: StagedGradient | None = None
        self._finished = False
        self._norm_sq: torch.Tensor | None = None
        self.hand_over_s = 0.0
        self.slot = registry.register(param, self)

    # The runtime side of zenflow.compile.ops: called from compiled backward graphs.

    def stage_matmul(self, columns_by_batch, out_grad, lookup=None) -> None:
        self._hand_over(self.staging.stage_matmul, columns_by_batch, out_grad, lookup)

    def stage_lookup(self, lookup_rows: torch.Tensor, lookup_ids: torch.Tensor) -> None:
        self._hand_over(self.staging.stage_lookup, lookup_rows, lookup_ids)

    def stage_columns(self, columns_by_out: torch.Tensor) -> None:
        self._hand_over(self.staging.stage_columns, columns_by_out)

    def _hand_over(self, stage, *gradient) -> None:
        started = time.perf_counter()
        self._before_staging()
        stage(*gradient)
        self._after_staging()
        self.hand_over_s += time.perf_counter() - started

    # The step's gradient.

    def collect_gradient(self) -> None:
        """Before the step reads the gradient: an ordinary ``.grad`` (a model that is not
        compiled) is staged; staged rows whose ``.grad`` was set to None since are dropped."""
        grad = self.param.grad
        if grad is not None and grad is self._gradient and self.staging.staged:
            return
        if self.staging.staged:  # .grad cleared or replaced after the backward staged it
            self.discard_gradient()
        if grad is not None:
            self.staging.stage_columns(column_rows(grad))
            self._after_staging()

    def finish_gradient(self) -> None:
        """Every micro-batch is in: the staged gradient is reduced over ranks (once a step)."""
        if not self._finished:
            self.staging.finish()
            self._finished = True

    def gradient_norm_sq(self) -> torch.Tensor:
        """The staged gradient's squared norm over every rank, before any scale (a float64
        0-d tensor). Reduces the gradient over ranks first, once per step."""
        if self._norm_sq is None:
            self.before_norms()
            self.finish_gradient()
            self._norm_sq = self.staging.norm_sq()
        return self._norm_sq

    def gradient_norm_parts(self) -> list[torch.Tensor] | None:
        """Tensors whose squared L2 norms add up to the staged gradient's squared norm (before
        any scale), for the step to take every weight's at once; None where only
        ``gradient_norm_sq()`` tells. Reduces the gradient over ranks first, once per step."""
        self.before_norms()
        self.finish_gradient()
        return self.staging.norm_parts()

    def gradient_scale(self) -> torch.Tensor | None:
        """What the staged gradient was multiplied by through ``.grad`` (clipping), or None."""
        return None if self._gradient is None else self._gradient.scale

    def discard_gradient(self) -> None:
        """Drop the staged gradient (committed, skipped, or zeroed), and its ``.grad``."""
        self.staging.discard()
        self._finished = False
        self._norm_sq = None
        if self._gradient is not None:
            self._gradient.scale = None
            if self.param.grad is self._gradient:
                self.param.grad = None

    def _before_staging(self) -> None:
        if self.staging.staged and self.param.grad is not self._gradient:
            self.discard_gradient()  # .grad was set to None (zero_grad) after a backward
        if self._finished:
            raise RuntimeError(
                "a backward() after this step's gradient norm was taken (by clip_grad_norm_ "
                "or the step): the norm would miss it; clip after the step's last backward"
            )

    def _after_staging(self) -> None:
        if self._gradient is None:
            self._gradient = StagedGradient(self, self.param)
        self.param.grad = self._gradient

    # Selection.

    def reselect(self, selected: torch.Tensor) -> tuple[int, int]:
        """Adopt a new selection (ascending column indices) at once: state and staged rows
        move for the columns that change side. Returns the bytes this rank moved (to the host,
        to the device). (The step reselects every weight together: ``queue_reselection``.)"""
        transfer = EnteringRows(self.state.device, self.comm, self.pin)
        queued = self.queue_reselection(selected, transfer)
        leaving = LeavingRows()
        moved = self.take_reselection(queued, transfer.send(), leaving)
        leaving.send()
        self.state.settle()
        return moved

    def queue_reselection(
        self, selected: torch.Tensor, transfer: EnteringRows, with_sums: bool = False
    ) -> "QueuedReselection":
        """A new selection (ascending column indices) planned, its entering columns' state
        rows (and with ``with_sums``, at a select boundary whose window's CPU update is yet to
        be submitted, their window sums) queued on ``transfer`` for the state's device."""
        migration = self.layout.reselect(selected)
        rows = self.state.entering(migration, transfer)
        sums = self.window.entering(migration, self.layout.k_local, transfer) if with_sums else None
        return QueuedReselection(migration, rows, sums)

    def take_reselection(
        self, queued: "QueuedReselection", sent: list[torch.Tensor], leaving: LeavingRows
    ) -> tuple[int, int]:
        """Adopt ``queued``'s selection, its entering state rows taken from ``sent`` (what its
        transfer sent; updated there first at a select boundary), its leaving ones queued on
        ``leaving`` (the caller sends it once every weight has reselected). The host rows move
        at ``state.settle()``: once every weight has reselected, or once the CPU update still
        running over them is done. Returns the bytes this rank moves (to the host, to the
        device)."""
        migration = queued.migration
        to_host, to_device = self.state.migrate_later(migration, queued.state_rows(sent), leaving)
        staged_to_host, staged_to_device = self.staging.migrate(migration)
        self.layout = migration.layout
        return to_host + staged_to_host, to_device + staged_to_device

    def adopt(self, layout: ColumnLayout) -> None:
        """A saved layout, with the state loaded beside it."""
        self.layout = layout
        self.staging.adopt(layout)

    # Writing updated values into the parameter the model computes with.

    def selected_copy(self) -> torch.Tensor | None:
        """Where the device update copies the selected columns' new values in the parameter's
        dtype (``[k, out]``, kept from step to step), for ``write_selected``: the update
        converts every weight's in one multi-tensor copy, where a conversion per weight would
        be a kernel launch each on a GPU. None where the values are written as they are (an
        fp32 parameter) or sent from the host (``offload``)."""
        if self.offload or self.param.dtype == torch.float32:
            return None
        shape = (self.layout.k, self.out)
        if self._selected_copy is None or self._selected_copy.shape != shape:
            self._selected_copy = self.param.new_empty(shape)
        return self._selected_copy

    def selected_values(self, copied: torch.Tensor | None = None) -> ColumnValues:
        """The selected columns' new values where the device update left them (``copied``: its
        ``selected_copy()`` of them, where it made one; not with ``offload``, whose values are
        on the host), for ``write_selected`` or for a write-back that takes them in its pass
        (``write_rows``). Valid until the next update or reselection."""
        assert not self.offload, "offloaded values are sent from the host: write_selected()"
        values = copied
        if values is None:
            master = self.state.device_master
            values = master if master.dtype == self.param.dtype else master.to(self.param.dtype)
        kept, layout = self._selected_values
        if kept is None or layout is not self.layout or kept.rows is not values:
            columns = self.layout.on(self.param.device, "selected")
            kept = ColumnValues(columns, values)
            self._selected_values = kept, self.layout
        return kept

    def entering_values(
        self, queued: "QueuedReselection", sent: list[torch.Tensor]
    ) -> ColumnValues:
        """The new values of the columns ``queued`` brings into the selection: their master
        rows in what its transfer sent (``sent``), once updated there at an overlapped select
        boundary, in the parameter's dtype; for a write before the reselection is taken (not
        with ``offload``, whose rows are on the host)."""
        assert not self.offload, "offloaded values are sent from the host: write_selected()"
        master = queued.state_rows(sent)[0]
        return ColumnValues(queued.migration.entering, master.to(self.param.dtype))

    def write_selected(self, copied: torch.Tensor | None = None) -> int:
        """Write the selected columns' new values into the parameter (``copied``: as for
        ``selected_values``); returns the bytes that crossed to the device: with ``offload``
        the values are sent from the host (counted even where the device is the CPU, like
        every count), else none."""
        if not self.offload:
            write_columns(self.param, self.selected_values(copied))
            return 0
        columns = self.layout.on(self.param.device, "selected")
        values = self._to_device(self.state.device_master, "selected")
        write_columns(self.param, ColumnValues(columns, values))
        return values.numel() * values.element_size()

    def copy_dtype(self) -> torch.dtype | None:
        """The dtype a CPU update copies this rank's new unselected rows in, for them to be
        written from the copy (``pending_update.CopyBuffers``): the parameter's (a 16-bit one
        rounded by the job), so that neither a conversion nor a copy of them is left to the
        training thread. None for an fp32 parameter off a GPU: it is written from the host
        master rows (on the CPU, where they are)."""
        sixteen_bit = self.param.dtype in (torch.bfloat16, torch.float16)
        if sixteen_bit or (self.pin and self.param.dtype == torch.float32):
            return self.param.dtype
        return None

    def write_rows(
        self,
        mine: torch.Tensor,
        copied: bool,
        columns: torch.Tensor,
        counts: list[int],
        ascending: tuple[torch.Tensor, torch.Tensor] | None = None,
        also: tuple[ColumnValues, ...] = (),
    ) -> int:
        """Write every rank's updated rows into the parameter's ``columns`` (on its device, in
        the order of the ranks' rows, ``counts[r]`` rows from rank ``r``; ``ascending``: their
        ``sort()``, where the caller keeps it), and then, in the same pass, ``also`` (other
        columns' values, such as ``selected_values()``, in order); ``mine``: this rank's rows,
        either a CPU update's copy of them in the parameter's dtype (``copied``), already sent
        to the device, or fp32 host master rows, sent and converted here. Returns the bytes
        this rank sent to its device."""
        # Each rank sends its own rows to its device and the ranks gather them there (over
        # NVLink, with NCCL), rather than gathering on the host and each sending them all.
        on_device = mine if copied else self._to_device(mine, "unselected")
        rows = self.comm.all_gather_rows(on_device, counts)
        unselected = ColumnValues(columns, rows, ascending)
        write_columns(self.param, unselected, *also)
        return on_device.numel() * on_device.element_size()

    def _to_device(self, rows: torch.Tensor, purpose: str) -> torch.Tensor:
        """Host ``rows`` in the parameter's dtype, on its device, for work queued on the
        current stream. On a GPU they go through a pinned buffer kept for ``purpose``
        (converted there: the host master itself is rewritten by the next overlapped CPU update
        as soon as this returns) and the copy stream, so the host thread does not wait for
        the transfer."""
        buffer, previous = self._to_device_buffers.get(purpose, (None, None))
        if previous is not None:
            previous.wait(self.sync)  # the last transfer from this buffer (on every device)
        if self.param.device.type == "cpu":
            staged = rows.to(self.param.dtype)  # the device is the host: no buffer to keep
        else:
            if buffer is None or buffer.shape[0] < rows.shape[0]:
                rows_kept = max(rows.shape[0], self.layout.block_rows)  # k may exceed a block
                buffer = torch.empty(rows_kept, self.out, dtype=self.param.dtype, pin_memory=True)
            staged = buffer[: rows.shape[0]].copy_(rows)
        on_device, pending = copy_stream(self.param.device).copy_to_device(staged)
        self._to_device_buffers[purpose] = (buffer, pending)
        return on_device

    # For export and inspection.

    def fp32_value(self) -> torch.Tensor:
        """The parameter's fp32 master value, shaped like it, on the host (collective: every
        rank contributes the host rows it owns)."""
        layout, state = self.layout, self.state
        unselected = self.comm.all_gather_rows(
            state.host_master[layout.k_local :], layout.unselected_counts
        )
        (selected,) = self.sync.to_host([state.device_master])
        rows = torch.cat([selected, unselected])  # in layout.order()
        in_natural_order = torch.empty_like(rows)
        in_natural_order[layout.order()] = rows
        return in_natural_order.t().reshape(self.param.shape).contiguous()

    def check_unchanged(self) -> None:
        # A parameter resized or re-typed in place (p.data = ...) after the optimizer took its
        # state would otherwise be written with state of the old shape.
        if self.param.shape[0] != self.out or column_count(self.param.shape) != self.columns:
            raise RuntimeError(
                f"a weight owned by ZenFlowAdamW changed shape to {list(self.param.shape)} "
                f"after the optimizer was created (it had {self.out} rows and {self.columns} "
                "columns); changing the model after creating the optimizer is not "
                "supported: create the optimizer (and compile) after the last change"
            )


@dataclass
class QueuedReselection:
    """A weight's next selection (``migration``) and the places of its entering columns' rows
    in what their transfer sends: the state's (master, moments, steps) and the window sums'."""

    migration: Migration
    state_places: list[int]
    sums_place: int | None

    def state_rows(self, sent: list[torch.Tensor]) -> list[torch.Tensor]:
        return [sent[place] for place in self.state_places]

    def sums(self, sent: list[torch.Tensor]) -> torch.Tensor:
        assert self.sums_place is not None, "queued without the window sums"
        return sent[self.sums_place]
