"""The evolutionary-search baseline of bench/evolution.py (issue 10, table 3).

On a small ResNet: every evaluated candidate costs at most the target (the searcher's exact
hard cost, which the export's ``dms.count`` equals), the best fitness never decreases over
generations, the evaluation budget holds, and the fitness of the hardened supernet is that
of the export.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dmscale as dms
from dmscale.tasks.models import ResNetCifar

ROOT = Path(__file__).resolve().parents[2]
from bench.lib import evolution_lib as el  # noqa: E402


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


@pytest.mark.slow  # ~20 s on 2 cores; the search, the cache and the table are tested here without it
def test_quick_smoke_run_writes_its_table_under_the_workdir(tmp_path: Path) -> None:
    """``bench/evolution.py --quick`` (no CPU-second cap) runs end to end and leaves
    bench/results alone; it crashed formatting the missing cap."""
    before = {p: p.stat().st_mtime_ns for p in (ROOT / "bench" / "results").glob("evolution*")}
    proc = subprocess.run([sys.executable, "-m", "bench.evolution", "--quick", "--workdir", str(tmp_path)],
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = (tmp_path / "quick" / "evolution.md").read_text()
    assert "no CPU-second cap" in table and "- search space: 15 structural dimensions" in table
    assert "| 0 |" in table  # seed 0's row
    assert before == {p: p.stat().st_mtime_ns for p in (ROOT / "bench" / "results").glob("evolution*")}


def test_cache_key_names_depth_hold_and_cap_only_when_set() -> None:
    """The cached ResNet-20 rows keep their keys; ``--depth``, ``--settle-hold`` and a cap other
    than 420 s each get their own."""
    from bench import evolution
    base = evolution.BenchConfig(settle=0.4)
    assert base.key() == "t0.5-pre10.0-s36.36-evo50x10-imp20-bn5-settle0.4"
    deep = evolution.BenchConfig(settle=0.4, settle_hold=True, depth=56,
                                 evolution=el.EvolutionConfig(generations=100, max_seconds=1800.0))
    assert deep.key() == "d56-t0.5-pre10.0-s36.36-evo50x100-imp20-bn5-settle0.4-hold-cap1800.0"
    assert evolution._model(56)["model_args"] == {"width": 8, "depth": 56}
    assert evolution._model(20) is evolution.MODEL
    with pytest.raises(ValueError, match="depth must be 6n"):
        evolution.BenchConfig(depth=21)
    with pytest.raises(ValueError, match="settle_hold needs settle"):
        evolution.BenchConfig(settle_hold=True)


_DRIVER = """
import sys, time
from pathlib import Path
from bench import evolution as ev
out = Path({out!r})
ev.RESULTS = out
ev._pretrain = lambda bc, seed, work: out
ev.run_dms = lambda bc, seed, pre, work: {{"acc": 0.5, "cpu_s": 1.0}}
evo = {{"curve": [{{"test_acc": 0.4}}], "cpu_s": 2.0, "evaluations": 1}}
ev.run_evolution = lambda bc, seed, pre: (time.sleep(2.0), evo)[1]  # both processes overlap
ev.write_table = lambda cache, key: out / "table.md"
ev.plot = lambda cache, key: None
ev.main(["--seeds", {seed!r}, "--workdir", str(out)])
"""


def test_two_invocations_adding_seeds_at_once_keep_both(tmp_path: Path) -> None:
    """Each invocation loaded the cache once and saved its whole copy: the one that saved last
    dropped the other's seed. Runs and table stubbed; the cache handling is the real one."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    procs = [subprocess.Popen([sys.executable, "-c", _DRIVER.format(out=str(tmp_path),
                                                                   seed=str(seed))], env=env, cwd=ROOT)
             for seed in (0, 1)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    cache = json.loads((tmp_path / "evolution.json").read_text())
    (runs,) = cache["runs"].values()
    assert sorted(runs) == ["0", "1"] and all(set(r) == {"dms", "evolution"} for r in runs.values())
    (info,) = cache["info"].values()
    assert sorted(c["seeds"][0] for c in info.get("earlier", []) + [info]) == [0, 1]
