"""Rewritten backward graphs against their golden files (tests/golden/<case>.txt).

``EXPECTTEST_ACCEPT=1 make test`` rewrites the goldens. They belong to the torch version in
tests/golden/TORCH_VERSION; on another version the text comparison is not applicable and is
reported as such, while the structural checks still run.
"""

import os
import re
from pathlib import Path

import pytest
import torch

from tests.models import batches, build, loss_of
from zenflow.columns import column_count
from zenflow.optimizer import ZenFlowAdamW
from zenflow.runtime import registry

GOLDEN = Path(__file__).parent / "golden"
CASES = ["mlp", "mlp_nobias", "wide", "gpt", "frozen", "conv"]
ZENFLOW_OP = re.compile(r"(torch\.ops\.zenflow\.\w+\.default\((?:[^,()]+, )+)(\d+)\)")


def rewritten_backward(name: str) -> tuple[torch.nn.Module, ZenFlowAdamW, torch.fx.GraphModule]:
    # Earlier compilations of the same code with other shapes would make Dynamo trace this
    # one with symbolic sizes: start from a clean cache so the graph does not depend on order.
    torch._dynamo.reset()
    model = build(name)
    opt = ZenFlowAdamW(model.parameters(), step_backend="eager")
    graphs = []
    options = {"inner": "eager", "on_backward": graphs.append}
    compiled = torch.compile(model, backend="zenflow", options=options)
    loss_of(name, compiled, *batches(name, 1)[0]).backward()
    assert len(graphs) == 1, "zenflow must not split the model into several graphs"
    return model, opt, graphs[0]


def normalized(gm: torch.fx.GraphModule) -> str:
    """The graph's code with slot numbers renamed in order of appearance (they depend on how
    many optimizers the process created before) and source comments dropped (they hold paths)."""
    code = gm.print_readable(print_output=False)
    slots: dict[str, str] = {}

    def rename(match):
        slot = slots.setdefault(match.group(2), f"slot{len(slots)}")
        return f"{match.group(1)}{slot})"

    lines = [line.rstrip() for line in ZENFLOW_OP.sub(rename, code).splitlines()]
    return "\n".join(line for line in lines if line and not line.lstrip().startswith("#")) + "\n"


def golden_applies() -> bool:
    pinned = (GOLDEN / "TORCH_VERSION").read_text().strip()
    return torch.__version__.split("+")[0] == pinned


@pytest.mark.parametrize("name", CASES)
def test_backward_graph_matches_golden(name):
    text = normalized(rewritten_backward(name)[2])
    path = GOLDEN / f"{name}.txt"
    if os.environ.get("EXPECTTEST_ACCEPT") == "1":
        path.write_text(text)
    if not golden_applies():
        pytest.skip(f"goldens belong to torch {(GOLDEN / 'TORCH_VERSION').read_text().strip()}")
    assert text == path.read_text(), f"{path} differs; review, then EXPECTTEST_ACCEPT=1 make test"


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_a_model_called_before_its_optimizer_existed_gets_the_same_graph(name):
    """A model compiled and called before its optimizer existed (an evaluation first, or a new
    optimizer after loading a checkpoint) gets its backward rewritten at the next call, as a
    variant of the graph compiled first. Its graph is the one a model whose optimizer came
    first gets: the sizes Dynamo traced as fixed stay fixed. Before: the variant was traced
    with a symbol for every size, a graph that computed its shapes as it ran and marked them
    on every tensor it saved for the backward."""
    torch._dynamo.reset()
    model = build(name)
    graphs = []
    options = {"inner": "eager", "on_backward": graphs.append}
    compiled = torch.compile(model, backend="zenflow", options=options)
    inputs, targets = batches(name, 1)[0]
    loss_of(name, compiled, inputs, targets).backward()  # nothing to rewrite yet
    model.zero_grad()
    opt = ZenFlowAdamW(model.parameters(), step_backend="eager")
    loss_of(name, compiled, inputs, targets).backward()
    opt.zero_grad()
    assert len(graphs) == 2
    assert normalized(graphs[1]) == normalized(rewritten_backward(name)[2])


@pytest.mark.parametrize("name", CASES)
def test_every_owned_weight_is_handed_over_once_and_its_gradient_dropped(name):
    model, opt, gm = rewritten_backward(name)
    nodes = list(gm.graph.nodes)
    ops = torch.ops.zenflow
    matmuls = [
        n for n in nodes if n.target in (ops.stage_matmul.default, ops.stage_matmul_lookup.default)
    ]
    transposed = [n for n in nodes if n.target is ops.stage_columns.default]
    lookups = [n for n in nodes if n.target is ops.stage_lookup.default]
    weights = {
        registry.slot_of(p): p for p in model.parameters() if p.requires_grad and p.dim() >= 2
    }
    assert sorted(n.args[-1] for n in matmuls + transposed + lookups) == sorted(weights)
    # Only a gradient that is neither a matmul nor a lookup nor both (a conv's) reaches the
    # runtime whole; the GPT's position embedding goes as its lookup, the tied token embedding
    # as a matmul plus its lookup.
    assert len(transposed) == (name == "conv")
    assert len(lookups) == (name == "gpt")
    tied = [n for n in matmuls if n.target is ops.stage_matmul_lookup.default]
    assert len(tied) == (name == "gpt")
    for stage in matmuls:
        columns_by_batch, out_grad, *lookup, slot = stage.args
        columns, batch = columns_by_batch.meta["val"].shape
        assert (columns, out_grad.meta["val"].shape) == (
            column_count(weights[slot].shape),
            (batch, weights[slot].shape[0]),
        )
        if lookup:
            rows, ids = (node.meta["val"] for node in lookup)
            assert rows.shape[1] == columns and ids.shape == (rows.shape[0],)
    for stage in transposed:
        columns_by_out, slot = stage.args
        weight = weights[slot]
        assert tuple(columns_by_out.meta["val"].shape) == (
            column_count(weight.shape),
            weight.shape[0],
        )
    # The weight gradients that are a matmul are never formed in the graph.
    # (Not checked for the tied weight: in this tiny GPT its input-gradient matmul has its size.)
    matmul_sizes = {weights[n.args[-1]].numel() for n in matmuls if n not in tied}
    products = [n.meta["val"].numel() for n in nodes if n.target is torch.ops.aten.mm.default]
    assert not matmul_sizes & set(products)
    returned = gm.graph.output_node().args[0]
    weight_grads = [
        v for v in returned if isinstance(v, torch.fx.Node) and v.meta["val"].dim() >= 2
    ]
    assert weight_grads == []
    vectors = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    assert sum(isinstance(v, torch.fx.Node) for v in returned) == len(vectors)


def test_gpt_compiles_as_one_graph_without_breaks():
    model = build("gpt")
    ZenFlowAdamW(model.parameters(), step_backend="eager")
    inputs, _ = batches("gpt", 1)[0]
    explanation = torch._dynamo.explain(model)(inputs)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
