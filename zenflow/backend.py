"""The ``zenflow`` torch.compile backend.

Resolved by name through the ``torch_dynamo_backends`` entry point, so this module must stay
light: it imports nothing from csrc at lookup time.
"""

import torch


def zenflow_backend(gm: torch.fx.GraphModule, example_inputs):
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs)
