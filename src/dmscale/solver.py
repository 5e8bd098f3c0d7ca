"""The budget solver: the hard structure at the largest exact cost not above the target.

The search ends near, not exactly at, r_t. :func:`solve_budget` first adds one common offset
to every gate's pruning ratio ``a`` (a binary search: the hard cost is non-increasing in it),
then gives single units back greedily, each time the one that adds the least cost, while
the hard cost stays under the target. ``Searcher.meet_target`` calls it.

Example:
    >>> import torch
    >>> from dmscale.topk import DifferentiableTopK
    >>> gates = [DifferentiableTopK(8), DifferentiableTopK(4)]
    >>> cost = lambda: float(2 * gates[0].hard_count() + gates[1].hard_count())  # 20 when open
    >>> solve_budget(gates, cost, target=10.0)
    >>> cost() <= 10.0, [g.hard_count() for g in gates]
    (True, [4, 2])
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

__all__ = ["solve_budget"]


def solve_budget(topks: list[Any], hard_cost: Callable[[], float], target: float,
                 iterations: int = 40) -> None:
    """Move the gates ``topks`` (in place) to the largest ``hard_cost()`` <= ``target``.

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


def _give_back_units(topks: list[Any], hard_cost: Callable[[], float], target: float) -> None:
    """Greedy: add one unit to the dim whose unit costs least, while under target."""
    for _ in range(10 * sum(t.n_units for t in topks)):
        best: tuple[float, Any, int] | None = None
        for t in topks:
            k = t.hard_count()
            if k >= t.n_units:
                continue
            old_a = t.a.detach().clone()
            t.set_count(k + 1)
            cost = hard_cost() if t.hard_count() == k + 1 else math.inf
            with torch.no_grad():
                t.a.copy_(old_a)
            if cost <= target and (best is None or cost < best[0]):
                best = (cost, t, k + 1)
        if best is None:
            break
        best[1].set_count(best[2])
