"""Random structures at equal cost: the sampler and the rank statistics of the
random-architecture control (issue 50, item 3; ``bench/random_control.py``).

* :func:`space_searcher` -- the search space a run's search uses (its ``dms.prepare`` with the
  run's own options), with ``importance="index"``: every gate keeps its *first* units, the rule
  of the uniform-width baselines (``peers_lib.uniform_structure``), so a structure is set by its
  kept counts alone.
* :func:`sample` -- structures drawn uniformly from that space (per width dim a kept count in
  [min, size] in units of its step, per stage a kept block count in [min, blocks], independently
  and uniformly), accepted when the exact MACs (``dms.count`` of the applied model) lie in a
  window around the target (rejection sampling: the accepted ones are uniform over the
  equal-cost part of the space); it records how many draws that took.
* :func:`structure_at` / :func:`counts_of` -- a structure from kept counts and back (DMS's own
  structure is rebuilt at its counts with the same first-units rule).
* :func:`rank_of`, :func:`per_seed_gaps`, :func:`bootstrap_gap` -- where one arm's mean top-1
  ranks among the random structures' means, and its gap to their median and best.

Example:
    >>> import torch
    >>> from dmscale.tasks.models import ResNetCifar
    >>> m, x = ResNetCifar(width=4, in_channels=1), torch.zeros(1, 1, 8, 8)
    >>> s = space_searcher(m, x)
    >>> out = sample(s, m, x, n=3, target=0.5, seed=0)
    >>> all(0.99 <= f <= 1.0 for f in out["fractions"]), len({tuple(c) for c in out["counts"]})
    (True, 3)
    >>> rank_of(0.97, [0.95, 0.96, 0.98, 0.97])
    {'rank': 2, 'of': 4, 'percentile': 62.5, 'median': 0.965, 'best': 0.98, 'worst': 0.95}
"""

from __future__ import annotations

import copy
import dataclasses
import random
import statistics
from typing import Any, Callable, Sequence

import torch
from torch import nn

import dmscale as dms

__all__ = ["WINDOW", "space_searcher", "gates_of", "counts_of", "structure_at", "sample", "rank_of",
           "per_seed_gaps", "bootstrap_gap"]

WINDOW = (0.99, 1.0)  # accepted MACs / target: within 1 % and, like every arm of the tables, not over it


def space_searcher(model: nn.Module, example: Any,
                   configure: Callable[[], dms.SearchConfig] | None = None) -> dms.Searcher:
    """The search space of ``configure()`` (default: ``dms.SearchConfig()``; a run passes its
    own, e.g. ``lambda: run_cfg.search_config(exclude)``) on a deep copy of ``model``, with
    ``importance="index"`` so every gate keeps its first units: no training is needed to read a
    structure, and which units are kept follows one fixed rule for every structure."""
    cfg = configure() if configure is not None else dms.SearchConfig()
    return dms.prepare(copy.deepcopy(model), example, dataclasses.replace(cfg, importance="index"))


def gates_of(searcher: dms.Searcher) -> list[Any]:
    """The width gates, then the depth gates, in the order of ``structure()["width"]`` / ``["depth"]``."""
    return list(searcher.gates.width) + list(searcher.gates.depth)


def counts_of(structure: dict[str, Any]) -> list[int]:
    """Kept elements per width dim, then kept blocks per stage, of a ``Searcher.structure()``."""
    return [int(w["kept"]) for w in structure.get("width", [])] + \
        [len(d["kept"]) for d in structure.get("depth", [])]


def structure_at(searcher: dms.Searcher, counts: Sequence[int],
                 blocks: Sequence[Sequence[str]] | None = None) -> dict[str, Any]:
    """The structure that keeps ``counts`` (:func:`counts_of`'s layout, elements) first units of
    every gate of ``searcher`` (a :func:`space_searcher`); with ``blocks`` (per stage the names of
    the blocks to keep, e.g. ``[d["kept"] for d in structure["depth"]]`` of a search's structure)
    those blocks instead of each stage's first ones. Which blocks are removed decides which width
    dims still exist (a dim whose layers all sit in a removed block costs nothing), so a
    structure's cost is only reproduced with its own blocks.

    Raises:
        dms.StructureError: ``counts`` has the wrong length, a count the space cannot keep
            (outside [min, size] or not on a unit boundary), or ``blocks`` names a block the
            stage does not have.
    """
    gates = gates_of(searcher)
    if len(counts) != len(gates):
        raise dms.StructureError(f"expected {len(gates)} kept counts ({len(searcher.gates.width)} widths, "
                                 f"{len(searcher.gates.depth)} stages), got {len(counts)}: pass counts_of() "
                                 "of a structure of the same model and search options")
    n_width = len(searcher.gates.width)
    stages = searcher.structure().get("depth", [])
    for i, g in enumerate(searcher.gates.depth):  # rank the blocks to keep first, then by position
        names = stages[i]["blocks"]
        keep = set(blocks[i]) if blocks is not None else set(names[:counts[n_width + i]])
        if not keep <= set(names):
            raise dms.StructureError(f"stage {i}: blocks {sorted(keep - set(names))} are not among its "
                                     f"removable blocks {names}")
        with torch.no_grad():
            g.importance.copy_(torch.tensor([2.0 * len(names) * (n in keep) + len(names) - u
                                             for u, n in enumerate(names)]))
    for g, k in zip(gates, counts):
        g.set_count(-(-int(k) // g.step))  # units (the last one may be short)
    structure = searcher.structure()
    got = counts_of(structure)
    if got != list(counts):
        bad = next(i for i, (a, b) in enumerate(zip(got, counts)) if a != b)
        kind = f"width dim {bad}" if bad < n_width else f"stage {bad - n_width}"
        raise dms.StructureError(f"{kind}: asked to keep {counts[bad]}, the space keeps {got[bad]} "
                                 f"({gates[bad]}): give a count in [min, size] at the gate's step")
    return structure


def _macs(model: nn.Module, example: Any) -> int:
    return int(dms.count(model.eval(), example)["macs"])


def sample(searcher: dms.Searcher, model: nn.Module, example: Any, n: int, target: float,
           window: tuple[float, float] = WINDOW, seed: int = 0, max_draws: int = 1_000_000) -> dict[str, Any]:
    """``n`` distinct structures drawn uniformly from ``searcher``'s space whose exact MACs are
    in ``window`` x (``target`` x ``model``'s MACs); ``target`` > 1 is an absolute MAC count.

    Every gate's kept count is drawn independently and uniformly from [min_units, n_units]; a
    draw is screened by the searcher's exact hard cost and accepted only when ``dms.count`` of
    ``apply_structure(model, structure)`` agrees and lies in the window. A draw equal to an
    accepted one is drawn again (counted as a draw, not as accepted).

    Returns:
        ``{"structures", "counts", "macs", "fractions" (of the target), "draws", "accepted",
        "acceptance" (accepted / draws), "target_macs", "base_macs", "window"}``.

    Raises:
        RuntimeError: fewer than ``n`` accepted in ``max_draws`` draws (a window too narrow
            for the space, or a target below its smallest structure), or the two counters
            disagree on an accepted structure.
    """
    base = _macs(model, example)
    target_macs = float(target) if target > 1 else float(target) * base
    lo, hi = window[0] * target_macs, window[1] * target_macs
    gates, rng = gates_of(searcher), random.Random(seed)
    out: dict[str, Any] = {"structures": [], "counts": [], "macs": [], "fractions": [], "draws": 0,
                           "accepted": 0, "target_macs": target_macs, "base_macs": base, "window": list(window)}
    seen: set[tuple[int, ...]] = set()
    in_window = 0
    with torch.no_grad():  # first units first (a structure_at() call may have re-ranked the blocks)
        for g in gates:
            g.importance.copy_(torch.arange(g.n_units, 0, -1, dtype=g.importance.dtype))
    while len(out["structures"]) < n:
        if out["draws"] >= max_draws:
            raise RuntimeError(f"{len(out['structures'])} of {n} structures in [{lo:.0f}, {hi:.0f}] MACs after "
                               f"{max_draws} draws: widen the window or raise max_draws")
        out["draws"] += 1
        units = [rng.randint(g.min_units, g.n_units) for g in gates]
        for g, k in zip(gates, units):
            g.set_count(k)
        hard = searcher.resources()["hard"]
        if not lo <= hard <= hi:
            continue
        in_window += 1
        structure = searcher.structure()
        key = tuple(counts_of(structure))
        if key in seen:
            continue
        exact = _macs(dms.apply_structure(copy.deepcopy(model), structure), example)
        if exact != round(hard):
            raise RuntimeError(f"the searcher counts {hard:.0f} MACs, dms.count {exact} on the applied model")
        seen.add(key)
        out["structures"].append(structure)
        out["counts"].append(list(key))
        out["macs"].append(exact)
        out["fractions"].append(exact / target_macs)
    out["accepted"] = in_window
    out["acceptance"] = in_window / out["draws"]
    return out


def rank_of(value: float, others: Sequence[float]) -> dict[str, Any]:
    """Rank of ``value`` among ``others`` (1 = above all; 1 + how many are higher), its
    percentile (share of ``others`` below it, ties counted half, in %) and ``others``'
    median, best and worst."""
    above = sum(o > value for o in others)
    ties = sum(o == value for o in others)
    below = len(others) - above - ties
    return {"rank": 1 + above, "of": len(others), "percentile": 100.0 * (below + 0.5 * ties) / len(others),
            "median": statistics.median(others), "best": max(others), "worst": min(others)}


def per_seed_gaps(arm: Sequence[float], randoms: Sequence[Sequence[float]], best: int) -> dict[str, list[float]]:
    """Per seed, ``arm`` (one top-1 per seed) minus the median of the random structures' top-1
    at that seed, and minus structure ``best``'s top-1 at that seed (``randoms[j][i]``:
    structure j, seed i; the same seed order as ``arm``), in points (x 100)."""
    return {"median": [100 * (a - statistics.median(r[i] for r in randoms)) for i, a in enumerate(arm)],
            "best": [100 * (a - randoms[best][i]) for i, a in enumerate(arm)]}


def _gaps(a: torch.Tensor, r: torch.Tensor, stat: str) -> torch.Tensor:
    """Per draw, ``a``'s mean (draws, seeds) minus the ``stat`` of ``r``'s per-structure means
    (draws, structures, seeds), in points: the median as :func:`statistics.median` takes it (the
    mean of the middle two of an even count)."""
    means = r.mean(dim=2).sort(dim=1).values  # (draws, structures)
    n = means.shape[1]
    if stat == "best":
        pick = means[:, -1]
    else:
        pick = means[:, n // 2] if n % 2 else (means[:, n // 2 - 1] + means[:, n // 2]) / 2
    return 100 * (a.mean(dim=1) - pick)


def bootstrap_gap(arm: Sequence[float], randoms: Sequence[Sequence[float]], stat: str = "median",
                  draws: int = 10_000, level: float = 0.95, seed: int = 0) -> tuple[float, float, float]:
    """``arm``'s mean top-1 minus the ``stat`` ("median" or "best") of the random structures'
    mean top-1, in points, with a percentile bootstrap interval that resamples both the
    structures and the seeds (one seed draw shared by the arm and every structure: the
    pairing of a seed's batches and initialisation is kept).

    Returns:
        ``(gap, low, high)``.
    """
    if stat not in ("median", "best"):
        raise ValueError(f"stat must be 'median' or 'best', got {stat!r}")
    a = torch.tensor(arm, dtype=torch.float64)
    r = torch.tensor(randoms, dtype=torch.float64)  # (structures, seeds)
    n_s, n_seed = r.shape
    g = torch.Generator().manual_seed(seed)
    # the draws one at a time, structures then seeds (the generator's order: the intervals of
    # the committed tables), then every draw's gap at once
    js, ss = [], []
    for _ in range(draws):
        js.append(torch.randint(0, n_s, (n_s,), generator=g))
        ss.append(torch.randint(0, n_seed, (n_seed,), generator=g))
    j, s = torch.stack(js), torch.stack(ss)  # (draws, structures), (draws, seeds)
    values = _gaps(a[s], r[j.unsqueeze(2), s.unsqueeze(1)], stat).tolist()
    values.sort()
    tail = (1 - level) / 2
    gap = float(_gaps(a[None], r[None], stat)[0])
    return gap, values[int(tail * draws)], values[min(draws - 1, int((1 - tail) * draws))]
