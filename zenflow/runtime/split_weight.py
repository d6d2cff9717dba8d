"""One weight's ZenFlow state, split by columns between the device and the host, and on the host
partitioned across data-parallel ranks (ZeRO-1/2).

Layout: per-column quantities are *rows* of a ``[columns, out]`` matrix (the weight transposed,
so each column is contiguous). ``order`` is the weight's global column order: the ``k``
selected columns (ascending), then the unselected ones grouped by the rank owning them. Every
rank holds the device state of all selected rows (they are updated identically everywhere).
The host state (fp32 master, moments, per-column step counts) of the natural column block
``[lo, hi)`` lives on one rank only, in *local order*: that block's selected columns first
(``k_local`` rows, stale while on the device), then its unselected ones. Because blocks are
fixed, reselection moves state between device and host, never between ranks, and never
resets it.

Options: ``offload`` keeps the selected rows' state in (pinned) host memory instead, updated
there every step, as DeepSpeed's ``offload`` does; ``accumulate_on_device`` sums the unselected
rows on the device and ships the window's sum to the host once per window instead of every
step's gradient (one rank only: the sum would need its own reduction).
"""

import torch

from zenflow.columns import as_matrix, column_count
from zenflow.runtime import registry
from zenflow.runtime.comm import DataParallel
from zenflow.runtime.streams import copy_stream


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
        self.k_local = 0
        self.order = torch.arange(self.columns, device=param.device)
        self.local_order = torch.arange(self.lo, self.hi)
        self.unselected_counts = [hi - lo for lo, hi in map(self._block, range(comm.world_size))]
        rows = as_matrix(param.detach()).t()[self.lo : self.hi].float().cpu()
        self.host_master = self._host(rows)
        self.host_exp_avg = self._host(torch.zeros_like(rows))
        self.host_exp_avg_sq = self._host(torch.zeros_like(rows))
        self.host_steps = torch.zeros(self.hi - self.lo, dtype=torch.int64)
        self._empty_device_state()
        self.accumulator: torch.Tensor | None = None
        self.spare_accumulator: torch.Tensor | None = None
        self.in_window = False
        self.last_grad: torch.Tensor | None = None
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
    def distributed(self) -> bool:
        return self.comm.world_size > 1

    # The runtime side of zenflow.ops: called from compiled backward graphs (or eagerly).

    def column_order(self) -> torch.Tensor:
        return self.order

    def stage(self, rows: torch.Tensor) -> None:
        """Keep this micro-batch's gradient rows until the step commits them.

        Copies: a compiled graph may reuse ``rows``' storage as soon as this returns. With one
        rank the unselected rows start for the host at once, overlapping with the rest of the
        backward pass; with several they stay on the device until the step reduces them and
        brings only this rank's chunk over.
        """
        selected, unselected = rows[: self.k], rows[self.k :]
        if self.micro_batches == 0:
            self.device_stage = selected.to(torch.float32, copy=True)
            if self.distributed or self.accumulate_on_device:
                self.host_stage = unselected.to(torch.float32, copy=True)
            else:
                self._host_copy = copy_stream(self.param.device).copy_to_host(unselected)
                self.staged_bytes += unselected.numel() * rows.element_size()
        else:
            self.device_stage += selected
            self._finish_host_copy()
            if self.host_stage.dtype != torch.float32:
                self.host_stage = self.host_stage.float()
            self.host_stage += unselected.to(self.host_stage.device, torch.float32)
            if not (self.distributed or self.accumulate_on_device):
                self.staged_bytes += unselected.numel() * rows.element_size()
        self.micro_batches += 1

    def _finish_host_copy(self) -> None:
        if self._host_copy is not None:
            self.host_stage = self._host_copy.wait()
            self._host_copy = None

    def record_importance(self, scores: torch.Tensor) -> None:
        self.score_parts.append(scores.detach().clone())

    def stage_grad(self, grad: torch.Tensor) -> None:
        """The eager path: a gradient that arrived in ``.grad`` instead of through a graph."""
        rows = as_matrix(grad).t().index_select(0, self.order)
        self.stage(rows)
        self.record_importance(rows.float().square().sum(1))

    def discard_staged(self) -> None:
        self.device_stage = None
        self.host_stage = None
        self._host_copy = None
        self.micro_batches = 0
        self.score_parts = []
        self.staged_bytes = 0

    @property
    def has_staged(self) -> bool:
        return self.micro_batches > 0

    def reduce_staged(self) -> None:
        """Average the staged gradient over ranks: the selected rows everywhere, the unselected
        ones into this rank's chunk, which alone goes to the host. With one rank: wait for the
        transfer started in ``stage``."""
        if not self.distributed:
            self._finish_host_copy()
            self._stage_selected_where_updated()
            return
        self.comm.all_reduce_mean_(self.device_stage)
        mine = self.comm.reduce_scatter_mean(self.host_stage, self.unselected_counts)
        self.host_stage = self._host(mine.cpu())
        self.staged_bytes += self.host_stage.numel() * self.host_stage.element_size()
        self._stage_selected_where_updated()

    def _stage_selected_where_updated(self) -> None:
        """With ``offload`` the selected rows are updated on the host: their gradient goes there
        (counted as device-to-host traffic even where the device is the CPU, like every count)."""
        if self.offload:
            self.device_stage = self.device_stage.to(self.state_device)
            self.staged_bytes += self.device_stage.numel() * self.device_stage.element_size()

    def staged_scores(self) -> torch.Tensor:
        """Squared column norms of the staged (summed, reduced) gradient, in global column
        order, fp32 on the host, identical on every rank.

        With one rank and one micro-batch the graph already computed them next to the gradient;
        otherwise they come from the reduced sum, since norms of parts do not add up.
        """
        if not self.distributed and self.micro_batches == 1 and len(self.score_parts) == 1:
            return self.score_parts[0].float().cpu()
        device_part = self.device_stage.square().sum(1).cpu()
        host_part = torch.zeros(self.columns - self.k)
        start = sum(self.unselected_counts[: self.comm.rank])
        mine = self.host_stage.float().square().sum(1)
        host_part[start : start + mine.numel()] = mine
        return torch.cat([device_part, self.comm.all_reduce_sum_(host_part)])

    # Selection and migration.

    def _row_bytes(self) -> int:
        """Bytes of one column's state as it crosses: fp32 master and moments, int64 step, and
        the fp32 staged gradient when the move happens mid-step."""
        return self.out * 4 * (3 + self.has_staged) + 8

    def reselect(self, selected_columns: torch.Tensor) -> tuple[int, int]:
        """Adopt a new selection (ascending natural column indices). Only columns whose side
        changes move: a leaving column's device state (and staged gradient) goes to its owner's
        host rows, an entering column's host state to every rank's device rows; the rest stay
        where they are. Returns the bytes this rank moved (to the host, to the device)."""
        columns, lo, hi = self.columns, self.lo, self.hi
        old_selected, new_selected = self.order[: self.k].cpu(), selected_columns.cpu()
        was = torch.zeros(columns, dtype=torch.bool)
        was[old_selected] = True
        now = torch.zeros(columns, dtype=torch.bool)
        now[new_selected] = True
        mine = torch.zeros(columns, dtype=torch.bool)
        mine[lo:hi] = True
        old_row = torch.full((columns,), -1, dtype=torch.int64)
        old_row[old_selected] = torch.arange(self.k)
        local_row = torch.empty(columns, dtype=torch.int64)
        local_row[self.local_order] = torch.arange(hi - lo)

        device_state = [
            self.device_master,
            self.device_exp_avg,
            self.device_exp_avg_sq,
            self.device_steps,
        ]
        host_state = [self.host_master, self.host_exp_avg, self.host_exp_avg_sq, self.host_steps]
        if self.has_staged:
            # This rank's block of the staged gradient, in host (local) row order.
            block_grad = torch.empty(hi - lo, self.out)
            block_grad[self.k_local :] = self.host_stage.float()
            device_state.append(self.device_stage)
            host_state.append(block_grad)

        leaving = (was & ~now & mine).nonzero().flatten()
        for host, device in zip(host_state, device_state, strict=True):
            host[local_row[leaving]] = device[old_row[leaving].to(device.device)].cpu()
        entering = new_selected[~was[new_selected]]
        entering_rows = []
        for host in host_state:
            rows = torch.zeros(entering.numel(), *host.shape[1:], dtype=host.dtype)
            owned = mine[entering]
            rows[owned] = host[local_row[entering[owned]]]
            rows = self.comm.all_reduce_sum_(rows.to(self.param.device))
            entering_rows.append(rows.to(self.state_device))

        unselected = (~now).nonzero().flatten()
        new_local_order = torch.cat(
            [new_selected[mine[new_selected]], unselected[mine[unselected]]]
        )
        moved = local_row[new_local_order]
        host_state = [self._host(host[moved]) for host in host_state]
        new_row = torch.empty(columns, dtype=torch.int64)
        new_row[new_selected] = torch.arange(new_selected.numel())
        staying = new_selected[was[new_selected]]
        device_rows = []
        for device, rows in zip(device_state, entering_rows, strict=True):
            placed = device.new_empty(new_selected.numel(), *device.shape[1:])
            placed[new_row[staying].to(device.device)] = device[old_row[staying].to(device.device)]
            placed[new_row[entering].to(device.device)] = rows
            device_rows.append(placed)

        to_host = leaving.numel() * self._row_bytes()
        to_device = entering.numel() * self._row_bytes()
        self.k, self.k_local = new_selected.numel(), int(mine[new_selected].sum())
        self.local_order = new_local_order
        self.order = torch.cat([new_selected, unselected]).to(self.param.device)
        self.unselected_counts = [
            int(((unselected >= lo_r) & (unselected < hi_r)).sum())
            for lo_r, hi_r in map(self._block, range(self.comm.world_size))
        ]
        self.host_master, self.host_exp_avg, self.host_exp_avg_sq, self.host_steps = host_state[:4]
        self.device_master, self.device_exp_avg, self.device_exp_avg_sq, self.device_steps = (
            device_rows[:4]
        )
        if self.has_staged:
            self.device_stage = device_rows[4]
            self.host_stage = self._host(host_state[4][self.k_local :])
            if self.accumulate_on_device:
                self.host_stage = self.host_stage.to(self.param.device)
            self.score_parts = []
        return to_host, to_device

    def ship_window_sum(self) -> torch.Tensor:
        """``accumulate_on_device``: the window's sum, in the parameter's dtype, on the host;
        the device accumulator starts the next window at zero."""
        window_sum = self.accumulator.to("cpu", self.param.dtype, copy=True)
        self.accumulator.zero_()
        return window_sum

    # Writing updated values into the parameter the model computes with.

    def write_selected(self) -> int:
        """Copy the selected rows' new values into the parameter; returns the bytes that
        crossed to the device (only with ``offload``)."""
        values = self.device_master.t().to(self.param.device, self.param.dtype)
        as_matrix(self.param.data).index_copy_(1, self.order[: self.k], values)
        return self.offload * values.numel() * values.element_size()

    def write_unselected(self) -> int:
        """Send this rank's unselected host rows, gathered from every rank, into the parameter;
        returns the bytes received by the device."""
        mine = self.host_master[self.k_local :].to(self.param.dtype)
        rows = self.comm.all_gather_rows(mine, self.unselected_counts)
        # Synchronous: with fp32 weights ``rows`` may be the host master itself, which the next
        # (overlapped) CPU update starts rewriting as soon as this returns.
        as_matrix(self.param.data).index_copy_(
            1, self.order[self.k :], rows.to(self.param.device).t()
        )
        return rows.numel() * rows.element_size()

    def load(self, order, local_order, k: int, k_local: int, counts, host: list, device: list):
        """Adopt saved state (as ``ZenFlowAdamW.state_dict`` lists it)."""
        self.k, self.k_local = k, k_local
        self.order = order.to(self.param.device)
        self.local_order = local_order.clone()
        self.unselected_counts = list(counts)
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
