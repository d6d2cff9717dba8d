"""What a step hands on for the window's sum: its unselected rows in one of three forms.

``HostRows``: rows on the host (a tensor, or ``GatheredRows`` read in place from a block in
natural column order), with ``release`` giving their block back to the staging once whoever
reads them is done (None: nothing to give back). ``DeviceRows``: fp32 rows on the weight's
device (device-side sums). ``Factors``: a small batch's matmul factors, ``G.T == x.T @ dy``,
whose unselected rows (``x``'s columns ``host_columns``) are a product formed when needed.
"""

from collections.abc import Callable
from typing import NamedTuple

import torch

from zenflow.runtime.cpu_adam import GatheredRows


class HostRows(NamedTuple):
    rows: torch.Tensor | GatheredRows
    release: Callable[[], None] | None


class DeviceRows(NamedTuple):
    rows: torch.Tensor


class Factors(NamedTuple):
    x: torch.Tensor  # [batch, columns], fp32
    dy: torch.Tensor  # [batch, out], fp32
    host_columns: torch.Tensor

    def rows(self) -> torch.Tensor:
        """The unselected rows themselves, ``[host columns, out]``."""
        return self.x.index_select(1, self.host_columns).t() @ self.dy


Contribution = HostRows | DeviceRows | Factors


def as_tensor(contribution: Contribution) -> torch.Tensor:
    """The rows as one tensor in host row order (gathered, or multiplied, if they are not)."""
    if isinstance(contribution, Factors):
        return contribution.rows()
    rows = contribution.rows
    if isinstance(rows, GatheredRows):
        return rows.source.index_select(0, rows.index)
    return rows
