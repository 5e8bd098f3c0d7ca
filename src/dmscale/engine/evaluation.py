"""Evaluations during training (``--eval-every``) and the best weights (``best.safetensors``).

:class:`PhaseWatch` is what a :class:`~dmscale.engine.loop.StepLoop` evaluates after each
step of one phase:

* without ``--eval-every`` (the default) it does what the loop always did: pretrain and
  retrain evaluate once per epoch on at most 2000 test examples, a search not at all;
* with ``--eval-every N`` (steps) or ``Xe`` (epochs, ``max(1, round(X * steps_per_epoch))``
  steps) each of pretrain, search and retrain evaluates on the whole test (val) split after
  every N-th step of the phase (the step counted within the phase, so a resumed run evaluates
  at the same steps); the last step is evaluated by the phase itself, after the loop. The
  structure-only *finish* steps after a search are not evaluated.

A search's evaluation runs the supernet with hard masks (the function the export computes,
before its BatchNorm statistics are re-estimated) and its record in ``metrics.jsonl`` adds
the exact cost (``cost_hard``), the final target (``cost_final``), the scheduled target now
(``cost_target``) and ``within_budget``.

*Best* (:func:`offer_best`): the phase the host names in ``best_phase`` (the run's last
training phase of a fixed structure: the retraining, or the pretraining of ``dmscale
pretrain``) keeps the weights of its best evaluation by the task's metric (``Task.metric``:
accuracy and mAP higher, bits per character / byte lower, ``Task.higher_is_better``) in
``best.safetensors`` (the step, metric and value in its metadata, :func:`read_best`), with
the record in the run's state (``state["best"]``, so it is in every checkpoint and survives a
kill and ``--resume``) and an ``"event": "best"`` line in ``metrics.jsonl``. Later
evaluations must be strictly better to replace it.

Example:
    >>> eval_interval(None, 8), eval_interval(5, 8), eval_interval("0.5e", 8), eval_interval("0.01e", 8)
    (None, 5, 4, 1)
    >>> is_better(0.9, 0.8, higher_is_better=True), is_better(1.9, 1.8, higher_is_better=False)
    (True, False)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["BEST_FILE", "LEGACY_EVAL_LIMIT", "WATCHED_PHASES", "PhaseWatch", "eval_interval", "is_better",
           "offer_best", "read_best"]

BEST_FILE = "best.safetensors"
WATCHED_PHASES = ("pretrain", "search", "retrain")
LEGACY_EVAL_LIMIT = 2000  # test examples of the per-epoch evaluation without --eval-every


def eval_interval(every: int | str | None, steps_per_epoch: int) -> int | None:
    """Steps between evaluations for ``--eval-every`` (N steps, or ``'<X>e'``: X epochs);
    None when off."""
    if every is None:
        return None
    if isinstance(every, str) and every.endswith("e"):
        return max(1, int(round(float(every[:-1]) * steps_per_epoch)))
    return max(1, int(every))


def is_better(value: float, best: float | None, higher_is_better: bool, ties: bool = False) -> bool:
    """Whether ``value`` beats ``best`` (None: anything does); ``ties``: an equal value does too."""
    if best is None:
        return True
    if value == best:
        return ties
    return value > best if higher_is_better else value < best


def _save_best(model: nn.Module, path: Path, record: dict[str, Any]) -> None:
    """``model``'s weights with ``record``'s step and value as metadata, written atomically."""
    from safetensors.torch import save_model

    meta = {k: str(record[k]) for k in ("phase", "step", "global_step", "metric", "value")}
    tmp = path.with_name(path.name + ".tmp")
    save_model(model, str(tmp), metadata=meta, force_contiguous=True)
    os.replace(tmp, path)


def read_best(path: str | Path) -> dict[str, Any]:
    """The phase, step, global step, metric and value a ``best.safetensors`` was kept at.

    Raises:
        FileNotFoundError: no such file.
    """
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata() or {})
    out: dict[str, Any] = dict(meta)
    for key in ("step", "global_step"):
        if key in out:
            out[key] = int(out[key])
    if "value" in out:
        out["value"] = float(out["value"])
    return out


def offer_best(host: Any, phase: str, model: nn.Module, step: int, metrics: dict[str, Any],
               ties: bool = False) -> bool:
    """Keep ``model`` as the best of ``phase`` when ``metrics`` beat the kept record (see the
    module text); returns whether it did. ``ties``: an equal value replaces it too (the
    phase's last step, so that of equal weights the exported ones are the final ones)."""
    task = host.task
    value = metrics.get(task.metric)
    if value is None:
        return False
    best = host.state.get("best")
    kept = best["value"] if best is not None and best.get("phase") == phase else None
    if not is_better(float(value), kept, bool(getattr(task, "higher_is_better", True)), ties):
        return False
    record = {"phase": phase, "step": int(step), "global_step": int(host.global_step), "metric": task.metric,
              "value": float(value), "metrics": dict(metrics), "file": BEST_FILE}
    if host.rd.writes:
        _save_best(model, host.rd.path / BEST_FILE, record)
    host.state["best"] = record
    host.rd.append_metrics({"event": "best", **{k: v for k, v in record.items() if k != "metrics"}})
    logger = getattr(host, "logger", None)
    if logger is not None:
        logger.log_scalars(host.global_step, {"eval/best": float(value)})
    return True


class PhaseWatch:
    """The evaluations of one phase of a step loop (see the module text).

    Args:
        host: the run (:class:`~dmscale.engine.loop.LoopHost`; ``cfg.eval_every`` and
            ``best_phase`` are read when present).
        phase / model / searcher / total: those of the loop.
    """

    def __init__(self, host: Any, phase: str, model: nn.Module, searcher: Any, total: int) -> None:
        self.host, self.phase, self.model, self.searcher, self.total = host, phase, model, searcher, total
        self.steps_per_epoch = host.task.steps_per_epoch(host.cfg.batch_size)
        every = getattr(host.cfg, "eval_every", None)
        self.legacy = every is None
        self.interval = eval_interval(every, self.steps_per_epoch) if phase in WATCHED_PHASES else None
        self.keeps_best = getattr(host, "best_phase", None) == phase

    def after_step(self, done: int) -> None:
        """Evaluate after the loop's ``done``-th step of the phase when it is due."""
        if done >= self.total:
            return  # the phase evaluates its last step itself
        if self.legacy:
            if done % self.steps_per_epoch == 0 and self.searcher is None:
                self.host.evaluate(self.phase, self.model, None, done, limit=LEGACY_EVAL_LIMIT)
        elif self.interval is not None and done % self.interval == 0:
            self.evaluate(done)

    def evaluate(self, done: int) -> dict[str, Any]:
        """One evaluation on the whole test split, recorded (and kept when it is the best)."""
        extra: dict[str, Any] = {}
        if self.searcher is not None:
            res = self.searcher.resources()
            extra = {"cost_hard": res["hard"], "cost_final": res["target"],
                     "cost_target": self.searcher.budget.target_at((done - 1) / self.total),
                     "within_budget": self.searcher.budget.within()}
        with torch.no_grad():
            metrics = self.host.evaluate(self.phase, self.model, self.searcher, done, extra=extra)
        if self.keeps_best:
            offer_best(self.host, self.phase, self.model, done, metrics)
        return metrics
