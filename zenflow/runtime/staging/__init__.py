"""Gradient staging: one strategy per way a weight's gradient travels from backward to the step.

==========================  =================================================================
strategy                    when
==========================  =================================================================
``HostBlockStaging``        one process, the weight on the CPU, window sums on the host
``CopyStreamStaging``       one process, the weight on a GPU, window sums on the host
``ReduceScatterStaging``    several ranks, ZeRO stage 2
``ReduceAtStepStaging``     several ranks, ZeRO stage 1
``DeviceSumStaging``        ``accumulate_on_device`` (one process)
==========================  =================================================================

The strategy is chosen once, when the optimizer takes the weight (``staging_for``); their shared
interface and the order of its calls: ``zenflow.runtime.staging.base``.
"""

import torch

from zenflow.runtime.comm import DataParallel
from zenflow.runtime.host_sync import HostSync
from zenflow.runtime.layout import ColumnLayout
from zenflow.runtime.staging.base import Staging
from zenflow.runtime.staging.copy_stream import CopyStreamStaging
from zenflow.runtime.staging.device_sum import DeviceSumStaging
from zenflow.runtime.staging.host_block import HostBlockStaging
from zenflow.runtime.staging.product_blocks import ProductBlocks
from zenflow.runtime.staging.reduce_at_step import ReduceAtStepStaging
from zenflow.runtime.staging.reduce_scatter import ReduceScatterStaging

__all__ = ["ProductBlocks", "Staging", "staging_for"]

_copy_stream_for_cpu_weights = False


def staging_for(
    param: torch.Tensor,
    layout: ColumnLayout,
    comm: DataParallel,
    *,
    pin: bool,
    offload: bool,
    accumulate_on_device: bool,
    sync: HostSync,
    products: ProductBlocks | None = None,
) -> Staging:
    """The strategy for ``param`` (see the table in the module docstring). ``products``: the
    blocks the optimizer's weights with device-side sums share (a new one where not given)."""
    if accumulate_on_device and comm.world_size > 1:
        raise ValueError(
            "accumulate_on_device needs a single process: with several ranks the window's "
            "sum would need its own reduction; turn it off or run on one rank"
        )
    if accumulate_on_device:
        strategy = DeviceSumStaging
    elif comm.world_size > 1:
        strategy = ReduceScatterStaging if comm.zero_stage == 2 else ReduceAtStepStaging
    elif param.device.type == "cpu" and not _copy_stream_for_cpu_weights:
        strategy = HostBlockStaging
    else:
        strategy = CopyStreamStaging
    out = param.shape[0]
    if strategy is DeviceSumStaging:
        products = ProductBlocks() if products is None else products
        return strategy(layout, out, param.device, comm, pin, offload, sync, products=products)
    return strategy(layout, out, param.device, comm, pin, offload, sync)


def _stage_like_a_gpu_weight_for_tests(enabled: bool) -> None:
    """Weights on the CPU created from now on stage through the copy stream, as a weight on a
    GPU does (the stream's CPU twin, a worker thread), instead of into host blocks."""
    global _copy_stream_for_cpu_weights
    _copy_stream_for_cpu_weights = enabled
