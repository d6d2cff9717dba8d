"""A 1-D parameter's AdamW state: fp32 on its device, updated every step."""

from dataclasses import dataclass, field

import torch


@dataclass
class VectorState:
    """Owns one 1-D parameter's fp32 master value, moments (one row each, ``[1, n]``) and step
    count (``[1]``), beside the parameter on its device (views of the device update's blocks
    once it packed them: ``zenflow.runtime.packed_rows``), and a view of the parameter as one
    row (``param_row()``)."""

    param: torch.Tensor
    group_index: int
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    steps: torch.Tensor
    _param_row: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def of(cls, param: torch.Tensor, group_index: int) -> "VectorState":
        master = param.detach().float().reshape(1, -1).clone()
        steps = torch.zeros(1, dtype=torch.int64, device=param.device)
        return cls(
            param, group_index, master, torch.zeros_like(master), torch.zeros_like(master), steps
        )

    def tensors(self) -> list[torch.Tensor]:
        return [self.master, self.exp_avg, self.exp_avg_sq, self.steps]

    def device_rows(self) -> list[torch.Tensor]:
        return self.tensors()

    def bind_device_rows(self, rows: list[torch.Tensor]) -> None:
        """Take ``rows`` (the same values, kept elsewhere) as this state."""
        self.master, self.exp_avg, self.exp_avg_sq, self.steps = rows

    def gradient_shape(self) -> torch.Size:
        """The shape of the gradient the device update takes (``.grad`` as it is)."""
        return self.param.shape

    def param_row(self) -> torch.Tensor:
        """The parameter's values as one row ``[1, n]``, where the device update writes them:
        kept from step to step, as long as the parameter keeps its memory (a new view per
        1-D parameter and step would be hundreds of Python objects per step for a GPT)."""
        row = self._param_row
        if row is None or row.data_ptr() != self.param.data_ptr() or row.dtype != self.param.dtype:
            row = self._param_row = self.param.detach().view(1, -1)
        return row

    def load(self, saved: list[torch.Tensor]) -> None:
        for mine, theirs in zip(self.tensors(), saved, strict=True):
            mine.copy_(theirs)
