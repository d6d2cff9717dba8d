"""Data-parallel collectives for ZenFlow's ZeRO-1/2 partitions, over ``torch.distributed``.

Gradients are averaged across ranks. Host state is partitioned by whole columns: each rank owns
a contiguous block of every weight's columns. Row chunks that differ in size between ranks are
padded to the largest, so the equal-size collectives (reduce-scatter and all-gather of one
tensor, ``REDUCE_SCATTER`` and ``ALL_GATHER``) serve them; gloo (CPU) and NCCL (GPU) both
provide those. With one process every call is the identity.

A collective that fails (a peer rank died, or did not join within the process group's timeout,
which gloo and NCCL both enforce) raises ``CollectiveError`` naming the collective.
"""

import time

import torch
import torch.distributed as dist

from zenflow.runtime.host_sync import HostSync
from zenflow.runtime.streams import sent_to

# torch 2.13 renamed the equal-size collectives (``reduce_scatter_single``,
# ``all_gather_single``) and the old names warn that they are deprecated; earlier releases have
# only the old names. Looked up by name at each call, where a test may count them.
REDUCE_SCATTER = (
    "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
)
ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


class CollectiveError(RuntimeError):
    """A collective failed: a peer rank died or did not respond within the timeout."""


def run_collective(name: str, world_size: int, collective, *args, **kwargs) -> None:
    """``collective(*args, **kwargs)``, raising CollectiveError if it fails."""
    started = time.monotonic()
    try:
        collective(*args, **kwargs)
    except RuntimeError as error:  # torch.distributed's DistError and backend errors
        raise CollectiveError(
            f"{name} across {world_size} ranks failed after {time.monotonic() - started:.1f} s: "
            f"{error}. A peer rank has probably died or stopped responding (collectives give up "
            "after the process group's timeout: process_group_timeout_s in the engine config); "
            "restart every rank and resume from the last checkpoint"
        ) from error


# Set by _route_host_tensors_for_tests: the device host tensors cross through, as with NCCL.
_host_tensors_via_for_tests: torch.device | None = None


class DataParallel:
    """One optimizer's data-parallel group: its ZeRO stage, world size and rank, and the
    device host tensors cross through for a backend that moves device tensors only. Counts
    the host's reads of collectives' results with ``sync`` (the optimizer's)."""

    def __init__(self, zero_stage: int = 2, group=None, sync: HostSync | None = None):
        if zero_stage not in (1, 2):
            raise ValueError(f"zero_stage must be 1 or 2, got {zero_stage}")
        self.zero_stage = zero_stage
        self.group = group
        self.sync = HostSync() if sync is None else sync
        distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(group) if distributed else 1
        self.rank = dist.get_rank(group) if distributed else 0
        # NCCL moves device tensors only: host tensors (scores, energies, host rows) cross
        # through the current GPU. gloo takes both.
        self._host_tensors_via = _host_tensors_via_for_tests if distributed else None
        if distributed and "gloo" not in str(dist.get_backend(group)):
            self._host_tensors_via = torch.device("cuda", torch.cuda.current_device())

    def _collective_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._host_tensors_via is not None and tensor.device.type == "cpu":
            return sent_to(tensor.clone(), self._host_tensors_via)
        return tensor

    def block(self, columns: int, rank: int | None = None) -> tuple[int, int]:
        """The natural column range ``[lo, hi)`` whose host state ``rank`` owns."""
        rank = self.rank if rank is None else rank
        return rank * columns // self.world_size, (rank + 1) * columns // self.world_size

    def all_reduce_mean_(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            self.all_reduce_sum_(tensor)
            tensor /= self.world_size
        return tensor

    def _all_reduced(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over ranks where the collective runs (``tensor`` itself, summed
        in place, unless a host tensor crossed to the collective's device)."""
        work = self._collective_tensor(tensor)
        run_collective("all_reduce", self.world_size, dist.all_reduce, work, group=self.group)
        return work

    def all_reduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            work = self._all_reduced(tensor)
            if work is not tensor:
                tensor.copy_(self._on_device_of(work, tensor))
        return tensor

    def _on_device_of(self, result: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """A collective's ``result`` on ``like``'s device. A host tensor's result that NCCL
        computed on the GPU is read back through the counted helper: the host waits for it."""
        if result.device == like.device:
            return result
        if like.device.type == "cpu":
            (result,) = self.sync.to_host([result])
            return result
        return result.to(like.device)

    def sum_over_ranks(self, parts: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        """Each of ``parts`` (1-D, fp32, on the host or ``device``) summed over ranks, on
        ``device``, in one collective for all of them. Nothing crosses back to the host: with
        NCCL a host part is reduced on the GPU and stays there."""
        if not parts:
            return []
        device = torch.device(device)
        total = torch.cat([sent_to(part, device) for part in parts])
        if self.world_size > 1:
            total = self._all_reduced(total).to(device)
        return list(total.split([part.numel() for part in parts]))

    def host_sums(self, values: torch.Tensor) -> list[float]:
        """``values`` (1-D, on the host) summed over ranks, as Python numbers. At one rank a
        read of host memory; at several the host reads the collective's result: one counted
        synchronization, wherever the collective ran."""
        if self.world_size == 1:
            return HostSync.host_values(values)
        return self.sync.values([self._all_reduced(values.clone())])[0]

    def gather_objects(self, value) -> list:
        """``value`` (small, picklable) of every rank, in rank order: for what ranks decide
        together once, when the optimizer is built. The host reads the collective's result:
        one counted synchronization."""
        if self.world_size == 1:
            return [value]
        gathered = [None] * self.world_size
        self.sync.around(
            lambda: run_collective(
                "all_gather_object",
                self.world_size,
                dist.all_gather_object,
                gathered,
                value,
                group=self.group,
            )
        )
        return gathered

    def _padded(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``rows`` (the concatenation of chunks of ``counts`` rows) as equal chunks."""
        width = max(counts)
        padded = rows.new_zeros(self.world_size * width, *rows.shape[1:])
        start = 0
        for r, count in enumerate(counts):
            padded[r * width : r * width + count] = rows[start : start + count]
            start += count
        return padded

    def reduce_scatter_mean(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """This rank's chunk of the mean over ranks of ``rows`` (chunk r has ``counts[r]`` rows).

        Stage 2 reduce-scatters, so no rank holds the whole reduced gradient; stage 1
        all-reduces everything and keeps its chunk.
        """
        start = sum(counts[: self.rank])
        mine = slice(start, start + counts[self.rank])
        if self.world_size == 1:
            return rows[mine]
        if self.zero_stage == 1:
            return self.all_reduce_mean_(rows.clone())[mine]
        width = max(counts)
        padded = self._collective_tensor(self._padded(rows, counts))
        out = padded.new_empty(width, *rows.shape[1:])
        run_collective(
            "reduce_scatter",
            self.world_size,
            getattr(dist, REDUCE_SCATTER),
            out,
            padded,
            group=self.group,
        )
        return self._on_device_of(out[: counts[self.rank]] / self.world_size, rows).contiguous()

    def all_gather_rows(self, mine: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Every rank's chunk, concatenated in rank order."""
        if self.world_size == 1:
            return mine
        width = max(counts)
        local = self._collective_tensor(mine.new_zeros(width, *mine.shape[1:]))
        local[: counts[self.rank]] = mine
        gathered = local.new_empty(self.world_size * width, *mine.shape[1:])
        run_collective(
            "all_gather",
            self.world_size,
            getattr(dist, ALL_GATHER),
            gathered,
            local,
            group=self.group,
        )
        chunks = [gathered[r * width : r * width + c] for r, c in enumerate(counts)]
        return self._on_device_of(torch.cat(chunks), mine)


def _route_host_tensors_for_tests(device: torch.device | None) -> None:
    """Groups created from now on send host tensors through ``device`` as they would through
    the GPU with NCCL (copied there for the collective, results copied back), with another
    backend: NCCL's path for host tensors, tested with gloo and the CPU standing in."""
    global _host_tensors_via_for_tests
    _host_tensors_via_for_tests = device
