"""Byte-level text that every Python install already has, so the demo downloads nothing.

* Pre-training: the standard library's own ``*.py`` sources (code).
* Fine-tuning: ``pydoc_data.topics``, the English prose behind ``help("topics")``.

Both are read in a fixed order, so the same install always yields the same bytes.
"""

import pydoc_data.topics
import sysconfig
from pathlib import Path

import torch


def stdlib_source_bytes(max_bytes: int = 3_000_000) -> bytes:
    """The stdlib's Python sources, sorted by path and cut at ``max_bytes``.

    site-packages lives under the stdlib directory but differs between installs: skipped."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    chunks, size = [], 0
    for path in paths:
        if size >= max_bytes:
            break
        chunks.append(path.read_bytes())
        size += len(chunks[-1])
    return b"\n".join(chunks)[:max_bytes]


def topics_prose_bytes() -> bytes:
    """The pydoc help topics joined in sorted-key order (UTF-8)."""
    topics = pydoc_data.topics.topics
    return "\n\n".join(topics[key] for key in sorted(topics)).encode("utf-8")


def train_val_split(data: bytes, val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """Head for training, tail for validation: deterministic and without overlap."""
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    cut = int(len(tokens) * (1 - val_fraction))
    return tokens[:cut], tokens[cut:]


class BatchSampler:
    """Random windows of ``block_size + 1`` bytes; inputs and next-byte targets.

    Its own seeded generator makes the batch sequence reproducible and independent of any other
    use of torch's global RNG (model init, dropout), so two runs can see identical batches."""

    def __init__(self, tokens: torch.Tensor, block_size: int, batch_size: int, seed: int):
        assert len(tokens) > block_size + 1, "text shorter than one block"
        self.tokens = tokens
        self.block_size = block_size
        self.batch_size = batch_size
        self.generator = torch.Generator().manual_seed(seed)

    def next_batch(self, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(
            len(self.tokens) - self.block_size - 1, (self.batch_size,), generator=self.generator
        )
        offsets = torch.arange(self.block_size + 1)
        windows = self.tokens[starts[:, None] + offsets]
        return windows[:, :-1].to(device), windows[:, 1:].to(device)

    def state_dict(self) -> dict:
        """Where the batch sequence stands, for checkpoints: a resumed run sees the same batches."""
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
