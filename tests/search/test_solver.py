"""The budget solver (dmscale.search.solver): what it leaves of the structure the search learned."""

from __future__ import annotations

import statistics

import torch

import dmscale as dms
from dmscale.search.solver import solve_budget
from dmscale.tasks.models import ResNetCifar
from dmscale.core.topk import DifferentiableTopK


def _learned() -> tuple[list[DifferentiableTopK], DifferentiableTopK]:
    """Two widths the search left at the same ratio (4 of 8) and a depth gate of 2 costly blocks."""
    widths = [DifferentiableTopK(8), DifferentiableTopK(8)]
    depth = DifferentiableTopK(2, temperature=4.0)
    for w in widths:
        w.set_count(4)
    depth.set_count(2)
    return widths, depth


def test_a_dropped_block_leaves_its_budget_to_the_learned_width_ratios() -> None:
    """Regression: the common offset has to drop a block (cost 80 -> 40 for a target of 60);
    the freed budget used to go unit by unit to the cheapest width (8 of 8 kept, the other 5
    of 8) although the search had both at 4 of 8. The widths' own offset keeps them equal."""
    widths, depth = _learned()

    def cost(cache: dict | None = None) -> float:  # units: width A 1, width B 4, block 30
        return float(widths[0].hard_count() + 4 * widths[1].hard_count() + 30 * depth.hard_count())

    assert cost() == 80.0
    solve_budget(widths + [depth], cost, target=60.0, refill=widths)
    assert depth.hard_count() == 1
    assert [w.hard_count() for w in widths] == [6, 6]
    assert cost() == 60.0


def test_the_unit_refill_follows_the_learned_ratios_not_the_cheapest_unit() -> None:
    """Regression: without the widths' offset, the unit-by-unit refill used to give the 20
    free MACs to the cheapest width (8 of 8, the other 5 of 8); it now adds units in the
    order a falling common offset would, so the two widths stay level."""
    widths, depth = _learned()

    def cost(cache: dict | None = None) -> float:
        return float(widths[0].hard_count() + 4 * widths[1].hard_count() + 30 * depth.hard_count())

    solve_budget(widths + [depth], cost, target=60.0)
    assert cost() <= 60.0 and [w.hard_count() for w in widths] == [6, 6]


def test_the_unit_refill_keeps_different_learned_ratios_apart() -> None:
    """Learned 2 of 8 and 6 of 8 (equal unit costs): the free budget of 4 units goes 2 + 2,
    the ratios' offset continued, not all to one dim."""
    a, b = DifferentiableTopK(8), DifferentiableTopK(8)
    a.set_count(2)
    b.set_count(6)

    def cost(cache: dict | None = None) -> float:
        return float(a.hard_count() + b.hard_count())

    solve_budget([a, b], cost, target=12.0)
    assert [a.hard_count(), b.hard_count()] == [4, 8]


def test_meet_target_keeps_learned_width_ratios_when_a_block_drops() -> None:
    """Searcher level: every width at one ratio, a depth gate just short of dropping a block;
    after meet_target the widths that exist in the export stay within one unit's fraction of
    each other's kept fraction (the solver's common offsets), not filled by unit cost."""
    torch.manual_seed(0)
    model = ResNetCifar(depth=14, width=8, in_channels=1)
    x = torch.randn(1, 1, 8, 8)
    searcher = dms.prepare(model, x, dms.SearchConfig(resource="macs", target=0.45))
    searcher.randomize_importance(0)
    with torch.no_grad():
        for g in searcher.gates.width:
            g.a.fill_(0.3)
        for g in searcher.gates.depth:
            g.a.fill_(0.24)  # N = 2: round(1.52) = 2 blocks, one drops at a > 0.25
    res = searcher.meet_target()
    assert 0.98 * res["target"] <= res["hard"] <= res["target"]
    removed = [b["name"] + "." for b in searcher.structure()["removed_blocks"]]
    assert removed, "the setup should make the solver drop a block"
    fractions = [w["kept"] / w["size"] for w in searcher.structure()["width"]
                 if any(not p.startswith(tuple(removed)) for p in w["producers"])]
    assert max(fractions) - min(fractions) <= 0.15, fractions
