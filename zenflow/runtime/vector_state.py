"""A 1-D parameter's AdamW state: fp32 on its device, updated every step."""

from dataclasses import dataclass, field

import torch


@dataclass
class VectorState:
    """Owns one 1-D parameter's fp32 master value, moments (one row each, ``[1, n]``) and step
    count (``[1]``), beside the parameter on its device, and for a 16-bit parameter the fp32
    copy of its gradient that the step reads (``fp32_gradients``), kept from step to step."""

    param: torch.Tensor
    group_index: int
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    steps: torch.Tensor
    _gradient_copy: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def of(cls, param: torch.Tensor, group_index: int) -> "VectorState":
        master = param.detach().float().reshape(1, -1).clone()
        steps = torch.zeros(1, dtype=torch.int64, device=param.device)
        return cls(
            param, group_index, master, torch.zeros_like(master), torch.zeros_like(master), steps
        )

    def tensors(self) -> list[torch.Tensor]:
        return [self.master, self.exp_avg, self.exp_avg_sq, self.steps]

    def gradient_copy(self) -> torch.Tensor:
        """The kept fp32 row a 16-bit gradient is converted into."""
        if self._gradient_copy is None:
            self._gradient_copy = torch.empty_like(self.master)
        return self._gradient_copy

    def load(self, saved: list[torch.Tensor]) -> None:
        for mine, theirs in zip(self.tensors(), saved, strict=True):
            mine.copy_(theirs)


def fp32_gradients(vectors: list[VectorState]) -> list[torch.Tensor]:
    """Each vector's gradient as an fp32 row ``[1, n]``: an fp32 one as it is, the others
    converted into copies the vectors keep, all of them in one multi-tensor copy (a model has
    a few hundred biases and norms: a conversion each would be as many kernel launches on a
    GPU)."""
    rows, copies, converted = [], [], []
    for v in vectors:
        grad = v.param.grad.reshape(1, -1)
        if grad.dtype == torch.float32:
            rows.append(grad)
            continue
        copy = v.gradient_copy()
        rows.append(copy)
        copies.append(copy)
        converted.append(grad)
    if copies:
        torch._foreach_copy_(copies, converted)
    return rows
