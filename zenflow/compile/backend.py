"""The ``zenflow`` torch.compile backend: AOTAutograd, then zenflow's passes on the backward
graph, then Inductor (or plain eager execution, for debugging).

    torch.compile(model, backend="zenflow")                             # Inductor
    torch.compile(model, backend="zenflow", options={"inner": "eager"})  # debug: no Inductor

Resolved by name through the ``torch_dynamo_backends`` entry point, so this module stays light:
nothing from csrc is imported when the backend is looked up. Parameters no ZenFlow optimizer
owns compile exactly as under plain Inductor.
"""

import contextlib
import copy
import functools
import hashlib
from collections.abc import Callable
from pathlib import Path

import torch

_INNER = ("inductor", "eager")

# The sources that decide what a rewritten backward graph looks like, in the compiler package.
_COMPILER = Path(__file__).resolve().parent
_REWRITE_SOURCES = ("backend.py", "ops.py", "passes")


def rewrite_backward(gm: torch.fx.GraphModule, slot_of_input: dict[int, int]) -> None:
    """Run zenflow's passes over a backward graph, in place."""
    from zenflow.compile.passes.column_split import split_columns
    from zenflow.compile.passes.locate_grads import locate_param_grads

    sites = locate_param_grads(gm.graph, slot_of_input)
    if not sites:
        return
    split_columns(gm.graph, sites)
    # The dropped gradients' last transposes are now dead; our ops survive as side effects.
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()


def _is_weight(value) -> bool:
    return isinstance(value, torch.nn.Parameter) and value.requires_grad and value.dim() >= 2


def _compile(gm, example_inputs, slot_of_input: dict[int, int], inner: str, on_backward):
    def rewrite(bw_gm: torch.fx.GraphModule) -> None:
        rewrite_backward(bw_gm, slot_of_input)
        if on_backward is not None:
            on_backward(bw_gm)

    if inner == "inductor":
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        # The graphs call zenflow's ops; a cache hit brings them back without the passes, which
        # would have registered them.
        import zenflow.compile.ops  # noqa: F401

        def inner_compile(graph_module, inputs, *args, **kwargs):
            if kwargs.get("is_backward"):
                rewrite(graph_module)
            return compile_fx_inner(graph_module, inputs, *args, **kwargs)

        with _cache_keyed_on_the_rewrite(slot_of_input, on_backward):
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


@contextlib.contextmanager
def _cache_keyed_on_the_rewrite(slot_of_input: dict[int, int], on_backward):
    """torch.compile's caches (AOTAutograd's, Inductor's FX graph cache) key on the graph before
    zenflow's passes, and a hit brings back the compiled graphs without running them: with the
    slots they were compiled for baked in. So the key gets the slot of every weight input and
    a digest of the code that rewrites; a hit is then a graph this compile would have produced.
    With ``on_backward`` (inspection) AOTAutograd's cache is off: a hit would not call it."""
    slots = ",".join(f"{i}:{slot}" for i, slot in sorted(slot_of_input.items()))
    tag = f"{torch.compiler.config.cache_key_tag}zenflow-{rewrite_digest()}-{slots}"
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.compiler.config.patch(cache_key_tag=tag))
        if on_backward is not None:
            stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
        yield


@functools.cache
def rewrite_digest(root: Path = _COMPILER) -> str:
    """A digest of the code under ``root`` (the compiler package) that rewrites backward graphs."""
    digest = hashlib.sha256()
    for name in _REWRITE_SOURCES:
        path = root / name
        for source in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            digest.update(source.relative_to(root).as_posix().encode())
            digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


class _CompiledPerOwnership:
    """One compiled variant per assignment of weights to ZenFlow optimizers.

    The rewritten graph names each weight's optimizer by slot, but Dynamo's guards do not see
    ownership: another model of the same class, or an optimizer created after the first call,
    reaches the same compiled code. So the slots are checked on every call (one dictionary
    lookup per weight) and a mismatch compiles a new variant, within the Dynamo tracing context
    of the first compile and from its inputs as Dynamo traced them (``traced_inputs``), so that
    symbolic sizes stay symbolic and static ones static.
    """

    def __init__(self, gm, example_inputs, weight_inputs: list[int], inner, on_backward):
        self.template = _copied(gm)
        self.weight_inputs = weight_inputs
        self.inner = inner
        self.on_backward = on_backward
        self.tracing_context = torch._guards.TracingContext.try_get()
        self.example_inputs = traced_inputs(example_inputs, self.tracing_context)
        key = self._key(example_inputs)
        self.variants = {key: self._compile_variant(gm, key, example_inputs)}

    def _key(self, args) -> tuple:
        from zenflow.runtime import registry

        return tuple(registry.slot_of(args[i]) for i in self.weight_inputs)

    def _compile_variant(self, gm, key: tuple, example_inputs):
        slots = {
            i: slot for i, slot in zip(self.weight_inputs, key, strict=True) if slot is not None
        }
        return _compile(gm, example_inputs, slots, self.inner, self.on_backward)

    def __call__(self, *args):
        key = self._key(args)
        variant = self.variants.get(key)
        if variant is None:
            with torch._guards.tracing(self.tracing_context):
                variant = self._compile_variant(_copied(self.template), key, self.example_inputs)
            self.variants[key] = variant
        return variant(*args)


def _copied(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A deep copy of Dynamo's graph with what ``copy.deepcopy`` leaves out and AOTAutograd
    reads to tell the weights from other inputs: the graph's map from parameters to their
    sources and each input's source (without them a variant's partition saved the weights'
    transposes for the backward, not the weights)."""
    copied = copy.deepcopy(gm)
    if hasattr(gm, "_param_name_to_source"):
        copied._param_name_to_source = gm._param_name_to_source
    originals, copies = (g.graph.find_nodes(op="placeholder") for g in (gm, copied))
    for node, copy_of_node in zip(originals, copies, strict=True):
        if hasattr(node, "_dynamo_source"):
            copy_of_node._dynamo_source = node._dynamo_source
    return copied


def traced_inputs(example_inputs: list, context: "torch._guards.TracingContext | None") -> list:
    """A compile's example inputs as fake tensors of its fake mode, with the sizes Dynamo traced
    them with (``context``'s symbolic context of each tensor: the compile's tracing context),
    for compiling another variant later.

    Dynamo forgets those contexts once a registered backend's compile returns, and AOTAutograd
    gives a tensor it has none for a symbol for every size: a variant compiled from the real
    inputs would take every size as dynamic (a graph that computes its shapes at run time, and
    stamps the dynamic sizes on each tensor it saves for the backward). Fake tensors also hold
    none of the first model's memory."""
    from torch._subclasses.fake_tensor import FakeTensor

    fake_mode = torch._guards.detect_fake_mode(example_inputs)
    if context is None or fake_mode is None:
        return list(example_inputs)

    def traced(value):
        if not isinstance(value, torch.Tensor) or isinstance(value, FakeTensor):
            return value
        symbolic = context.tensor_to_context.get(value)
        source = None if symbolic is None else symbolic.tensor_source
        return fake_mode.from_tensor(value, symbolic_context=symbolic, source=source)

    return [traced(value) for value in example_inputs]


def zenflow_backend(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None):
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
    weight_inputs = [i for i, value in enumerate(example_inputs) if _is_weight(value)]
    if not weight_inputs:
        return _compile(gm, example_inputs, {}, inner, on_backward)
    return _CompiledPerOwnership(gm, example_inputs, weight_inputs, inner, on_backward)
