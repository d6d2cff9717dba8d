"""What a "column" is and how ZenFlow picks the important ones.

A weight of shape ``[out, d1, d2, ...]`` is seen as a matrix ``[out, d1 * d2 * ...]``; its
columns are the input channels (dim 1 of an ``nn.Linear`` weight). Tensors with fewer than two
dimensions have no columns: ZenFlow updates them on the device every step.
"""

import math

import torch


def has_columns(param: torch.Tensor) -> bool:
    return param.dim() >= 2


def as_matrix(tensor: torch.Tensor) -> torch.Tensor:
    """The ``[out, columns]`` view of a weight (or of its gradient)."""
    return tensor.reshape(tensor.shape[0], -1)


def column_rows(tensor: torch.Tensor) -> torch.Tensor:
    """The ``[columns, out]`` view of a weight: row ``j`` is column ``j``."""
    return as_matrix(tensor).t()


def column_count(shape: torch.Size | tuple[int, ...]) -> int:
    return math.prod(shape[1:])


def topk_count(topk_ratio: float, columns: int) -> int:
    """k = 0 for topk_ratio 0 (plain offload), else max(1, floor(topk_ratio * columns)).

    The small epsilon keeps ratios such as 0.29 * 100 = 28.999999999999996 from losing a column
    to binary floating point.
    """
    if topk_ratio <= 0.0 or columns == 0:
        return 0
    return min(columns, max(1, math.floor(topk_ratio * columns + 1e-9)))


def column_importance(grad: torch.Tensor) -> torch.Tensor:
    """Per-column squared L2 norm ``s_j = sum_i G[i, j]^2`` in fp32."""
    g = as_matrix(grad).float()
    return (g * g).sum(dim=0)


def select_top_columns(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k highest scores, ascending; ties go to the lower column index."""
    order = torch.sort(scores, descending=True, stable=True).indices
    return order[:k].sort().values
