"""Small helpers the passes share for editing post-AOTAutograd FX graphs."""

import torch
from torch._guards import detect_fake_mode


def fake_mode_of(graph: torch.fx.Graph):
    """The FakeTensorMode the graph's ``meta["val"]`` values were made in, if any."""
    return detect_fake_mode(
        [n.meta["val"] for n in graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    )


def call(graph: torch.fx.Graph, target, *args) -> torch.fx.Node:
    """Insert ``target(*args)`` at the graph's insertion point, with ``meta["val"]`` computed on
    fake values so later compilers (Inductor) see shapes and dtypes as for any traced node."""
    node = graph.call_function(target, args)
    mode = fake_mode_of(graph)
    if mode is not None and all("val" in a.meta for a in node.all_input_nodes):
        fake_args = torch.fx.node.map_arg(args, lambda a: a.meta["val"])
        with mode:
            node.meta["val"] = target(*fake_args)
    return node


def output_values(graph: torch.fx.Graph) -> list:
    return list(graph.output_node().args[0])


def set_output_values(graph: torch.fx.Graph, values: list) -> None:
    output = graph.output_node()
    output.args = (type(output.args[0])(values),)
    # Inductor noted which outputs the user sees before the passes ran; an output that is no
    # longer a node (a gradient now None) must leave that list, or its stride analysis reads it.
    visible = output.meta.get("user_visible_output_idxs")
    if visible is not None:
        output.meta["user_visible_output_idxs"] = [
            i for i in visible if isinstance(values[i], torch.fx.Node)
        ]
