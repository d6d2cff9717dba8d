"""A step's gradient products for device-side sums, written side by side and put in order at once.

With device-side sums a weight's rows stay on its device, in the layout's order (the selected
columns first) and in fp32. Formed weight by weight in the backward, that order took three
operations per weight: the product, a gather of its rows, a conversion; on a GPU three kernel
launches and their host time, inside the backward the device waits on. Here the backward's
hand-over is the product alone, written in natural column order into the member's region of a
block that every weight of one device, dtype and row width shares (as torch's own backward
forms a weight's gradient: one product), and the step puts every member's rows in order with
one gather and one conversion per block.

Only a step's first micro-batch of a weight goes through a block: later ones add into the
rows the first formed (``DeviceSumStaging``), which a block's gather has to give them first.

The price is memory: a block holds its weights' products (2 bytes per parameter in bf16) from
the first of them in the backward until the step's gather, while formed one by one the
weights' fp32 rows grew through the backward as the activations it frees shrank. Each block
is dropped as soon as it is gathered, so the step's peak is the fp32 rows and the blocks not
yet gathered.
"""

import numpy as np
import torch

from zenflow.runtime.streams import sent_to


class _Block:
    """One device, dtype and row width: each member's region (``offsets``, assigned at its
    first product and kept), the rows they take (``rows``), this step's block of products
    (``products``: made at the first product of a step, dropped once gathered), the members
    whose product is in it and not yet gathered (``pending``), and the gather index of the
    last set of pending members and their layouts."""

    def __init__(self, dtype: torch.dtype, device: torch.device, width: int):
        self.dtype, self.device, self.width = dtype, device, width
        self.offsets: dict = {}
        self.rows = 0
        self.products: torch.Tensor | None = None
        self.pending: list = []
        self._index_of: tuple[list, list, torch.Tensor] | None = None

    def index(self, members: list) -> torch.Tensor:
        """The rows of ``members``, each in its layout's order, as one gather index into the
        block (made on the host and sent once per list of members and their layouts)."""
        layouts = [m.layout for m in members]
        cached = self._index_of
        if (
            cached is not None
            and len(cached[0]) == len(members)
            and all(a is b for a, b in zip(cached[0], members, strict=True))
            and all(a is b for a, b in zip(cached[1], layouts, strict=True))
        ):
            return cached[2]
        # In numpy on the host: a torch operation per member here would be a dispatch per
        # weight at every step after a reselection.
        host = torch.device("cpu")
        parts = [
            layout.on(host, "order").numpy() + self.offsets[m]
            for m, layout in zip(members, layouts, strict=True)
        ]
        index = sent_to(torch.from_numpy(np.concatenate(parts)), self.device)
        self._index_of = (members, layouts, index)
        return index

    def gather(self) -> None:
        """Every pending member's rows in its layout's order, fp32, handed to it."""
        members, self.pending = self.pending, []
        products, self.products = self.products, None
        ordered = torch.index_select(products, 0, self.index(members)).float()
        counts = [m.layout.columns for m in members]
        for member, rows in zip(members, ordered.split(counts), strict=True):
            member.take_product_rows(rows)


class ProductBlocks:
    """Owns the blocks of one optimizer's device-side-sum weights, by (device, dtype, width).
    Members: objects with a ``layout`` and ``take_product_rows(rows)`` (a weight's
    ``DeviceSumStaging``)."""

    def __init__(self):
        self._blocks: dict[tuple, _Block] = {}

    def region(
        self, member, columns: int, width: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """Where ``member``'s product (``[columns, width]``, natural column order) goes this
        step; it is pending until ``gather()`` hands its rows over."""
        key = (device, dtype, width)
        block = self._blocks.get(key)
        if block is None:
            block = self._blocks[key] = _Block(dtype, device, width)
        offset = block.offsets.get(member)
        if offset is None:
            if block.products is not None and block.pending:
                block.gather()  # a new member: the block is made again, larger
            block.products = None
            offset = block.offsets[member] = block.rows
            block.rows += columns
        if block.products is None:
            block.products = torch.empty(block.rows, width, dtype=dtype, device=device)
        block.pending.append(member)
        return block.products[offset : offset + columns]

    def gather(self) -> None:
        """Every pending member's rows handed to it, one gather and conversion per block."""
        for block in self._blocks.values():
            if block.pending:
                block.gather()

    def drop(self, member) -> None:
        """``member``'s product is not wanted (its gradient was discarded)."""
        for block in self._blocks.values():
            if member in block.pending:
                block.pending.remove(member)
