"""Where the scalars of a run go besides ``metrics.jsonl`` (``--logger``).

``metrics.jsonl`` in the run directory gets every record whatever the logger; a logger is a
second destination for the same numbers, under stable tags:

====================  ===================================================================
``loss/total``        the loss of the step (task + resource + distillation)
``loss/task``         the task loss; ``loss/resource`` the resource loss of a search,
                      ``loss/<name>`` each distillation term
``train/batch_metric`` the task's metric on the training batch; ``train/lr`` the weights' lr
``eval/<metric>``     each evaluation (``eval/acc``, ``eval/loss``, ``eval/bpc``, ...);
                      ``eval/best`` the best value kept so far
``cost/exact``        the exact (hard-mask) cost of the current structure; ``cost/soft``,
                      ``cost/target`` (the final target), ``cost/target_now`` (r_t now),
                      ``cost/exact_over_target``
``structure/...``     ``width_kept`` and ``depth_kept`` (fractions of the supernet's widths
                      and removable blocks kept), ``width/<dim>`` and ``depth/<stage>``
                      per dimension
====================  ===================================================================

The x axis is the run's global step (continuous over the phases).

* :class:`RunLogger`: the interface, ``log_scalars(step, scalars)`` and ``close()``;
* :class:`JsonlLogger`: the default, ``--logger none``: ``metrics.jsonl`` only, so its
  methods do nothing (and the loop computes no extra scalars for it);
* :class:`TensorBoardLogger`: ``torch.utils.tensorboard.SummaryWriter`` into
  ``<run>/tensorboard/``, imported only when chosen;
* :func:`make_logger`: the logger of a ``--logger`` value (rank 0 only under torchrun).

Another backend (wandb, ...) is a subclass with these two methods and a name in
:data:`LOGGERS`.

Example:
    >>> step_scalars({"loss": 1.5, "task_loss": 1.2, "resource_loss": 0.3, "cost_hard": 40.0,
    ...               "cost_final": 50.0, "phase": "search", "step": 3})
    {'loss/total': 1.5, 'loss/task': 1.2, 'loss/resource': 0.3, 'cost/exact': 40.0, 'cost/target': 50.0, 'cost/exact_over_target': 0.8}
    >>> structure_scalars({"width": [{"name": "conv1", "size": 8, "kept": 6}],
    ...                    "depth": [{"name": "layer1", "blocks": [0, 1], "kept": [0]}]})
    {'structure/width_kept': 0.75, 'width/conv1': 0.75, 'structure/depth_kept': 0.5, 'depth/layer1': 0.5}
    >>> logger = make_logger("none", "unused")
    >>> logger.enabled, logger.log_scalars(1, {"loss/total": 1.0}), logger.close()
    (False, None, None)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from dmscale.core.errors import ConfigError, MissingDependencyError

__all__ = [
    "LOGGERS",
    "JsonlLogger",
    "RunLogger",
    "TensorBoardLogger",
    "eval_scalars",
    "log_step",
    "make_logger",
    "require_logger",
    "step_scalars",
    "structure_scalars",
]

LOGGERS = ("none", "tensorboard")
TENSORBOARD_DIR = "tensorboard"

# metrics.jsonl keys of a step record -> tags
_STEP_TAGS = {
    "loss": "loss/total", "task_loss": "loss/task", "resource_loss": "loss/resource",
    "train_acc": "train/batch_metric", "lr": "train/lr", "cost_hard": "cost/exact",
    "cost_soft": "cost/soft", "cost_target": "cost/target_now", "cost_final": "cost/target",
}
# numeric keys of a record that are bookkeeping, not measurements
_NOT_SCALARS = {"step", "global_step", "time", "examples", "cost_supernet"}


class RunLogger:
    """A destination for scalars; subclasses implement :meth:`log_scalars` and :meth:`close`.

    ``enabled`` False tells the loop not to compute scalars only a logger would see.
    """

    enabled: bool = True

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        """Record ``scalars`` (tag -> value) at global ``step``."""
        raise NotImplementedError

    def close(self) -> None:
        """Flush and release what the logger holds; it logs nothing afterwards."""
        raise NotImplementedError


class JsonlLogger(RunLogger):
    """The default: ``metrics.jsonl`` only (the run directory writes it for every logger)."""

    enabled = False

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        return None

    def close(self) -> None:
        return None


class TensorBoardLogger(RunLogger):
    """``torch.utils.tensorboard.SummaryWriter`` writing event files into ``log_dir``.

    Args:
        log_dir: ``<run>/tensorboard``.
        purge_step: a resumed run's first global step: events a killed run wrote from there
            on are hidden (the resumed run writes them again).
    """

    def __init__(self, log_dir: str | Path, purge_step: int | None = None) -> None:
        writer_class = _summary_writer()
        self.log_dir = Path(log_dir)
        self._writer: Any = writer_class(log_dir=str(self.log_dir), purge_step=purge_step, flush_secs=10)

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        if self._writer is None:
            return
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, float(value), global_step=int(step))

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _summary_writer() -> Any:
    """``SummaryWriter``, or :class:`MissingDependencyError` naming the extra to install."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise MissingDependencyError(
            "--logger tensorboard needs the tensorboard package, which is not installed: "
            "pip install dmscale[tensorboard] (or run with --logger none; metrics.jsonl has "
            "the same numbers)") from None
    return SummaryWriter


def require_logger(kind: str) -> None:
    """Fail early (before a run directory exists) when ``kind`` needs a missing package.

    Raises:
        MissingDependencyError: ``tensorboard`` without the tensorboard package.
        ValueError: an unknown ``kind``.
    """
    if kind not in LOGGERS:
        raise ConfigError(f"unknown logger {kind!r}: expected one of {', '.join(LOGGERS)}")
    if kind == "tensorboard":
        _summary_writer()


def make_logger(kind: str, run_dir: str | Path, writes: bool = True,
                purge_step: int | None = None) -> RunLogger:
    """The logger of ``--logger kind`` for ``run_dir``; :class:`JsonlLogger` where this
    process writes no files (every rank but 0 under torchrun)."""
    require_logger(kind)
    if kind == "none" or not writes:
        return JsonlLogger()
    return TensorBoardLogger(Path(run_dir) / TENSORBOARD_DIR, purge_step=purge_step)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def step_scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The tags of one step record of ``metrics.jsonl`` (see the module text)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        number = _number(value)
        if number is None or key in _NOT_SCALARS:
            continue
        if key in _STEP_TAGS:
            out[_STEP_TAGS[key]] = number
        else:  # distillation terms and other losses of the step
            out["loss/" + key.removesuffix("_loss")] = number
    hard, target = out.get("cost/exact"), out.get("cost/target")
    if hard is not None and target:
        out["cost/exact_over_target"] = hard / target
    return out


def eval_scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """``eval/<name>`` for each number of an evaluation (the count of examples left out).

    Example:
        >>> eval_scalars({"acc": 0.9, "loss": 0.3, "examples": 64})
        {'eval/acc': 0.9, 'eval/loss': 0.3}
    """
    return {f"eval/{k}": float(v) for k, v in metrics.items()
            if k not in _NOT_SCALARS and _number(v) is not None}


def structure_scalars(structure: Mapping[str, Any]) -> dict[str, float]:
    """Kept fractions of a structure (``Searcher.structure()`` / ``structure.json``): overall
    width and depth, and per dimension."""
    out: dict[str, float] = {}
    width = list(structure.get("width") or [])
    if width:
        out["structure/width_kept"] = sum(w["kept"] for w in width) / max(1, sum(w["size"] for w in width))
        out.update({f"width/{w['name']}": w["kept"] / max(1, w["size"]) for w in width})
    depth = list(structure.get("depth") or [])
    if depth:
        out["structure/depth_kept"] = (sum(len(d["kept"]) for d in depth)
                                       / max(1, sum(len(d["blocks"]) for d in depth)))
        out.update({f"depth/{d['name']}": len(d["kept"]) / max(1, len(d["blocks"])) for d in depth})
    return out


def log_step(logger: RunLogger | None, step: int, record: Mapping[str, Any], searcher: Any = None) -> None:
    """One step record of ``metrics.jsonl`` to ``logger`` (nothing for a disabled one), and
    during a search the kept widths and depths of ``searcher.structure()``."""
    if logger is None or not logger.enabled:
        return
    scalars = step_scalars(record)
    if searcher is not None and searcher.has_importance():
        scalars.update(structure_scalars(searcher.structure()))
    logger.log_scalars(step, scalars)
