"""torch.distributed: importance from the global batch (one all-reduce), identical structures
on every rank, and the helpers of :mod:`dmscale.core.distributed`.

The two-rank tests spawn two CPU processes on gloo (``dist_worker.worker``); they share one
spawn (module fixture) and compare with :func:`dist_worker.search` in this process on the
whole global batches.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

import dist_worker
import dmscale as dms
from spawn_ranks import spawn_ranks
from dmscale.core.distributed import all_reduce_mean, is_distributed, is_main_process, rank, shard, world_size
from dmscale.core.errors import PendingImportanceError
from dmscale.core.topk import integer_rank

WORLD, DEADLINE_S = 2, 240.0


# ---------------------------------------------------------------------- helpers, one process
def test_helpers_without_a_process_group():
    assert (world_size(), rank(), is_main_process(), is_distributed()) == (1, 0, True, False)
    assert not is_distributed(False)
    t = torch.tensor([1.0, 2.0])
    assert all_reduce_mean(t) is t and t.tolist() == [1.0, 2.0]


def test_shard_splits_every_part_of_a_batch_equally():
    x, y = torch.arange(12).view(6, 2), torch.arange(6)
    parts = [shard((x, y), r, 3) for r in range(3)]
    assert torch.equal(torch.cat([p[0] for p in parts]), x)
    assert [p[1].tolist() for p in parts] == [[0, 1], [2, 3], [4, 5]]
    d = shard({"input_ids": x, "labels": y}, 1, 2)
    assert d["input_ids"].tolist() == [[6, 7], [8, 9], [10, 11]] and d["labels"].tolist() == [3, 4, 5]
    assert shard(list(range(8)), 3, 4) == [6, 7]
    assert shard(range(10, 20), 1, 2) == range(15, 20)
    assert shard(np.arange(4), 0, 2).tolist() == [0, 1]
    assert torch.equal(shard(x, 0, 1), x)


@pytest.mark.parametrize(("args", "pattern"), [
    ((torch.zeros(7, 3), 0, 2), r"global batch size 7 is not divisible by world size 2.*multiple of 2"),
    (((torch.zeros(4), torch.zeros(5)), 1, 2), r"global batch size 5 is not divisible by world size 2"),
    ((torch.zeros(4), 2, 2), r"rank must be in \[0, 2\) for world size 2, got 2"),
    ((torch.zeros(4), 0, 0), r"world size must be >= 1, got 0"),
])
def test_shard_errors_name_the_sizes(args, pattern):
    with pytest.raises(ValueError, match=pattern):
        shard(*args)


def test_shard_refuses_what_it_cannot_split():
    with pytest.raises(TypeError, match="cannot shard a int"):
        shard(5, 0, 1)


def test_sync_importance_is_a_no_op_in_one_process():
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(4, 4)
    searcher = dms.prepare(net, x, dms.SearchConfig(resource="params", target=0.5))
    net(x).pow(2).mean().backward()
    importance = searcher.gates.width[0].importance.clone()
    assert importance.abs().sum() > 0  # one process: the backward updated it at once
    assert searcher.sync_importance() == 0 and len(searcher.gates.pending) == 0
    assert torch.equal(searcher.gates.width[0].importance, importance)
    searcher.structure()  # nothing pending: no error


def test_pending_updates_block_structure_reads():
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    searcher = dms.prepare(net, torch.randn(2, 4), dms.SearchConfig(resource="params", target=0.5))
    gate = searcher.gates.width[0]
    searcher.gates.pending.add((1, 0), gate, torch.ones(gate.n_units), torch.ones(gate.n_units))
    for read in (searcher.structure, searcher.export, searcher.state_dict, searcher.meet_target):
        with pytest.raises(PendingImportanceError, match=r"call searcher.sync_importance\(\) on every rank"):
            read()
    with pytest.raises(PendingImportanceError, match="before changing the process group"):
        searcher.use_process_group(False)
    assert searcher.sync_importance() == 1  # world size 1: this rank's gradient
    assert gate.importance.tolist() == pytest.approx([0.01] * gate.n_units)
    searcher.structure()


def test_integer_rank_ties_are_deterministic():
    """Structures are functions of ``a`` and importance; ties (all-zero importance at the
    start, equal scores) are broken by index, the same on every rank and every call."""
    c = torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0])
    expected = [2, 4, 1, 3, 0]
    assert all(integer_rank(c.clone()).tolist() == expected for _ in range(5))
    assert integer_rank(torch.zeros(6)).tolist() == [5, 4, 3, 2, 1, 0]


# ---------------------------------------------------------------------- two ranks, gloo
def _spawn(tmp_path) -> list[dict]:
    return spawn_ranks(dist_worker.worker, WORLD, tmp_path, deadline_s=DEADLINE_S)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with the gloo backend is not available in this torch build")
    return _spawn(tmp_path_factory.mktemp("ddp"))


@pytest.fixture(scope="module")
def single():
    return {"plain": dist_worker.search(False), "scaled": dist_worker.search(False, scaled=True),
            "width_only": dist_worker.search(False, width_only=True),
            "settle": dist_worker.search(False, settle=0.5)}


def _assert_identical(r0: dict, r1: dict) -> None:
    assert torch.equal(r0["a"], r1["a"])
    assert all(torch.equal(a, b) for a, b in zip(r0["importance"], r1["importance"]))
    for key in ("width", "depth", "layers", "shapes", "hard"):
        assert r0[key] == r1[key], key


def _assert_matches(got: dict, ref: dict) -> None:
    torch.testing.assert_close(got["a"], ref["a"], rtol=1e-5, atol=1e-6)
    for a, b in zip(got["importance"], ref["importance"]):  # relative to its scale (~1e-5)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()))
    for key in ("width", "depth", "layers", "shapes", "hard"):
        assert got[key] == ref[key], key


@pytest.mark.parametrize("case", ["plain", "bn", "forgot", "scaled", "width_only", "settle", "nonfinite"])
def test_every_rank_ends_with_the_same_search(ranks, case):
    r0, r1 = ranks[0][case], ranks[1][case]
    if case == "nonfinite":
        assert all(torch.equal(a, b) for a, b in zip(r0["after"], r1["after"]))
    else:
        _assert_identical(r0, r1)


def test_ddp_equals_one_process_on_the_global_batch(ranks, single):
    ref = single["plain"]
    assert any(k < s for (_, k), s in zip(ref["width"], [8, 16, 16, 16])), "the search pruned nothing"
    assert any(float(c.abs().max()) > 0 for c in ref["importance"])
    _assert_matches(ranks[0]["plain"], ref)


def test_width_only_phase_under_ddp(ranks, single):
    """Depth frozen halfway (its ``a`` stops getting gradients): with DDP's
    ``find_unused_parameters=True`` the search still equals one process's."""
    _assert_matches(ranks[0]["width_only"], single["width_only"])


def test_settle_phase_under_ddp(ranks, single):
    """The settle phase (depth frozen, band loss on the exact cost, annealed structural lr)
    under DDP with ``find_unused_parameters=True``: the same search as one process's."""
    _assert_matches(ranks[0]["settle"], single["settle"])


def test_forgotten_sync_is_applied_by_the_next_forward(ranks):
    """Without sync_importance() in the loop the next training forward applies the pending
    updates (the same all-reduce): the same search, bit for bit; a read with updates
    pending raises instead of missing them."""
    for r in ranks:
        assert r["forgot"]["pending_error"] == "PendingImportanceError"
        _assert_identical(r["forgot"], r["plain"])


def test_grad_scaler_under_ddp_uses_unscaled_gradients(ranks, single):
    _assert_matches(ranks[0]["scaled"], single["scaled"])
    _assert_matches(ranks[0]["scaled"], single["plain"])


def test_a_non_finite_gradient_on_one_rank_leaves_importance_untouched_on_all(ranks):
    for r in ranks:
        assert r["nonfinite"]["applied"] > 0 and r["nonfinite"]["unchanged"]


def test_batchnorm_model_gives_one_structure(ranks):
    """Per-rank BatchNorm statistics make the search differ from one process, but the
    averaged mask gradients keep importance, ``a`` and the structure identical on all ranks."""
    _assert_identical(ranks[0]["bn"], ranks[1]["bn"])
    assert ranks[0]["bn"]["shapes"]
