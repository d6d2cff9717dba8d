"""Tensors of several weights kept side by side in one flat buffer, so that one copy, one
collective or one multi-tensor kernel serves them all: which of them can share a buffer
(``indices_by``), how large it is (``elements``) and each one's view of it (``views``)."""

import math
from collections.abc import Hashable, Iterable, Sequence

import torch


def indices_by(keys: Iterable[Hashable]) -> dict[Hashable, list[int]]:
    """The positions of equal keys (a device, a dtype, both), grouped in order of first
    appearance."""
    groups: dict[Hashable, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    return groups


def elements(shapes: Iterable[Sequence[int]]) -> int:
    """The size of a flat buffer holding tensors of ``shapes`` side by side."""
    return sum(math.prod(shape) for shape in shapes)


def views(flat: torch.Tensor, shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """``flat``'s consecutive parts as tensors of ``shapes`` (views of it)."""
    sizes = [math.prod(shape) for shape in shapes]
    return [part.view(shape) for part, shape in zip(flat.split(sizes), shapes, strict=True)]
