"""The sampler of bench/random_control.py (issue 50, item 3): random structures of a search
space land within 1 % under the target MACs by ``dms.count``, differ from one another, and
DMS's own counts are rebuilt at its cost; the rank statistics say what they should."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
from bench.lib import random_control_lib as rl  # noqa: E402
import dmscale as dms  # noqa: E402
from dmscale.tasks.models import ResNetCifar  # noqa: E402

TARGET = 0.4


def _model() -> ResNetCifar:
    torch.manual_seed(0)
    return ResNetCifar(depth=14, width=4, in_channels=1).eval()  # two blocks per stage


def _macs(model: torch.nn.Module, x: torch.Tensor) -> int:
    return int(dms.count(model, x)["macs"])


def test_sampled_structures_are_at_the_target_and_vary() -> None:
    model, x = _model(), torch.zeros(1, 1, 8, 8)
    searcher = rl.space_searcher(model, x)
    out = rl.sample(searcher, model, x, n=6, target=TARGET, seed=3)
    full = _macs(model, x)
    assert out["base_macs"] == full
    for structure, macs in zip(out["structures"], out["macs"]):
        exact = _macs(dms.apply_structure(copy.deepcopy(model), structure), x)
        assert exact == macs
        assert 0.99 * TARGET * full <= exact <= TARGET * full, exact / (TARGET * full)
    counts = out["counts"]
    assert len({tuple(c) for c in counts}) == 6  # distinct structures
    varying = [i for i in range(len(counts[0])) if len({c[i] for c in counts}) > 1]
    assert len(varying) >= len(counts[0]) // 2, counts  # not one structure with noise in one dim
    assert 0 < out["acceptance"] < 1 and out["draws"] >= 6
    again = rl.sample(rl.space_searcher(model, x), model, x, n=6, target=TARGET, seed=3)
    assert again["counts"] == counts  # one sampler seed, the same structures


def test_structure_at_rebuilds_counts_and_blocks() -> None:
    model, x = _model(), torch.zeros(1, 1, 8, 8)
    searcher = rl.space_searcher(model, x)
    drawn = rl.sample(searcher, model, x, n=1, target=TARGET, seed=1)
    counts = drawn["counts"][0]
    again = rl.structure_at(searcher, counts)
    assert rl.counts_of(again) == counts
    assert _macs(dms.apply_structure(copy.deepcopy(model), again), x) == drawn["macs"][0]
    stages = again["depth"]
    assert len(stages[0]["blocks"]) == 2
    c = list(counts)
    c[len(again["width"])] = 1  # one block of stage 0: the first by default, the last on request
    assert rl.structure_at(searcher, c)["depth"][0]["kept"] == stages[0]["blocks"][:1]
    last = rl.structure_at(searcher, c, [stages[0]["blocks"][1:]] + [s["kept"] for s in stages[1:]])
    assert last["depth"][0]["kept"] == stages[0]["blocks"][1:]
    with pytest.raises(dms.StructureError, match="not among"):
        rl.structure_at(searcher, c, [["nowhere"]] + [s["kept"] for s in stages[1:]])
    with pytest.raises(dms.StructureError, match="kept counts"):
        rl.structure_at(searcher, counts[:-1])


def test_sample_refuses_an_unreachable_target() -> None:
    model, x = _model(), torch.zeros(1, 1, 8, 8)
    with pytest.raises(RuntimeError, match="widen the window"):
        rl.sample(rl.space_searcher(model, x), model, x, n=1, target=0.001, max_draws=200)


def test_rank_and_gaps() -> None:
    randoms = [[0.90, 0.92], [0.95, 0.97], [0.80, 0.82]]  # structure means 0.91, 0.96, 0.81
    r = rl.rank_of(0.93, [0.91, 0.96, 0.81])
    assert (r["rank"], r["percentile"], r["median"], r["best"]) == (2, pytest.approx(200 / 3), 0.91, 0.96)
    gaps = rl.per_seed_gaps([0.93, 0.93], randoms, best=1)
    assert gaps["median"] == pytest.approx([3.0, 1.0]) and gaps["best"] == pytest.approx([-2.0, -4.0])
    gap, low, high = rl.bootstrap_gap([0.93, 0.93], randoms, "median", draws=500)
    assert gap == pytest.approx(2.0) and low <= gap <= high
    gap, low, high = rl.bootstrap_gap([0.99, 0.99], randoms, "best", draws=500)
    assert gap == pytest.approx(3.0) and low > 0
