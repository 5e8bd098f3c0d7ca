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

Several budgets (``target`` a tuple, ``hard_cost`` returning one cost per budget): a structure
fits when every cost is at or under its target, which stays monotone in a common offset, so
the offsets stop at the first budget they would exceed (the binding one). The other budgets
may then sit well under theirs: the gates whose next unit adds nothing to the binding budget
(e.g. FFN widths against a KV-cache budget set by the heads) get a common offset of their own
until the next budget binds, once per budget; the greedy then gives units back while every
budget fits.

    >>> a, b = DifferentiableTopK(8), DifferentiableTopK(8)
    >>> costs = lambda cache=None: (float(a.hard_count() + b.hard_count()), float(a.hard_count()))
    >>> solve_budget([a, b], costs, target=(12.0, 4.0))  # 16 units in all, 4 of them a's
    >>> [a.hard_count(), b.hard_count()], costs()
    ([4, 8], (12.0, 4.0))
"""

from __future__ import annotations

from typing import Any, Callable, Hashable

import torch

from dmscale.core.ratios import ratio_key

__all__ = ["solve_budget", "solve_budgets", "distinct_gates", "HardCost"]

HardCost = Callable[..., Any]  # hard_cost(cache: dict | None = None) -> exact cost(s) of the hard masks


class _Budgets:
    """``hard_cost`` as a tuple of costs (one per budget) and the test that they fit."""

    def __init__(self, hard_cost: HardCost, target: float | tuple[float, ...]) -> None:
        self.multi = isinstance(target, (tuple, list))
        self.targets = tuple(float(t) for t in target) if self.multi else (float(target),)
        self._cost = hard_cost

    def __call__(self, cache: dict[int, list[Any]] | None = None) -> tuple[float, ...]:
        c = self._cost(cache=cache) if cache is not None else self._cost()
        return tuple(float(x) for x in c) if self.multi else (float(c),)

    def fits(self, costs: tuple[float, ...]) -> bool:
        return all(c <= t for c, t in zip(costs, self.targets))

    def share(self, costs: tuple[float, ...]) -> float:
        """The costs as one number to break ties with: the sum of cost / target."""
        return sum(c / max(t, 1e-12) for c, t in zip(costs, self.targets))


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


def _smallest_fitting(fits: Any, lo: float, hi: float, iterations: int) -> float:
    """The smallest offset in [lo, hi] at which ``fits`` holds, by bisection (``fits`` is
    monotone: false below some offset, true from it on); ``hi`` when nothing below fits."""
    if fits(lo):
        return lo
    for _ in range(iterations):
        if hi - lo < 1e-6:
            break
        mid = (lo + hi) / 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return hi


def _common_offset(topks: list[Any], budgets: _Budgets, lo: float, hi: float, iterations: int) -> None:
    """Leave ``topks`` at the offset in [lo, hi] (added to their ratios now) with the largest
    cost that fits every budget (binary search: the costs are non-increasing in the offset);
    ``hi`` must fit, or is the best there is."""
    base = _ratios(topks)

    def fits_at(offset: float) -> bool:
        _shift_to(topks, base, offset)
        return budgets.fits(budgets())

    _shift_to(topks, base, _smallest_fitting(fits_at, lo, hi, iterations))


def solve_budget(topks: list[Any], hard_cost: HardCost, target: float | tuple[float, ...],
                 iterations: int = 40, refill: list[Any] | None = None) -> None:
    """Move the gates ``topks`` (in place) to the largest ``hard_cost()`` <= ``target``.

    ``hard_cost(cache=None)`` is the exact cost of the current hard masks; during the greedy
    refill the solver passes one ``cache`` dict, in which the cost function may keep each
    gate's recent hard masks (only one gate changes at a time, importance stays fixed).
    With several budgets ``target`` is a tuple and ``hard_cost`` returns one cost per budget,
    in the same order; every one must fit (see the module's docstring).

    A scalar ``a`` is a pruning ratio (DMS) and is shifted directly; a gate with vector
    parameters (a baseline's logits) is shifted in the same ratio terms through ``set_count``.

    ``refill`` (a subset of ``topks``, the widths when depth is searched too): after the
    common offset, a second common offset of these gates alone, the others fixed, fills what
    the first left unused. A depth gate has few, costly units: the offset at which it drops
    a block can leave a large part of the budget free, which a refill by cheapest unit would
    hand to the dims whose units cost least, regardless of what the search learned; the
    second offset keeps the learned ratios of the widths instead.
    """
    budgets = _Budgets(hard_cost, target)
    _common_offset(topks, budgets, -1.0, 1.0, iterations)
    if refill:
        _common_offset(refill, budgets, -1.0, 0.0, iterations)
    if budgets.multi:
        _fill_slack(refill or topks, budgets, iterations)
        _exchange(refill or topks, budgets, iterations // 2)
    _give_back_units(topks, budgets)


def _adds_to(t: Any, budgets: _Budgets, current: tuple[float, ...]) -> list[bool] | None:
    """Per budget, whether one more unit of ``t`` raises its cost (None: ``t`` is whole);
    ``t`` is left as it was."""
    k = t.hard_count()
    if k >= t.n_units:
        return None
    old_a = t.a.detach().clone()
    t.set_count(k + 1)
    costs = budgets()
    with torch.no_grad():
        t.a.copy_(old_a)
    return [c > cur for c, cur in zip(costs, current)]


def _fill_slack(topks: list[Any], budgets: _Budgets, iterations: int) -> None:
    """Several budgets: the offsets stopped at the binding budget (the largest cost / target);
    a common offset of the gates that add nothing to it (nor to any budget that bound before)
    fills the others, once per budget."""
    bound: set[int] = set()
    for _ in range(len(budgets.targets)):
        current = budgets()
        bound.add(max(range(len(current)), key=lambda i: current[i] / max(budgets.targets[i], 1e-12)))
        free = []
        for t in topks:
            adds = _adds_to(t, budgets, current)
            if adds is not None and not any(adds[i] for i in bound):
                free.append(t)
        if not free:
            return
        _common_offset(free, budgets, -1.0, 0.0, iterations)


def _touches(t: Any, budgets: _Budgets, current: tuple[float, ...]) -> list[bool]:
    """Per budget, whether one unit of ``t`` (the next one, or the last kept when ``t`` is
    whole) changes its cost; ``t`` is left as it was."""
    k = t.hard_count()
    step = 1 if k < t.n_units else -1
    old_a = t.a.detach().clone()
    t.set_count(k + step)
    costs = budgets()
    with torch.no_grad():
        t.a.copy_(old_a)
    return [c != cur for c, cur in zip(costs, current)]


def _exchange(topks: list[Any], budgets: _Budgets, iterations: int) -> None:
    """Several budgets: trade the binding budget's share for the least-filled one's. The gates
    that add to the least-filled budget ``k`` grow by a common offset while those that add to
    the binding budget ``b`` but not to ``k`` shrink just enough for every budget to fit
    (e.g. more KV heads, narrower FFNs); the largest growth that fits is kept when it fills
    ``k`` more without leaving any budget less filled than ``k`` was."""
    current = budgets()
    shares = [c / max(t, 1e-12) for c, t in zip(current, budgets.targets)]
    b, k = shares.index(max(shares)), shares.index(min(shares))
    if b == k:
        return
    touch = {id(t): _touches(t, budgets, current) for t in topks}
    grow = [t for t in topks if touch[id(t)][k]]
    shrink = [t for t in topks if touch[id(t)][b] and not touch[id(t)][k]]
    if not grow or not shrink:
        return
    base = _ratios(topks)
    base_g, base_s = _ratios(grow), _ratios(shrink)

    def fits_with(offset: float) -> bool:  # grow by -offset, shrink as little as needed
        _shift_to(grow, base_g, offset)
        _shift_to(shrink, base_s, 0.0)
        _common_offset(shrink, budgets, 0.0, 1.0, iterations)
        return budgets.fits(budgets())

    fits = fits_with(_smallest_fitting(fits_with, -1.0, 0.0, iterations))
    after = [c / max(t, 1e-12) for c, t in zip(budgets(), budgets.targets)]
    if not fits or min(after) <= shares[k]:  # no better: back to where it was
        _shift_to(topks, base, 0.0)


def _give_back_units(topks: list[Any], budgets: _Budgets) -> None:
    """Greedy: give back one unit at a time while every budget fits, in the order in which a
    falling common offset would add them (largest ``(1 - a) - (k + 1/2) / N`` first, ``a``
    the ratios the greedy starts from), skipping units that do not fit; ties go to the
    cheaper unit. The budget left after the offsets thus goes to the dims the learned
    ratios put next, not to the dims whose units cost least.

    A unit that costs nothing is given back first, together with every further free unit of
    its dim: the one-by-one greedy would pick them next anyway, at one full cost evaluation
    per dim for each unit (hours for an LLM's FFN widths inside removed layers).
    """
    cache: dict[int, list[Any]] = {}
    current = budgets(cache=cache)
    want = {id(t): 1.0 - r for t, r in zip(topks, _ratios(topks))}  # kept fraction the ratios ask for
    for _ in range(10 * sum(t.n_units for t in topks)):
        best: tuple[tuple[bool, float, float], Any, int] | None = None
        for t in topks:
            k = t.hard_count()
            if k >= t.n_units:
                continue
            old_a = t.a.detach().clone()
            t.set_count(k + 1)
            cost = budgets(cache=cache) if t.hard_count() == k + 1 else None
            with torch.no_grad():
                t.a.copy_(old_a)
            if cost is None or not budgets.fits(cost):
                continue
            costly = any(c > cur for c, cur in zip(cost, current))
            key = (costly, -(want[id(t)] - (k + 0.5) / t.n_units), budgets.share(cost))
            if best is None or key < best[0]:
                best = (key, t, k + 1)
        if best is None:
            break
        key, t, k = best
        if not key[0]:  # free: every further free unit of this dim at once
            k = _last_free_count(t, k, current, budgets)
        t.set_count(k)
        current = budgets(cache=cache)


def _last_free_count(t: Any, k: int, current: tuple[float, ...], budgets: _Budgets) -> int:
    """The largest count >= ``k`` of ``t`` whose hard costs stay ``current`` (binary search:
    the cost does not fall as a dim keeps more units); ``t`` is left as it was."""
    old_a = t.a.detach().clone()
    lo, hi = k, t.n_units
    while lo < hi:
        mid = (lo + hi + 1) // 2
        t.set_count(mid)
        if t.hard_count() == mid and all(c <= cur for c, cur in zip(budgets(), current)):
            lo = mid
        else:
            hi = mid - 1
    with torch.no_grad():
        t.a.copy_(old_a)
    return lo


def distinct_gates(topks: list[Any]) -> list[Any]:
    """One gate per distinct ``a`` (layer-uniform dims share theirs)."""
    seen: set[Hashable] = set()
    out = []
    for t in topks:
        key = ratio_key(t)
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


def solve_budgets(widths: list[Any], depth: list[Any], leaves: list[torch.nn.Parameter],
                  hard_cost: HardCost, targets: tuple[float, ...], iterations: int,
                  fills: Callable[[], bool]) -> None:
    """The budget solver with several budgets. One solve moves every gate from the learned
    ratios; when it leaves a budget under ``budget_band[0]`` x its target (``fills()`` is
    False) and depth is searched, it also tries depth fixed at its current hard value and
    depth all kept (a common offset cannot trade heads for layers: a KV-cache budget met by
    dropping a layer can leave the parameter budget out of reach), and keeps the structure
    whose least-filled budget is fullest.

    ``widths`` and ``depth``: the distinct width gates and the depth gates to move (no depth
    gates while depth is frozen); ``leaves``: the structural parameters, restored before each
    try and set to the best one's; ``hard_cost(cache=None)``: every budget's exact cost.
    """
    start = [p.detach().clone() for p in leaves]

    def attempt(open_depth: bool, with_depth: bool) -> tuple[float, float, list[torch.Tensor]]:
        with torch.no_grad():
            for p, v in zip(leaves, start):
                p.copy_(v)
        if open_depth:
            for t in depth:
                t.set_count(t.n_units)
        gates = distinct_gates(widths + depth) if with_depth else widths
        solve_budget(gates, hard_cost, targets, iterations,
                     refill=widths if with_depth and depth and widths else None)
        shares = [c / t for c, t in zip(hard_cost(), targets)]
        fits = all(c <= t * (1 + 1e-9) for c, t in zip(hard_cost(), targets))
        return (float(fits) + min(shares), sum(shares), [p.detach().clone() for p in leaves])

    tried = [attempt(False, True)]
    if depth and widths and not fills():
        tried += [attempt(False, False), attempt(True, False)]
    best = max(tried, key=lambda x: (x[0], x[1]))
    with torch.no_grad():
        for p, v in zip(leaves, best[2]):
            p.copy_(v)
