"""The context of a run: what every phase reads and writes, built once by the pipeline.

A :class:`RunContext` holds the resolved configuration, the task, the device and precision,
the run directory, the phases of the run, the example input, the run's state (``state.json``:
phases done, counts, evaluations, warnings), the global step, the checkpoint a resumed run
continues and the :class:`~dmscale.run.watching.Watch` (logger, best weights). A phase is an
object whose ``run(ctx)`` reads and writes only this context and returns a
:class:`PhaseResult`; the step loop (:class:`dmscale.engine.loop.StepLoop`) takes the
context as its host.

:meth:`RunContext.build` resolves the configuration (on ``--resume`` the saved run's, an
option given differently refused) and builds the rest, in the order a failing option is
reported: the configuration, ``--lm-eval``, the device, the logger, the phases, the task.

Example:
    >>> import tempfile
    >>> from dmscale.config.run_config import RunConfig
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     ctx = RunContext.build(RunConfig(
    ...         command="pretrain", task="digits", model="smallcnn", model_args={"width": 4, "blocks": 1},
    ...         train_limit=64, test_limit=32, batch_size=32, epochs=1, quiet=True, out=tmp + "/run"))
    ...     ctx.phases, ctx.global_step, ctx.steps(1.0), ctx.checkpoint_for("pretrain")
    (['pretrain'], 0, 2, None)
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
from torch import nn

from dmscale.config.defaults import AUTO_OPTIONS, resolve_structure_lr
from dmscale.config.run_config import OPTIONS_BY_NAME, RESUME_MUTABLE, ConfigError, RunConfig, load_run_config
from dmscale.core.distributed import is_main_process
from dmscale.engine.ddp import check_task_for_ranks
from dmscale.engine.device import Precision, resolve_device, set_threads
from dmscale.engine.loggers import RunLogger, eval_scalars
from dmscale.engine.rundir import RunDir
from dmscale.export.files import save_weights
from dmscale.run.lm_evaluation import check_lm_eval_run
from dmscale.run.phase_list import phases_of
from dmscale.run.watching import Watch
from dmscale.search.config import resolve_align
from dmscale.tasks.registry import Task, build_task

__all__ = ["Phase", "PhaseResult", "RunContext", "prepare_config"]


@dataclass
class PhaseResult:
    """What one phase did: the files it wrote in the run directory and its final metrics
    (None: the phase evaluated nothing, e.g. a search on a rank that does not export)."""

    wrote: list[str] = field(default_factory=list)
    metrics: dict[str, Any] | None = None


class Phase(Protocol):
    """One phase of a run (:mod:`dmscale.run.phases`): ``name`` as in ``state["phases"]``."""

    name: str

    def run(self, ctx: RunContext) -> PhaseResult: ...


@dataclass
class RunContext:
    """The state of one run that its phases share (see the module text).

    The step loop reads ``cfg``, ``task``, ``device``, ``precision``, ``rd``, ``state``,
    ``global_step``, ``logger`` and ``best_phase`` and calls :meth:`elapsed`,
    :meth:`save_state`, :meth:`checkpoint_for` and :meth:`evaluate`
    (:class:`dmscale.engine.loop.LoopHost`).
    """

    cfg: RunConfig
    task: Task
    device: torch.device
    precision: Precision
    rd: RunDir
    phases: list[str]
    example: torch.Tensor
    watch: Watch
    state: dict[str, Any]
    resume: bool = False
    threads: int = 1
    created: bool = False  # a new run that made its directory (removed again on a bad option)
    global_step: int = 0
    checkpoint: dict[str, Any] | None = None  # the checkpoint a resumed run continues
    teacher: nn.Module | None = None  # the search's frozen teacher, kept for the same run's retrain
    elapsed0: float = 0.0  # seconds the run had taken before this process
    t0: float = field(default_factory=time.time)

    @classmethod
    def build(cls, given: RunConfig, resume: bool = False, explicit: set[str] | None = None) -> RunContext:
        """The context of a run of ``given`` in ``given.out`` (see the module text)."""
        if given.out is None:
            raise ConfigError("the run needs a directory (--out)")
        rd = RunDir(given.out, writes=is_main_process())  # under torchrun: rank 0 writes
        cfg, created = prepare_config(given, rd, resume, explicit)
        check_lm_eval_run(cfg)  # --lm-eval / --ppl: refused before any model is loaded
        device = resolve_device(cfg.device)
        if cfg.command == "search" and cfg.align is None:  # auto: the device's multiple,
            cfg.align = resolve_align(None, device)  # saved so a resume searches the same
        precision = Precision(cfg.precision, device)
        threads = set_threads(cfg.threads)
        watch = Watch(cfg)  # --logger: a missing package fails here, before any file
        phases = phases_of(cfg)
        task = build_task(cfg)
        check_task_for_ranks(task)
        if not cfg.task_info:
            cfg.task_info = dict(task.info)
        if cfg.command == "search" and cfg.structure_lr is None:  # auto: by the search's length
            resolve_structure_lr(cfg, _steps(task, cfg, cfg.epochs))
        example = task.example_inputs().to(device)
        state = rd.read_json("state.json") if resume else None
        if state is None:
            state = {"phases": phases, "done": [], "global_step": 0, "status": "running",
                     "elapsed": 0.0, "counts": {}, "evals": {}, "warnings": []}
        return cls(cfg=cfg, task=task, device=device, precision=precision, rd=rd, phases=phases,
                   example=example, watch=watch, state=state, resume=resume, threads=threads,
                   created=created, global_step=int(state["global_step"]),
                   elapsed0=float(state.get("elapsed", 0.0)))

    # ------------------------------------------------------------------ the step loop's host
    @property
    def logger(self) -> RunLogger:
        """The run's logger (``--logger``)."""
        return self.watch.logger

    @property
    def best_phase(self) -> str | None:
        """The phase that keeps its best weights (``--eval-every``), or None."""
        return self.watch.best_phase(self.phases)

    def elapsed(self) -> float:
        """Seconds the run has taken, over every process that ran it."""
        return self.elapsed0 + time.time() - self.t0

    def save_state(self, **updates: Any) -> None:
        """``state.json`` with ``updates``, the global step and the elapsed time."""
        self.state.update(updates)
        self.state["global_step"] = self.global_step
        self.state["elapsed"] = self.elapsed()
        self.rd.write_json("state.json", self.state)

    def checkpoint_for(self, phase: str) -> dict[str, Any] | None:
        """The checkpoint a resumed run continues when it is one of ``phase``, else None."""
        ck = self.checkpoint
        return ck if ck is not None and ck["phase"] == phase else None

    def evaluate(self, phase: str, model: nn.Module, searcher: Any, step: int,
                 limit: int | None = None, extra: dict[str, Any] | None = None) -> dict[str, float]:
        """Metrics of ``model`` (hard masks during a search) on the test split, under the
        run's autocast; recorded in ``metrics.jsonl`` (with ``extra``) and the logger."""
        with self.precision.autocast():
            if searcher is not None:
                with searcher.hardened():
                    metrics = self.task.evaluate(model, device=self.device, limit=limit)
            else:
                metrics = self.task.evaluate(model, device=self.device, limit=limit)
        self.rd.append_metrics({"phase": phase, "event": "eval", "step": step,
                                "global_step": self.global_step, **metrics, **(extra or {})})
        self.logger.log_scalars(self.global_step, eval_scalars(metrics))
        return metrics

    # ------------------------------------------------------------------ what phases share
    def log(self, message: str) -> None:
        """One line on stderr (not with ``--quiet``; under torchrun rank 0 only)."""
        if not self.cfg.quiet and self.rd.writes:
            print(message, file=sys.stderr, flush=True)

    def steps(self, epochs: float) -> int:
        """The steps of ``epochs`` epochs of the task's training split (at least 1)."""
        return _steps(self.task, self.cfg, epochs)

    def save_weights(self, model: nn.Module | None, name: str) -> None:
        """``model``'s weights as ``RUN/name`` (on the rank that writes)."""
        if self.rd.writes:
            save_weights(model, self.rd / name)


def _steps(task: Task, cfg: RunConfig, epochs: float) -> int:
    return max(1, int(math.ceil(epochs * task.steps_per_epoch(cfg.batch_size))))


def prepare_config(given: RunConfig, rd: RunDir, resume: bool,
                   explicit: set[str] | None = None) -> tuple[RunConfig, bool]:
    """``given`` resolved, or on resume the saved run's configuration (an option given
    differently refused; one left at auto means the run's value; with ``explicit``, only the
    options it names count as given); and whether a new run's directory is new or empty."""
    path = rd.path
    cfg = given.resolved()
    if not resume:
        if (path / "config.yaml").exists():
            raise ConfigError(f"{path} already holds a run: continue it with --resume, or "
                              "choose another --out")
        return cfg, not path.exists() or not any(path.iterdir())
    saved = load_run_config(path)
    if saved.command != cfg.command:
        raise ConfigError(f"{path} is a `dmscale {saved.command}` run, not `{cfg.command}`")
    changed = _changed_options(given, cfg, saved, explicit)
    if changed:
        items = ", ".join(f"{OPTIONS_BY_NAME[k].flag} (run: {a!r}, now: {b!r})" for k, (a, b) in changed.items())
        raise ConfigError(f"cannot change options when resuming {path}: {items}")
    keep = {k: getattr(cfg, k) for k in RESUME_MUTABLE if k != "out"}
    cfg = replace(saved, **keep, out=str(path))
    if not rd.checkpoint.exists() and not (path / "state.json").exists():
        raise ConfigError(f"{path} has no checkpoint to resume from")
    return cfg, False


def _changed_options(given: RunConfig, cfg: RunConfig, saved: RunConfig,
                     explicit: set[str] | None) -> dict[str, tuple[Any, Any]]:
    """``{option: (run's value, given value)}`` of the options a resume would change."""
    changed = {}
    for opt in OPTIONS_BY_NAME.values():
        new = getattr(cfg, opt.name)
        if opt.name in RESUME_MUTABLE or new == getattr(saved, opt.name):
            continue
        if getattr(given, opt.name) is None and opt.name in (*AUTO_OPTIONS, "align"):
            continue  # auto: the run's resolved value
        if explicit is not None and opt.name not in explicit:
            continue
        changed[opt.name] = (getattr(saved, opt.name), new)
    return changed

