"""The evolutionary-search baseline of bench/evolution.py (issue 10, table 3).

On a small ResNet: every evaluated candidate costs at most the target (the searcher's exact
hard cost, which the export's ``dms.count`` equals), the best fitness never decreases over
generations, the evaluation budget holds, and the fitness of the hardened supernet is that
of the export.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

import dmscale as dms
from dmscale.tasks.models import ResNetCifar

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import evolution_lib as el  # noqa: E402


def _setup() -> tuple[torch.nn.Module, dms.Searcher, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = ResNetCifar(depth=8, width=4, in_channels=1)
    x, y = torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))
    searcher = dms.prepare(model, x[:1], dms.SearchConfig(target=0.5))
    n = el.importance_pass(searcher, model, iter([(x[:16], y[:16]), (x[16:], y[16:])]),
                           lambda m, a, b: torch.nn.functional.cross_entropy(m(a), b))
    assert n == 2 and searcher.has_importance()
    return model, searcher, x, y


def _accuracy(x: torch.Tensor, y: torch.Tensor):
    def evaluate(model: torch.nn.Module) -> float:
        model.eval()
        with torch.no_grad():
            return float((model(x).argmax(-1) == y).float().mean())
    return evaluate


def test_budget_and_monotone_best() -> None:
    model, searcher, x, y = _setup()
    space = el.SearchSpace.of(searcher)
    assert len(space.gates) == len(space.low) == len(space.high)
    fitness = el.supernet_fitness(space, model, lambda m: dms.recalibrate_batchnorm(m, [x]), _accuracy(x, y))
    cfg = el.EvolutionConfig(population=8, generations=5, parents=3, n_mutation=4, n_crossover=4, seed=1)
    result = el.evolve(space, fitness, cfg)
    assert 0 < len(result.evaluated) <= cfg.budget
    assert len({c.counts for c in result.evaluated}) == len(result.evaluated)  # no re-evaluation
    assert all(c.cost <= space.target for c in result.evaluated)
    assert all(lo <= k <= hi for c in result.evaluated for k, lo, hi in zip(c.counts, space.low, space.high))
    best = result.best_per_generation
    assert len(best) == cfg.generations + 1
    assert all(b >= a for a, b in zip(best, best[1:]))
    assert best[-1] == result.best.fitness == max(c.fitness for c in result.evaluated)
    fits = [i.candidate.fitness for i in result.improvements]
    assert all(b > a for a, b in zip(fits, fits[1:]))
    # the exact cost is the export's dms.count, and the hardened fitness is the export's accuracy
    for cand in (result.evaluated[0], result.best):
        space.set(cand.counts)
        small = searcher.export()
        assert int(dms.count(small, x[:1])["macs"]) == cand.cost
        dms.recalibrate_batchnorm(small, [x])
        assert abs(_accuracy(x, y)(small) - fitness(cand.counts)) < 1e-6


def test_constraint_binds() -> None:
    """A fitness that rewards size pushes candidates to the budget, never over it."""
    model, searcher, x, _ = _setup()
    space = el.SearchSpace.of(searcher)
    full = space.cost(space.high)
    result = el.evolve(space, lambda counts: space.cost(counts) / full,
                       el.EvolutionConfig(population=10, generations=8, parents=4, n_mutation=6, n_crossover=6))
    assert all(c.cost <= space.target for c in result.evaluated)
    assert result.best.cost > 0.9 * space.target
    assert all(b >= a for a, b in zip(result.best_per_generation, result.best_per_generation[1:]))
    assert space.counts() == result.best.counts  # the searcher is left at the best candidate


def test_time_guard_stops_early() -> None:
    """``max_seconds`` ends the search on the given clock; the best so far is kept."""
    _, searcher, _, _ = _setup()
    space = el.SearchSpace.of(searcher)
    ticks = iter(range(10_000))
    result = el.evolve(space, lambda counts: float(sum(counts)),
                       el.EvolutionConfig(population=6, generations=5, parents=2, n_mutation=3, n_crossover=3,
                                          max_seconds=8.5), clock=lambda: float(next(ticks)))
    assert result.stopped_early and 0 < len(result.evaluated) < 6 + 5 * 6
    assert all(b >= a for a, b in zip(result.best_per_generation, result.best_per_generation[1:]))
