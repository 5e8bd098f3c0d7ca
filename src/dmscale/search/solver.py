"""The budget solver: the hard structure at the largest exact cost not above the target.

The search ends near, not exactly at, r_t. :func:`solve_budget` first adds one common offset
to every gate's pruning ratio ``a`` (a binary search: the hard cost is non-increasing in it),
optionally a second common offset of the widths alone with depth fixed (to fill what a
dropped block left free), then gives single units back greedily, in the order a falling
common offset would add them, while the hard cost stays under the target; units that cost
nothing (widths inside a block that depth search removed) go back first, all at once. ``Searcher.meet_target`` calls it.

Example:
    >>> import torch
    >>> from dmscale.core.topk import DifferentiableTopK
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


def _shift_to(topks: list[Any], base: list[float], offset: float) -> None:
    """Set every gate's pruning ratio to its ``base`` + ``offset`` (clamped); a gate with
    vector parameters (a baseline's logits) is moved in the same ratio terms by ``set_count``."""
    with torch.no_grad():
        for t, a0 in zip(topks, base):
            if t.a.numel() == 1:
                t.a.fill_(a0 + offset)
                t.clamp_()
            else:
                ratio = min(max(a0 + offset, 0.0), t.max_ratio)
                t.set_count(int(round((1.0 - ratio) * t.n_units)))


def _ratios(topks: list[Any]) -> list[float]:
    return [float(t.a.detach()) if t.a.numel() == 1 else 1.0 - t.hard_count() / t.n_units for t in topks]


def _common_offset(topks: list[Any], hard_cost: HardCost, target: float, lo: float, hi: float,
                   iterations: int) -> None:
    """Leave ``topks`` at the offset in [lo, hi] (added to their ratios now) with the largest
    ``hard_cost()`` <= ``target`` (binary search: the cost is non-increasing in the offset);
    ``hi`` must fit, or is the best there is."""
    base = _ratios(topks)

    def cost_at(offset: float) -> float:
        _shift_to(topks, base, offset)
        return hard_cost()

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


def solve_budget(topks: list[Any], hard_cost: HardCost, target: float, iterations: int = 40,
                 refill: list[Any] | None = None) -> None:
    """Move the gates ``topks`` (in place) to the largest ``hard_cost()`` <= ``target``.

    ``hard_cost(cache=None)`` is the exact cost of the current hard masks; during the greedy
    refill the solver passes one ``cache`` dict, in which the cost function may keep each
    gate's recent hard masks (only one gate changes at a time, importance stays fixed).

    A scalar ``a`` is a pruning ratio (DMS) and is shifted directly; a gate with vector
    parameters (a baseline's logits) is shifted in the same ratio terms through ``set_count``.

    ``refill`` (a subset of ``topks``, the widths when depth is searched too): after the
    common offset, a second common offset of these gates alone, the others fixed, fills what
    the first left unused. A depth gate has few, costly units: the offset at which it drops
    a block can leave a large part of the budget free, which a refill by cheapest unit would
    hand to the dims whose units cost least, regardless of what the search learned; the
    second offset keeps the learned ratios of the widths instead.
    """
    _common_offset(topks, hard_cost, target, -1.0, 1.0, iterations)
    if refill:
        _common_offset(refill, hard_cost, target, -1.0, 0.0, iterations)
    _give_back_units(topks, hard_cost, target)


def _give_back_units(topks: list[Any], hard_cost: HardCost, target: float) -> None:
    """Greedy: give back one unit at a time while under target, in the order in which a
    falling common offset would add them (largest ``(1 - a) - (k + 1/2) / N`` first, ``a``
    the ratios the greedy starts from), skipping units that do not fit; ties go to the
    cheaper unit. The budget left after the offsets thus goes to the dims the learned
    ratios put next, not to the dims whose units cost least.

    A unit that costs nothing is given back first, together with every further free unit of
    its dim: the one-by-one greedy would pick them next anyway, at one full cost evaluation
    per dim for each unit (hours for an LLM's FFN widths inside removed layers).
    """
    cache: dict[int, list[Any]] = {}
    current = hard_cost(cache=cache)
    want = {id(t): 1.0 - r for t, r in zip(topks, _ratios(topks))}  # kept fraction the ratios ask for
    for _ in range(10 * sum(t.n_units for t in topks)):
        best: tuple[tuple[bool, float, float], Any, int] | None = None
        for t in topks:
            k = t.hard_count()
            if k >= t.n_units:
                continue
            old_a = t.a.detach().clone()
            t.set_count(k + 1)
            cost = hard_cost(cache=cache) if t.hard_count() == k + 1 else math.inf
            with torch.no_grad():
                t.a.copy_(old_a)
            key = (cost > current, -(want[id(t)] - (k + 0.5) / t.n_units), cost)
            if cost <= target and (best is None or key < best[0]):
                best = (key, t, k + 1)
        if best is None:
            break
        key, t, k = best
        if not key[0]:  # free: every further free unit of this dim at once
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
