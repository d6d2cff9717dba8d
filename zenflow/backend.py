"""The ``zenflow`` torch.compile backend: AOTAutograd, then zenflow's passes on the backward
graph, then Inductor (or plain eager execution, for debugging).

    torch.compile(model, backend="zenflow")                             # Inductor
    torch.compile(model, backend="zenflow", options={"inner": "eager"})  # debug: no Inductor

Resolved by name through the ``torch_dynamo_backends`` entry point, so this module stays light:
nothing from csrc is imported when the backend is looked up. Parameters no ZenFlow optimizer
owns compile exactly as under plain Inductor.
"""

from collections.abc import Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

_INNER = ("inductor", "eager")

# Weights compiled before any ZenFlow optimizer owned them: their gradients reach the optimizer
# through .grad (the eager path), and it says so.
compiled_unowned = WeakIdKeyDictionary()


def rewrite_backward(gm: torch.fx.GraphModule, slot_of_input: dict[int, int]) -> None:
    """Run zenflow's passes over a backward graph, in place."""
    from zenflow.passes.column_split import split_columns
    from zenflow.passes.importance import insert_importance
    from zenflow.passes.locate_grads import locate_param_grads

    sites = locate_param_grads(gm.graph, slot_of_input)
    if not sites:
        return
    split_columns(gm.graph, sites)
    insert_importance(gm.graph)
    gm.graph.lint()
    gm.recompile()


def _owned_inputs(example_inputs) -> dict[int, int]:
    from zenflow.runtime import registry

    slots = {}
    for index, value in enumerate(example_inputs):
        if isinstance(value, torch.nn.Parameter) and value.requires_grad and value.dim() >= 2:
            slot = registry.slot_of(value)
            if slot is None:
                compiled_unowned[value] = True
            else:
                slots[index] = slot
    return slots


def zenflow_backend(
    gm: torch.fx.GraphModule,
    example_inputs,
    options: dict | None = None,
):
    """Options: ``inner`` ("inductor" or "eager"); ``on_backward`` (a callable receiving each
    rewritten backward GraphModule, for inspection and golden tests)."""
    options = dict(options or {})
    inner = options.pop("inner", "inductor")
    on_backward: Callable | None = options.pop("on_backward", None)
    if inner not in _INNER:
        raise ValueError(f"zenflow backend option inner={inner!r}; use one of {_INNER}")
    if options:
        raise ValueError(
            f"unknown zenflow backend options {sorted(options)}; known: inner, on_backward"
        )
    slot_of_input = _owned_inputs(example_inputs)

    def rewrite(bw_gm: torch.fx.GraphModule) -> None:
        rewrite_backward(bw_gm, slot_of_input)
        if on_backward is not None:
            on_backward(bw_gm)

    if inner == "inductor":
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        def inner_compile(graph_module, inputs, *args, **kwargs):
            if kwargs.get("is_backward"):
                rewrite(graph_module)
            return compile_fx_inner(graph_module, inputs, *args, **kwargs)

        # AOTAutograd's cache keys on the graph before our passes: a hit would skip them.
        with torch._functorch.config.patch(enable_autograd_cache=not slot_of_input):
            return compile_fx(gm, example_inputs, inner_compile=inner_compile)

    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    def forward_compiler(graph_module, inputs):
        return make_boxed_func(graph_module.forward)

    def backward_compiler(graph_module, inputs):
        rewrite(graph_module)
        return make_boxed_func(graph_module.forward)

    return aot_autograd(
        fw_compiler=forward_compiler,
        bw_compiler=backward_compiler,
        partition_fn=min_cut_rematerialization_partition,
        keep_inference_input_mutations=True,
    )(gm, example_inputs)
