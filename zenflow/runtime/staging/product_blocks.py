"""A step's gradient products for device-side sums, written side by side and put in order at once.

With device-side sums a weight's rows stay on its device, in the layout's order (the selected
columns first) and in fp32. Formed weight by weight in the backward, that order took three
operations per weight: the product, a gather of its rows, a conversion; on a GPU three kernel
launches and their host time, inside the backward the device waits on. Here the backward's
hand-over is the product alone (as torch's own backward forms a weight's gradient), written in
natural column order into the weight's region of a block it shares with other weights of its
device, dtype and row width, and the step puts every weight's rows in order with one gather
and one conversion per block.

Blocks are bounded (``max_block_bytes``), and a weight joins the last block of its kind at its
first product (the backward's order), so that each block is made when the backward reaches its
first weight: while the backward runs, the blocks hold at most one block's bytes more than the
bf16 products handed over so far, which is half of what the fp32 rows formed one by one held.
Each block is dropped once gathered.

Only a step's first micro-batch of a weight goes through a block: later ones add into the
rows the first formed (``DeviceSumStaging``), which a block's gather has to give them first.
"""

import numpy as np
import torch

from zenflow.runtime.streams import sent_to

# A few per model of a few hundred million parameters: a gather and a conversion each.
MAX_BLOCK_BYTES = 64 * 2**20


class _Block:
    """Products of one device, dtype and row width: each member's region (``offsets``,
    assigned at its first product and kept), the rows they take (``rows``), this step's
    products (``products``: made at the first product of a step, dropped once gathered), the
    members whose product is there and not yet gathered (``pending``), and the gather index
    of the last list of members gathered and their layouts."""

    def __init__(self, key: tuple):
        self.key = key
        self.device, self.dtype, self.width = key
        self.offsets: dict = {}
        self.rows = 0
        self.products: torch.Tensor | None = None
        self.pending: list = []
        self._index_of: tuple[list, list, torch.Tensor] | None = None

    def fits(self, member, max_bytes: int) -> bool:
        """Whether ``member`` may join (an empty block takes any)."""
        size = (self.rows + member.layout.columns) * self.width * self.dtype.itemsize
        return self.rows == 0 or size <= max_bytes

    def add(self, member) -> None:
        if self.pending:
            self.gather()  # the block is made again, larger
        self.products = None
        self.offsets[member] = self.rows
        self.rows += member.layout.columns

    def region(self, member) -> torch.Tensor:
        if self.products is None:
            shape = (self.rows, self.width)
            self.products = torch.empty(shape, dtype=self.dtype, device=self.device)
        self.pending.append(member)
        offset = self.offsets[member]
        return self.products[offset : offset + member.layout.columns]

    def index(self, members: list) -> torch.Tensor:
        """The rows of ``members``, each in its layout's order, as one gather index into the
        block (made on the host and sent once per list of members and their layouts)."""
        layouts = [m.layout for m in members]
        cached = self._index_of
        # Members and layouts compare by identity (neither defines equality).
        if cached is not None and cached[0] == members and cached[1] == layouts:
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
        """Every pending member's rows in its layout's order, fp32, handed to it as its
        selected and unselected rows."""
        members, self.pending = self.pending, []
        products, self.products = self.products, None
        ordered = torch.index_select(products, 0, self.index(members)).float()
        # Split at once into each member's two parts, not into its rows and then again.
        counts = []
        for m in members:
            counts += (m.layout.k, m.layout.columns - m.layout.k)
        parts = ordered.split(counts)
        offset = 0
        for i, member in enumerate(members):
            member.take_product_rows(parts[2 * i], parts[2 * i + 1], ordered, offset)
            offset += member.layout.columns


class ProductBlocks:
    """Owns the blocks of one optimizer's weights with device-side sums, each kind's (device,
    dtype, row width) in the order they were made, and which block each member's product
    goes to. Members: objects with a ``layout`` and ``take_product_rows(selected,
    unselected, rows, offset)`` (a weight's ``DeviceSumStaging``; ``rows``: the gathered
    block its two parts are views of, from row ``offset``)."""

    def __init__(self, max_block_bytes: int = MAX_BLOCK_BYTES):
        self.max_block_bytes = max_block_bytes
        self._blocks: dict[tuple, list[_Block]] = {}
        self._block_of: dict = {}  # member -> its block

    def region(self, member, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Where ``member``'s product (``[columns, width]``, natural column order, a row per
        column of its layout) goes this step; it is pending until ``gather()`` hands its rows
        over."""
        key = (device, dtype, width)
        block = self._block_of.get(member)
        if block is None or block.key != key:
            kind = self._blocks.setdefault(key, [])
            if not kind or not kind[-1].fits(member, self.max_block_bytes):
                kind.append(_Block(key))
            block = self._block_of[member] = kind[-1]
            block.add(member)
        return block.region(member)

    def gather(self) -> None:
        """Every pending member's rows handed to it, one gather and conversion per block."""
        for kind in self._blocks.values():
            for block in kind:
                if block.pending:
                    block.gather()

    def drop(self, member) -> None:
        """``member``'s product is not wanted (its gradient was discarded)."""
        block = self._block_of.get(member)
        if block is not None and member in block.pending:
            block.pending.remove(member)
