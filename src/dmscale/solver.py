"""The budget solver: the hard structure at the largest exact cost not above the target.

The search ends near, not exactly at, r_t. :func:`solve_budget` first adds one common offset
to every gate's pruning ratio ``a`` (a binary search: the hard cost is non-increasing in it),
then gives single units back greedily, each time the one that adds the least cost, while
the hard cost stays under the target; units that cost nothing (widths inside a block that
depth search removed) go back all at once. ``Searcher.meet_target`` calls it.

Example:
    >>> import torch
    >>> from dmscale.topk import DifferentiableTopK
    >>> gates = [DifferentiableTopK(8), DifferentiableTopK(4)]
    >>> cost = lambda cache=None: float(2 * gates[0].hard_count() + gates[1].hard_count())  # 20 open
    >>> solve_budget(gates, cost, target=10.0)
    >>> cost() <= 10.0, [g.hard_count() for g in gates]
    (True, [4, 2])
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

__all__ = ["solve_budget", "HardCost"]

HardCost = Callable[..., float]  # hard_cost(cache: dict | None = None) -> exact cost of the hard masks


def solve_budget(topks: list[Any], hard_cost: HardCost, target: float, iterations: int = 40) -> None:
    """Move the gates ``topks`` (in place) to the largest ``hard_cost()`` <= ``target``.

    ``hard_cost(cache=None)`` is the exact cost of the current hard masks; during the greedy
    refill the solver passes one ``cache`` dict, in which the cost function may keep each
    gate's recent hard masks (only one gate changes at a time, importance stays fixed).

    A scalar ``a`` is a pruning ratio (DMS) and is shifted directly; a gate with vector
    parameters (a baseline's logits) is shifted in the same ratio terms through ``set_count``.
    """
    base = [float(t.a.detach()) if t.a.numel() == 1 else 1.0 - t.hard_count() / t.n_units
            for t in topks]

    def cost_at(offset: float) -> float:
        with torch.no_grad():
            for t, a0 in zip(topks, base):
                if t.a.numel() == 1:
                    t.a.fill_(a0 + offset)
                    t.clamp_()
                else:
                    ratio = min(max(a0 + offset, 0.0), t.max_ratio)
                    t.set_count(int(round((1.0 - ratio) * t.n_units)))
        return hard_cost()

    lo, hi = -1.0, 1.0  # cost_at(lo) is the largest, cost_at(hi) the smallest
    if cost_at(lo) <= target:
        hi = lo
    for _ in range(iterations):
        if hi - lo < 1e-6:
            break
        mid = (lo + hi) / 2
        if cost_at(mid) <= target:
            hi = mid
        else:
            lo = mid
    cost_at(hi)
    _give_back_units(topks, hard_cost, target)


def _give_back_units(topks: list[Any], hard_cost: HardCost, target: float) -> None:
    """Greedy: add one unit to the dim whose unit costs least, while under target.

    A unit that costs nothing is given back together with every further free unit of its
    dim: the one-by-one greedy would pick them next anyway, at one full cost evaluation per
    dim for each unit (hours for an LLM's FFN widths inside removed layers).
    """
    cache: dict[int, list[Any]] = {}
    current = hard_cost(cache=cache)
    for _ in range(10 * sum(t.n_units for t in topks)):
        best: tuple[float, Any, int] | None = None
        for t in topks:
            k = t.hard_count()
            if k >= t.n_units:
                continue
            old_a = t.a.detach().clone()
            t.set_count(k + 1)
            cost = hard_cost(cache=cache) if t.hard_count() == k + 1 else math.inf
            with torch.no_grad():
                t.a.copy_(old_a)
            if cost <= target and (best is None or cost < best[0]):
                best = (cost, t, k + 1)
        if best is None:
            break
        cost, t, k = best
        if cost <= current:
            k = _last_free_count(t, k, current, hard_cost)
        t.set_count(k)
        current = hard_cost(cache=cache)


def _last_free_count(t: Any, k: int, current: float, hard_cost: HardCost) -> int:
    """The largest count >= ``k`` of ``t`` whose hard cost stays ``current`` (binary search:
    the cost does not fall as a dim keeps more units); ``t`` is left as it was."""
    old_a = t.a.detach().clone()
    lo, hi = k, t.n_units
    while lo < hi:
        mid = (lo + hi + 1) // 2
        t.set_count(mid)
        if t.hard_count() == mid and hard_cost() <= current:
            lo = mid
        else:
            hi = mid - 1
    with torch.no_grad():
        t.a.copy_(old_a)
    return lo
