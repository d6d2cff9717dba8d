"""One weight's ZenFlow state, split by columns between the device and the host.

Layout: every per-column quantity is kept as *rows* of a ``[columns, out]`` matrix (the weight
transposed, so each column is contiguous) in *column order*: ``order[:k]`` are the selected
columns, ``order[k:]`` the rest. The host holds fp32 master, moments and per-column step counts
for all columns (rows ``[:k]`` are stale while those columns live on the device); the device
holds the same for the ``k`` selected rows. Reselection moves state between the two, it never
resets it.
"""

import torch

from zenflow.columns import as_matrix, column_count
from zenflow.runtime import registry


class SplitWeight:
    def __init__(self, param: torch.Tensor, group_index: int, pin_memory: bool):
        self.param = param
        self.group_index = group_index
        self.out = param.shape[0]
        self.columns = column_count(param.shape)
        self.pin_memory = pin_memory and param.device.type == "cuda"
        self.k = 0
        self.order = torch.arange(self.columns, device=param.device)
        rows = as_matrix(param.detach()).t().float().cpu()
        self.host_master = self._host(rows)
        self.host_exp_avg = self._host(torch.zeros_like(rows))
        self.host_exp_avg_sq = self._host(torch.zeros_like(rows))
        self.host_steps = torch.zeros(self.columns, dtype=torch.int64)
        self.device_master = self.device_exp_avg = self.device_exp_avg_sq = None
        self.device_steps = None
        self._empty_device_state()
        self.accumulator: torch.Tensor | None = None
        self.spare_accumulator: torch.Tensor | None = None
        self.in_window = False
        self.last_grad: torch.Tensor | None = None
        self.discard_staged()
        self.slot = registry.register(param, self)

    def _host(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.contiguous()
        return tensor.pin_memory() if self.pin_memory else tensor

    def _empty_device_state(self) -> None:
        empty = torch.empty(0, self.out, device=self.param.device)
        self.device_master, self.device_exp_avg, self.device_exp_avg_sq = (
            empty,
            empty.clone(),
            empty.clone(),
        )
        self.device_steps = torch.empty(0, dtype=torch.int64, device=self.param.device)

    # The runtime side of zenflow.ops: called from compiled backward graphs (or eagerly).

    def column_order(self) -> torch.Tensor:
        return self.order

    def stage(self, rows: torch.Tensor) -> None:
        """Keep this micro-batch's gradient rows until the step commits them.

        Copies: a compiled graph may reuse ``rows``' storage as soon as this returns.
        """
        selected, unselected = rows[: self.k], rows[self.k :]
        if self.micro_batches == 0:
            self.device_stage = selected.to(torch.float32, copy=True)
            self.host_stage = torch.empty(
                unselected.shape, dtype=rows.dtype, pin_memory=self.pin_memory
            )
            self.host_stage.copy_(unselected, non_blocking=self.pin_memory)
        else:
            self.device_stage += selected
            if self.host_stage.dtype != torch.float32:
                self.host_stage = self.host_stage.float()
            self.host_stage += unselected.to("cpu", torch.float32)
        self.micro_batches += 1
        self.staged_bytes += unselected.numel() * rows.element_size()

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
        self.micro_batches = 0
        self.score_parts = []
        self.staged_bytes = 0

    @property
    def has_staged(self) -> bool:
        return self.micro_batches > 0

    def staged_scores(self) -> torch.Tensor:
        """Squared column norms of the staged (summed) gradient, in column order, fp32 on host.

        With one micro-batch the graph already computed them next to the gradient; after
        accumulation they are taken from the sum, since norms of parts do not add up.
        """
        if self.micro_batches == 1 and len(self.score_parts) == 1:
            return self.score_parts[0].float().cpu()
        device_part = self.device_stage.square().sum(1).cpu()
        host_part = self.host_stage.float().square().sum(1)
        return torch.cat([device_part, host_part])

    # Selection and migration.

    def _device_rows_bytes(self) -> int:
        """Bytes of the device-resident rows: master, moments, staged gradient (fp32) and steps."""
        return self.k * (self.out * 4 * 4 + 8)

    def reselect(self, selected_columns: torch.Tensor) -> tuple[int, int]:
        """Adopt a new selection (ascending natural column indices), moving state and staged
        gradient rows to where the new order puts them. Returns the bytes moved (to the host,
        to the device)."""
        to_host = self._device_rows_bytes()
        self._return_device_state()
        selected_columns = selected_columns.cpu()
        is_selected = torch.zeros(self.columns, dtype=torch.bool)
        is_selected[selected_columns] = True
        new_order = torch.cat([selected_columns, (~is_selected).nonzero().flatten()])
        position = torch.empty(self.columns, dtype=torch.int64)
        position[self.order.cpu()] = torch.arange(self.columns)
        moved = position[new_order]
        for name in ("host_master", "host_exp_avg", "host_exp_avg_sq"):
            setattr(self, name, self._host(getattr(self, name)[moved]))
        self.host_steps = self.host_steps[moved]
        if self.has_staged:
            full = torch.cat([self.device_stage.cpu(), self.host_stage.float()])[moved]
        self.k = selected_columns.numel()
        self.order = new_order.to(self.param.device)
        device = self.param.device
        self.device_master = self.host_master[: self.k].to(device, copy=True)
        self.device_exp_avg = self.host_exp_avg[: self.k].to(device, copy=True)
        self.device_exp_avg_sq = self.host_exp_avg_sq[: self.k].to(device, copy=True)
        self.device_steps = self.host_steps[: self.k].to(device, copy=True)
        if self.has_staged:
            self.device_stage = full[: self.k].to(device)
            self.host_stage = self._host(full[self.k :])
            self.score_parts = []
        return to_host, self._device_rows_bytes()

    def _return_device_state(self) -> None:
        if self.k == 0:
            return
        self.host_master[: self.k] = self.device_master.cpu()
        self.host_exp_avg[: self.k] = self.device_exp_avg.cpu()
        self.host_exp_avg_sq[: self.k] = self.device_exp_avg_sq.cpu()
        self.host_steps[: self.k] = self.device_steps.cpu()

    def load(self, order, k: int, host: list, device: list) -> None:
        """Adopt saved state (``order``, ``k``, host and device tensors as state_dict lists)."""
        self.k = k
        self.order = order.to(self.param.device)
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

    # Writing updated values into the parameter the model computes with.

    def write_selected(self) -> None:
        as_matrix(self.param.data).index_copy_(
            1, self.order[: self.k], self.device_master.t().to(self.param.dtype)
        )

    def write_unselected(self, values: torch.Tensor) -> int:
        """Copy host rows ``[k:]`` (fp32 master or its 16-bit copy) into the parameter; returns
        the bytes sent to the device."""
        rows = values.to(self.param.device, non_blocking=self.pin_memory)
        as_matrix(self.param.data).index_copy_(
            1, self.order[self.k :], rows.t().to(self.param.dtype)
        )
        return values.numel() * values.element_size()
