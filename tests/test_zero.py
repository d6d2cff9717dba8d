"""ZeRO-1/2 partitions: two gloo processes equal one process on the same global batch."""

import pytest
import torch
import torch.multiprocessing as mp
from torch.testing import assert_close

from tests.distributed_worker import collectives_by_step, run, train
from tests.models import batches, build, loss_of
from tests.ports import free_port
from zenflow.reference import ReferenceZenFlowAdamW

SCHEDULE = dict(lr=1e-2, topk_ratio=0.25, update_interval=2, select_interval=4)


def two_ranks(tmp_path, settings) -> list[dict]:
    mp.spawn(run, args=(2, free_port(), str(tmp_path), settings), nprocs=2, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize(
    "settings",
    [
        dict(zero_stage=1),
        dict(zero_stage=2),
        dict(zero_stage=2, overlap_step=True, compiled=True),
        dict(zero_stage=1, overlap_step=True, max_grad_norm=0.05),
        dict(zero_stage=2, offload=True),
        dict(zero_stage=1, overlap_step=True, as_over_nccl=True),
        dict(zero_stage=2, compiled=True, as_over_nccl=True),
        dict(zero_stage=2, compiled=True, torch_clip=0.05),
    ],
    ids=[
        "stage1",
        "stage2",
        "stage2-overlap-compiled",
        "stage1-overlap-clipped",
        "offload",
        "stage1-host-tensors-as-over-nccl",
        "stage2-compiled-host-tensors-as-over-nccl",
        "stage2-compiled-clipped-by-torch",
    ],
)
def test_two_ranks_equal_one_rank_and_the_reference(tmp_path, settings):
    settings = {**SCHEDULE, **settings}
    ranks = two_ranks(tmp_path, settings)
    single, single_opt = train(1, 0, settings)
    assert_close(
        ranks[0]["params"], [p.detach() for p in single.parameters()], rtol=1e-5, atol=1e-6
    )

    oracle_model = build("mlp")
    runtime_only = ("zero_stage", "compiled", "offload", "as_over_nccl", "torch_clip")
    reference_settings = {k: v for k, v in settings.items() if k not in runtime_only}
    if "torch_clip" in settings:  # the oracle's .grad is ordinary: it clips as torch does
        reference_settings["max_grad_norm"] = settings["torch_clip"]
    oracle = ReferenceZenFlowAdamW(oracle_model.parameters(), **reference_settings)
    for inputs, targets in batches("mlp", 12):
        oracle.zero_grad()
        loss_of("mlp", oracle_model, inputs, targets).backward()
        oracle.step()
    oracle.flush()
    assert_close(ranks[0]["params"], list(oracle_model.parameters()), rtol=1e-5, atol=1e-6)

    # Synchronizations with the device per step, on both ranks: steps 2, 4, 6, 8 and 10 are
    # ordinary, 1, 5 and 9 close a window, 0, 3, 7 and 11 select.
    for r in ranks:
        syncs = r["syncs_by_step"]
        assert max(syncs[s] for s in (2, 4, 6, 8, 10)) <= 1, syncs
        assert max(syncs[s] for s in (1, 5, 9)) <= 2 and max(syncs) <= 8, syncs

    # Each rank holds the host state of half the columns.
    single_host = single_opt.stats()["host_columns"]
    assert ranks[0]["host_columns"] + ranks[1]["host_columns"] == single_host
    assert all(abs(r["host_columns"] - single_host / 2) <= single_host * 0.1 for r in ranks)
    # The collectives are called by the names this torch release keeps (torch 2.13's rename
    # left the old ones warning on every rank).
    assert [r["distributed_warnings"] for r in ranks] == [[], []]
    # Nothing kept the process group alive once destroyed: its threads would run on into
    # interpreter teardown, which they can abort after a rank succeeded.
    assert [r["gloo_threads_after_destroy"] for r in ranks] == [[], []]

    # A compiled ZeRO-2 backward reduce-scatters as it goes: after it a rank holds only its
    # chunk of the unselected rows (the two chunks make up all of them). (Uncompiled, gradients
    # wait in .grad until step() collects them.)
    if settings.get("compiled") and settings["zero_stage"] == 2:
        for step in range(12):
            (mine, unselected), (theirs, _) = (r["staged_rows_after_backward"][step] for r in ranks)
            assert [a + b for a, b in zip(mine, theirs, strict=True)] == unselected
            assert all(a < u for a, u in zip(mine, unselected, strict=True))


def counted_steps(tmp_path, zero_stage: int) -> dict:
    settings = dict(zero_stage=zero_stage, weights=(6, 24))
    mp.spawn(collectives_by_step, args=(2, free_port(), str(tmp_path), settings), nprocs=2)
    return torch.load(tmp_path / "rank0.pt")


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_a_step_sums_every_weights_scores_over_ranks_in_one_collective(tmp_path, zero_stage):
    """Host tensors cross through the collective's device, as with NCCL. Per step after the
    first selection, a weight adds only its gradient's own reductions (its selected rows, and
    its bias, averaged; at stage 1 also its unselected rows, reduced in the step): the columns'
    scores of every weight are summed in one collective, which the host does not wait for, and
    at a select boundary the entering columns' rows of every weight in one per dtype."""
    counted = counted_steps(tmp_path, zero_stage)
    few, many = counted[6], counted[24]
    assert [syncs for syncs, _ in few] == [syncs for syncs, _ in many]
    syncs = [syncs for syncs, _ in few]
    ordinary = (2, 4, 6, 8, 10)  # 1, 5 and 9 close a window; 0, 3, 7 and 11 select
    assert max(syncs[s] for s in ordinary) <= 1, syncs
    assert max(syncs[s] for s in (1, 5, 9)) <= 2 and max(syncs) <= 8, syncs
    per_weight = {1: 3, 2: 2}[zero_stage]
    for s in range(1, 12):
        (_, fewer), (_, more) = few[s], many[s]
        assert more["all_reduce"] - fewer["all_reduce"] == 18 * per_weight, (s, fewer, more)
