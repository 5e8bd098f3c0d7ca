"""Watching a run: its logger (``--logger``), which weights it exports (``--eval-every``,
``--export-best``) and how the summary says so.

:class:`Watch` is one object per run, held by the run's
:class:`~dmscale.run.context.RunContext` and given to its phases. The evaluations themselves
and the best weights are :mod:`dmscale.engine.evaluation`; the loggers
:mod:`dmscale.engine.loggers`.

What "best" means: only the run's last training phase of a *fixed* structure keeps a best,
the retraining (of ``dmscale search`` pipelines np / p, or ``dmscale retrain``) or the
pretraining of ``dmscale pretrain``. Its periodic evaluations and its final one compete; the
winner's weights are ``best.safetensors``. A search keeps none: its structure changes every
step, the hard-masked supernet it evaluates is not yet the export (no finish phase, budget
solver or re-estimated BatchNorm statistics), and it would have to be under the budget to
count; the pretraining inside a search pipeline keeps none either, since the search continues
from its last weights, not its best. Their evaluations are recorded all the same.

``model.safetensors`` holds the last step's weights (as without ``--eval-every``), or with
``--export-best`` the best ones; ``state["exported"]`` and the summary name which.

Example:
    >>> metric_text("acc", 0.9375), metric_text("bpc", 2.1234), metric_text("map50_95", 0.5)
    ('accuracy 93.75%', '2.123 bits/char', 'box mAP50-95 50.00')
    >>> summary = {"exported": {"checkpoint": "best", "phase": "retrain", "step": 4, "global_step": 10,
    ...                         "metric": "acc", "value": 0.5, "file": "model.safetensors"},
    ...            "best": {"phase": "retrain", "step": 4, "global_step": 10, "metric": "acc",
    ...                     "value": 0.5, "file": "best.safetensors"}}
    >>> print("\\n".join(watch_lines(summary)))
      exported      the best weights of retrain (step 4, global step 10): accuracy 50.00%
      best          retrain step 4 (global step 10): accuracy 50.00%, kept in best.safetensors
"""

from __future__ import annotations

from typing import Any

from torch import nn

from dmscale.engine.evaluation import BEST_FILE, offer_best
from dmscale.engine.loggers import JsonlLogger, RunLogger, make_logger, require_logger
from dmscale.run.saved_runs import load_weights

__all__ = ["Watch", "metric_text", "watch_lines", "watch_report_lines"]


class Watch:
    """The logger and the exported weights of a run (see the module text): one object, built
    once per run (:class:`~dmscale.run.context.RunContext` holds it) and given to the phases.

    Args:
        cfg: the run's configuration (``logger``, ``eval_every``, ``export_best``, ``command``);
            a ``--logger`` whose package is missing fails here, before the run directory exists.
    """

    def __init__(self, cfg: Any) -> None:
        require_logger(cfg.logger)
        self.cfg = cfg
        self.logger: RunLogger = JsonlLogger()

    def open(self, rd: Any, resume: bool, global_step: int) -> None:
        """The run's logger in ``rd``; a resumed run hides what a killed one logged after its
        checkpoint."""
        purge = global_step + 1 if resume else None
        self.logger = make_logger(self.cfg.logger, rd.path, writes=rd.writes, purge_step=purge)

    def close(self) -> None:
        """Close the logger (a new run of the same object logs to nothing until :meth:`open`)."""
        self.logger.close()
        self.logger = JsonlLogger()

    def best_phase(self, phases: list[str]) -> str | None:
        """The phase of ``phases`` that keeps its best weights (``--eval-every``), or None."""
        if self.cfg.eval_every is None:
            return None
        if self.cfg.command == "pretrain":
            return "pretrain"
        return "retrain" if "retrain" in phases else None

    def phase_result(self, ctx: Any, phase: str, model: nn.Module, step: int,
                     metrics: dict[str, Any]) -> dict[str, Any]:
        """The end of ``phase`` of the run ``ctx`` (a :class:`~dmscale.run.context.RunContext`):
        its last evaluation (``metrics`` of ``model`` after ``step`` steps) competes for the
        best; with ``--export-best`` the best weights are loaded into ``model`` (they become
        ``model.safetensors``). Records ``state["exported"]`` and returns the metrics of the
        weights ``model`` now holds."""
        cfg, state = self.cfg, ctx.state
        if cfg.eval_every is None:
            return metrics
        kept = self.best_phase(ctx.phases) == phase
        if kept:
            offer_best(ctx, phase, model, step, metrics, ties=True)
        best = state.get("best") if kept else None
        chosen = {"checkpoint": "final", "step": step, "global_step": ctx.global_step, "metrics": metrics}
        if best is not None and cfg.export_best and best["step"] != step:
            if ctx.rd.writes:  # the file is rank 0's; the other ranks save nothing
                load_weights(model, ctx.rd / BEST_FILE)
            chosen = {"checkpoint": "best", "step": best["step"], "global_step": best["global_step"],
                      "metrics": best["metrics"]}
        state["exported"] = {
            "checkpoint": chosen["checkpoint"], "phase": phase, "step": chosen["step"],
            "global_step": chosen["global_step"], "metric": ctx.task.metric,
            "value": chosen["metrics"].get(ctx.task.metric), "file": "model.safetensors",
            "best_kept": kept,
        }
        return chosen["metrics"]

    def summary(self, state: dict[str, Any]) -> dict[str, Any]:
        """``eval_every``, ``best`` and ``exported`` of the summary (nothing without --eval-every)."""
        if self.cfg.eval_every is None:
            return {}
        best = state.get("best")
        return {"eval_every": self.cfg.eval_every, "export_best": self.cfg.export_best,
                "best": {k: v for k, v in best.items() if k != "metrics"} if best else None,
                "exported": state.get("exported")}


def metric_text(metric: str, value: float | None) -> str:
    """A task metric's value in words (``Task.metric``: acc, map50_95, bpc, bpb)."""
    if value is None:
        return f"{metric} -"
    if metric == "acc":
        return f"accuracy {100 * value:.2f}%"
    if metric == "map50_95":
        return f"box mAP50-95 {100 * value:.2f}"
    if metric in ("bpc", "bpb"):
        return f"{value:.3f} bits/{'char' if metric == 'bpc' else 'byte'}"
    return f"{metric} {value:.4g}"


def _exported_text(ex: dict[str, Any]) -> str:
    where = f"step {ex['step']}, global step {ex['global_step']}"
    what = (f"the best weights of {ex['phase']} ({where})" if ex["checkpoint"] == "best"
            else f"the final weights of {ex['phase']} ({where})")
    if ex["phase"] == "search":
        what = f"the search's export ({where})"
    return f"{what}: {metric_text(ex['metric'], ex.get('value'))}"


def _best_text(best: dict[str, Any] | None, exported: dict[str, Any] | None) -> str | None:
    if best:
        return (f"{best['phase']} step {best['step']} (global step {best['global_step']}): "
                f"{metric_text(best['metric'], best['value'])}, kept in {best['file']}")
    if exported and not exported.get("best_kept"):
        return ("none kept: only the retraining (or `dmscale pretrain`) keeps a best; a search's "
                "structure changes until its end")
    return None


def _watched(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """(what, text) of the exported and the best weights; none without ``--eval-every``."""
    ex = summary.get("exported")
    if not ex:
        return []
    best = _best_text(summary.get("best"), ex)
    return [("exported", _exported_text(ex))] + ([("best", best)] if best else [])


def watch_lines(summary: dict[str, Any]) -> list[str]:
    """The printed summary's lines on the exported and the best weights (none without
    ``--eval-every``)."""
    return [f"  {what:14}{text}" for what, text in _watched(summary)]


def watch_report_lines(summary: dict[str, Any]) -> list[str]:
    """``report.md``'s lines on the exported and the best weights (none without ``--eval-every``)."""
    names = {"exported": "exported (model.safetensors)"}
    lines = [f"- {names.get(what, what)}: {text}" for what, text in _watched(summary)]
    return lines + [""] if lines else []
