"""Evolutionary search over per-dimension counts on a pretrained supernet (issue 10, table 3).

The standard one-shot NAS search of SPOS / OFA (Guo et al. 2020, Cai et al. 2020) on the
same search space DMS searches: one integer per structural dimension (kept channels of each
width group, kept blocks of each stage), i.e. the hard count of each gate of a
:class:`dmscale.Searcher`.

* **candidates**: a tuple of counts, one per distinct gate, each in ``[min_units, n_units]``;
  its cost is the project's exact cost, ``searcher.resources()["hard"]`` after
  ``set_count`` on every gate (what the export of that structure counts with
  :func:`dmscale.count`). Only candidates at or under the target are ever evaluated
  (rejection sampling, as OFA's constrained search).
* **which elements**: a gate keeps its ``k`` most important elements; importance is what the
  searcher holds (the bench fills it with :func:`importance_pass`, DMS's own Taylor moving
  average at DMS's initial masks).
* **search**: a random initial population, then per generation the ``parents`` fittest
  candidates so far survive (elitism) and ``n_mutation`` children by mutation (each count
  resampled with probability ``mutation_prob``) and ``n_crossover`` by uniform crossover of
  two parents are added. A candidate seen before is not evaluated again.
* **fitness**: a callable ``counts -> float``; the bench's :func:`supernet_fitness` is the
  validation accuracy of the hardened supernet after BatchNorm recalibration.

Example:
    >>> import torch
    >>> from torch import nn
    >>> import dmscale as dms
    >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> s = dms.prepare(net, torch.randn(2, 4), dms.SearchConfig("params", 0.5, importance="index"))
    >>> space = SearchSpace.of(s)
    >>> cfg = EvolutionConfig(population=6, generations=3, parents=3, n_mutation=3, n_crossover=3)
    >>> result = evolve(space, lambda counts: float(sum(counts)), cfg)
    >>> all(c.cost <= space.target for c in result.evaluated)
    True
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn

import dmscale as dms

__all__ = ["EvolutionConfig", "SearchSpace", "Candidate", "Improvement", "EvolutionResult", "evolve",
           "importance_pass", "supernet_fitness", "hold_out", "CpuClock"]

Counts = tuple[int, ...]


@dataclass(frozen=True)
class EvolutionConfig:
    """Budget and operators of :func:`evolve` (SPOS's defaults: 50 x 20, top 10, p = 0.1).

    The evaluation budget is at most ``population + generations * (n_mutation + n_crossover)``
    distinct candidates.
    """

    population: int = 50
    generations: int = 20
    parents: int = 10
    n_mutation: int = 25
    n_crossover: int = 25
    mutation_prob: float = 0.1
    max_tries: int = 200
    seed: int = 0
    max_seconds: float | None = None  # stop early once the clock passes this (a guard, not the budget)

    def __post_init__(self) -> None:
        for name in ("population", "parents", "max_tries"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("generations", "n_mutation", "n_crossover"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.parents > self.population:
            raise ValueError(f"parents ({self.parents}) must be <= population ({self.population})")
        if self.max_seconds is not None and not self.max_seconds > 0:
            raise ValueError(f"max_seconds must be > 0 or None, got {self.max_seconds}")
        if not 0.0 < self.mutation_prob <= 1.0:
            raise ValueError(f"mutation_prob must be in (0, 1], got {self.mutation_prob}")

    @property
    def budget(self) -> int:
        """Most candidates one search evaluates."""
        return self.population + self.generations * (self.n_mutation + self.n_crossover)


@dataclass(frozen=True)
class Candidate:
    counts: Counts
    cost: float
    fitness: float


@dataclass(frozen=True)
class Improvement:
    """A new best candidate: when (``seconds`` of the search's clock) and after how many evaluations."""

    candidate: Candidate
    evaluations: int
    generation: int
    seconds: float


@dataclass
class EvolutionResult:
    best: Candidate
    evaluated: list[Candidate] = field(default_factory=list)
    improvements: list[Improvement] = field(default_factory=list)
    best_per_generation: list[float] = field(default_factory=list)
    stopped_early: bool = False


class CpuClock:
    """Process CPU seconds, with :meth:`paused` spans (e.g. test-set reporting) left out."""

    def __init__(self) -> None:
        self._start = time.process_time()
        self._excluded = 0.0

    def __call__(self) -> float:
        return time.process_time() - self._start - self._excluded

    def paused(self) -> "_Pause":
        return _Pause(self)


class _Pause:
    def __init__(self, clock: CpuClock) -> None:
        self.clock = clock

    def __enter__(self) -> None:
        self.t = time.process_time()

    def __exit__(self, *exc: object) -> None:
        self.clock._excluded += time.process_time() - self.t


@dataclass
class SearchSpace:
    """The distinct gates of a searcher, their count ranges and the exact cost of a candidate."""

    searcher: dms.Searcher
    gates: list[Any]
    low: Counts
    high: Counts
    target: float

    @classmethod
    def of(cls, searcher: dms.Searcher) -> "SearchSpace":
        seen: set[int] = set()
        gates = []
        for t in list(searcher.gates.width) + list(searcher.gates.depth):
            if id(t) not in seen:
                seen.add(id(t))
                gates.append(t)
        return cls(searcher, gates, tuple(int(t.min_units) for t in gates),
                   tuple(int(t.n_units) for t in gates), float(searcher.target_cost))

    def set(self, counts: Counts) -> None:
        """Hard masks of ``counts`` (``set_count`` on every gate)."""
        for t, k in zip(self.gates, counts):
            t.set_count(k)

    def cost(self, counts: Counts) -> float:
        """Exact cost of ``counts`` (the searcher's hard cost)."""
        self.set(counts)
        return float(self.searcher.resources()["hard"])

    def counts(self) -> Counts:
        """The gates' current hard counts."""
        return tuple(int(t.hard_count()) for t in self.gates)


def _under(space: SearchSpace, make: Callable[[], Counts], tries: int) -> tuple[Counts, float] | None:
    """The first of up to ``tries`` candidates from ``make()`` whose cost fits the target."""
    for _ in range(tries):
        counts = make()
        cost = space.cost(counts)
        if cost <= space.target * (1 + 1e-9):
            return counts, cost
    return None


def _random(space: SearchSpace, rng: random.Random) -> Counts:
    return tuple(rng.randint(lo, hi) for lo, hi in zip(space.low, space.high))


def _mutate(space: SearchSpace, parent: Counts, p: float, rng: random.Random) -> Counts:
    return tuple(rng.randint(lo, hi) if rng.random() < p else k
                 for k, lo, hi in zip(parent, space.low, space.high))


def _crossover(a: Counts, b: Counts, rng: random.Random) -> Counts:
    return tuple(x if rng.random() < 0.5 else y for x, y in zip(a, b))


def _children(space: SearchSpace, parents: list[Candidate], cfg: EvolutionConfig,
              rng: random.Random) -> Iterator[tuple[Counts, float]]:
    """Mutation children, then crossover children, each under the target (or skipped)."""
    makers: list[Callable[[], Counts]] = (
        [lambda: _mutate(space, rng.choice(parents).counts, cfg.mutation_prob, rng)] * cfg.n_mutation
        + [lambda: _crossover(rng.choice(parents).counts, rng.choice(parents).counts, rng)] * cfg.n_crossover)
    for make in makers:
        found = _under(space, make, cfg.max_tries)
        if found is not None:
            yield found


def evolve(space: SearchSpace, fitness: Callable[[Counts], float], cfg: EvolutionConfig,
           clock: Callable[[], float] | None = None) -> EvolutionResult:
    """Constrained evolutionary search: the fittest candidate at or under ``space.target``.

    ``clock()`` time-stamps each new best (default: process CPU seconds since the call); once
    it passes ``cfg.max_seconds`` no more candidates are evaluated (``result.stopped_early``).
    The best fitness never decreases (the best candidate always survives as a parent).
    """
    clock = clock or CpuClock()
    rng = random.Random(cfg.seed)
    seen: dict[Counts, Candidate] = {}
    result = EvolutionResult(best=Candidate((), float("inf"), float("-inf")))

    def out_of_time() -> bool:
        result.stopped_early = cfg.max_seconds is not None and clock() > cfg.max_seconds
        return result.stopped_early

    def consider(counts: Counts, cost: float, generation: int) -> None:
        if counts in seen or out_of_time():
            return
        cand = Candidate(counts, cost, float(fitness(counts)))
        seen[counts] = cand
        result.evaluated.append(cand)
        if cand.fitness > result.best.fitness:
            result.best = cand
            result.improvements.append(Improvement(cand, len(result.evaluated), generation, clock()))

    for _ in range(cfg.population):
        found = _under(space, lambda: _random(space, rng), cfg.max_tries)
        if found is not None:
            consider(*found, 0)
        if result.stopped_early:
            break
    if not result.evaluated:
        raise ValueError(f"no random candidate of {cfg.max_tries} tries fits the target {space.target:,.0f}")
    result.best_per_generation.append(result.best.fitness)
    for gen in range(1, cfg.generations + 1):
        parents = sorted(seen.values(), key=lambda c: c.fitness, reverse=True)[:cfg.parents]
        for counts, cost in _children(space, parents, cfg, rng):
            consider(counts, cost, gen)
            if result.stopped_early:
                break
        result.best_per_generation.append(result.best.fitness)
        if result.stopped_early:
            break
    space.set(result.best.counts)
    return result


def hold_out(x: torch.Tensor, y: torch.Tensor, fraction: float, seed: int
             ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """A seeded split of training data into (fit, validation); ``fraction`` goes to validation."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"fraction must be in (0, 1), got {fraction}")
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_val = max(1, int(round(fraction * len(x))))
    val, fit = perm[:n_val], perm[n_val:]
    return (x[fit], y[fit]), (x[val], y[val])


def importance_pass(searcher: dms.Searcher, model: nn.Module, batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
                    loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]) -> int:
    """DMS's Taylor importance (paper Eq. 4) without any structure update: task-loss forward
    and backward at the searcher's current (initial) soft masks, weights frozen, ``a``
    untouched. Returns the number of batches."""
    frozen = [p for p in searcher.model_parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    was = model.training
    model.train()
    n = 0
    try:
        for x, y in batches:
            loss = loss_fn(model, x, y)
            loss.backward()
            for p in searcher.structure_parameters():
                p.grad = None
            n += 1
    finally:
        model.train(was)
        for p in frozen:
            p.requires_grad_(True)
    return n


def supernet_fitness(space: SearchSpace, model: nn.Module, recalibrate: Callable[[nn.Module], Any],
                     evaluate: Callable[[nn.Module], float]) -> Callable[[Counts], float]:
    """Fitness of a candidate: ``evaluate`` of the hardened supernet (the export's exact
    function) after ``recalibrate`` re-estimated its BatchNorm statistics (OFA's protocol)."""
    def fitness(counts: Counts) -> float:
        space.set(counts)
        with space.searcher.hardened():
            recalibrate(model)
            return float(evaluate(model))

    return fitness

