"""Instruments for the DMS_np vs uniform-width table (issue 10, table 3): what the search
learned, when, and what the post-hoc steps changed.

* :class:`TracedPipeline` -- the project's :class:`dmscale.run.pipeline.Pipeline`, unchanged in
  what it computes, that also records snapshots of the structure (kept fraction of every
  gate, from its hard count) and of the importance buffers during the search (at every tenth
  of it), at the search's end, after the finish phase and after the budget solver.
* :func:`spearman` / :func:`topk_agreement` -- how stable importance is across snapshots.
* :func:`structure_shift` -- how far two snapshots' kept fractions are apart.
* :func:`stability` -- both, for every snapshot against the search's end.

Example:
    >>> import torch
    >>> round(spearman(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0, 20.0, 30.0])), 3)
    1.0
    >>> topk_agreement(torch.tensor([3.0, 2.0, 1.0, 0.0]), torch.tensor([0.0, 2.0, 3.0, 1.0]), 2)
    0.5
    >>> effective_kept({"width": [{"size": 4, "kept": 2, "producers": ["b.1.conv"]}],
    ...                 "depth": [{"blocks": ["b.0", "b.1"], "kept": ["b.0"]}],
    ...                 "removed_blocks": [{"name": "b.1"}]})
    [0.0, 0.5]
    >>> structure_shift({"kept": [0.5, 1.0]}, {"kept": [0.25, 1.0]})
    {'mean_abs': 0.125, 'max_abs': 0.25, 'changed': 1}
"""

from __future__ import annotations

import dataclasses

from typing import Any

import torch

from dmscale.run.pipeline import Pipeline

__all__ = ["TracedPipeline", "snapshot", "effective_kept", "spearman", "topk_agreement", "structure_shift", "stability",
           "SNAPSHOTS"]

SNAPSHOTS = 10  # importance / structure snapshots during the search: at progress 0.1, 0.2, ...


def _ranks(x: torch.Tensor) -> torch.Tensor:
    """Average ranks (ties share the mean of their positions), 0-based, float64."""
    x = x.detach().double().flatten()
    order = torch.argsort(x, stable=True)
    ranks = torch.empty_like(x)
    ranks[order] = torch.arange(len(x), dtype=torch.float64)
    for v in torch.unique(x):  # ties: mean rank (importance 0 for never-updated units)
        idx = (x == v).nonzero().flatten()
        if len(idx) > 1:
            ranks[idx] = ranks[idx].mean()
    return ranks


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman rank correlation of two importance vectors (nan when either is constant)."""
    ra, rb = _ranks(a), _ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = float(ra.norm() * rb.norm())
    return float((ra * rb).sum()) / den if den > 0 else float("nan")


def topk_agreement(a: torch.Tensor, b: torch.Tensor, k: int) -> float:
    """Share of ``b``'s top-``k`` units that are also in ``a``'s top-``k`` (1 when k is 0 or all)."""
    n = a.numel()
    if k <= 0 or k >= n:
        return 1.0
    top_a = set(torch.argsort(a.detach(), descending=True, stable=True)[:k].tolist())
    top_b = set(torch.argsort(b.detach(), descending=True, stable=True)[:k].tolist())
    return len(top_a & top_b) / k


def effective_kept(structure: dict[str, Any]) -> list[float]:
    """Kept fraction of every width dim (0 when all its producers sit in removed blocks: it
    does not exist in the export) and of every stage's blocks, from ``searcher.structure()``."""
    removed = [b["name"] + "." for b in structure.get("removed_blocks", [])]

    def alive(layer: str) -> bool:
        return not any(layer.startswith(r) for r in removed)

    widths = [w["kept"] / w["size"] if any(alive(p) for p in w["producers"]) else 0.0
              for w in structure.get("width", [])]
    return widths + [len(d["kept"]) / len(d["blocks"]) for d in structure.get("depth", [])]


def snapshot(searcher: Any, progress: float) -> dict[str, Any]:
    """The structure's effective kept fractions (:func:`effective_kept`), and every gate's
    hard count, ratio ``a`` and importance (widths first then depths, in the searcher's order)."""
    gates = list(searcher.gates.width) + list(searcher.gates.depth)
    return {"progress": progress,
            "kept": effective_kept(searcher.structure()),
            "counts": [g.hard_count() for g in gates],
            "ratios": [float(g.a.detach()) for g in gates],
            "n_width": len(searcher.gates.width),
            "importance": [g.importance.detach().clone() for g in gates],
            "hard_over_target": searcher.resources()["hard"] / searcher.target_cost}


def structure_shift(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Mean and largest |difference| of the kept fractions of two snapshots, and how many
    gates changed their count."""
    diffs = [abs(x - y) for x, y in zip(a["kept"], b["kept"])]
    return {"mean_abs": sum(diffs) / len(diffs), "max_abs": max(diffs),
            "changed": sum(d > 1e-12 for d in diffs)}


def stability(snaps: list[dict[str, Any]], ref: dict[str, Any],
              counts: list[int] | None = None) -> list[dict[str, Any]]:
    """For every snapshot: mean Spearman correlation of its importance with ``ref``'s (over
    gates with more than one unit), mean share of ``ref``'s top-k units already in its top-k
    (k = ``counts``, default ``ref``'s hard counts), and the structure's distance to ``ref``."""
    out = []
    for s in snaps:
        rhos, agree = [], []
        for imp, ref_imp, k in zip(s["importance"], ref["importance"], counts or ref["counts"]):
            if imp.numel() < 2:
                continue
            rho = spearman(imp, ref_imp)
            if rho == rho:  # not nan
                rhos.append(rho)
            agree.append(topk_agreement(imp, ref_imp, k))
        out.append({"progress": s["progress"],
                    "spearman": sum(rhos) / len(rhos) if rhos else float("nan"),
                    "topk_agreement": sum(agree) / len(agree) if agree else float("nan"),
                    "hard_over_target": s["hard_over_target"],
                    **{f"shift_{k}": v for k, v in structure_shift(s, ref).items()}})
    return out


class TracedPipeline(Pipeline):
    """A :class:`Pipeline` that records snapshots (see :func:`snapshot`) in ``self.trace``:
    ``during`` (at every 1/``SNAPSHOTS`` of the search), ``search_end``, ``after_finish``
    (before the budget solver) and ``final`` (what is exported). Recording reads the gates
    only; the run computes exactly what an untraced one does (no resume support needed)."""

    def __init__(self, *args: Any, search_overrides: dict[str, Any] | None = None, **kw: Any) -> None:
        self.trace: dict[str, Any] = {"during": [], "solver_ran": False, "finish_steps": 0}
        self._step0 = 0
        from dmscale.run.pipeline import SearchHooks

        hooks = SearchHooks(built=self._on_built, finish=self._on_finish, solver=self._on_solver,
                            finished=self._on_finished)
        super().__init__(*args, search_overrides=search_overrides, search_hooks=hooks, **kw)

    def _on_built(self, searcher: Any) -> None:
        """Snapshots during the search, taken in its resource loss (once per search step)."""
        loss_fn, trace = searcher.resource_loss, self.trace

        def resource_loss(progress: float = 1.0) -> torch.Tensor:
            # called once per search step with progress = step / total
            due = (len(trace["during"]) + 1) / SNAPSHOTS
            if progress >= due - 1e-9 and len(trace["during"]) < SNAPSHOTS - 1:
                trace["during"].append(snapshot(searcher, progress))
            return loss_fn(progress)

        searcher.resource_loss = resource_loss  # instance attribute: only this run's searcher

    def _on_finish(self, searcher: Any) -> None:
        self.trace["search_end"] = snapshot(searcher, 1.0)
        self._step0 = self.ctx.global_step

    def _on_solver(self, searcher: Any) -> None:
        self.trace["after_finish"] = snapshot(searcher, 1.0)
        self.trace["solver_ran"] = True

    def _on_finished(self, searcher: Any) -> None:
        self.trace["finish_steps"] = self.ctx.global_step - self._step0
        self.trace.setdefault("after_finish", snapshot(searcher, 1.0))
        self.trace["final"] = snapshot(searcher, 1.0)
