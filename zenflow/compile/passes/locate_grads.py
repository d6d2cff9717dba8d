"""Pass 1: find, in a backward graph, the gradient of every weight a ZenFlow optimizer owns.

AOTAutograd's backward graph returns one value per forward input, in the forward's input order:
the gradient, or None for an input that needs none (frozen parameters, data, parameters the
loss does not depend on). A tied weight (one Parameter used twice) is one input, and its two
uses are already summed into one gradient::

    def backward(primals_3, relu, t_1, tangents_1):
        ...
        mm_2 = aten.mm(t_6, primals_3)         # the weight gradient G, [out, in]
        return (mm_2, None, None, t_5, view)   # output i <-> forward input i

This pass only reads the graph: it returns the sites (output position, gradient node, slot).
"""

from dataclasses import dataclass

import torch

from zenflow.compile.passes.graph_edit import output_values


@dataclass(frozen=True)
class GradSite:
    output_index: int
    grad: torch.fx.Node
    slot: int


def locate_param_grads(graph: torch.fx.Graph, slot_of_input: dict[int, int]) -> list[GradSite]:
    """``slot_of_input`` maps forward input positions to the registry slots of owned weights."""
    outputs = output_values(graph)
    sites = []
    for index, slot in sorted(slot_of_input.items()):
        if index >= len(outputs):
            raise RuntimeError(
                f"zenflow: the backward graph returns {len(outputs)} values but forward input "
                f"{index} is an owned weight; this graph shape is not supported"
            )
        grad = outputs[index]
        if isinstance(grad, torch.fx.Node):
            sites.append(GradSite(index, grad, slot))
    return sites
