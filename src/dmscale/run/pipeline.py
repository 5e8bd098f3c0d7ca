"""The pipelines of the ``dmscale`` command: phases and the orchestration of a run, resume.

A run is a sequence of *phases* (paper Table 1):

============  ==========================================================
``np``        search (randomly initialised supernet) -> retrain
``p``         pretrain (or ``--init``) -> search -> retrain
``p-``        pretrain (or ``--init``) -> search of the structure only
``pretrain``  pretrain (the ``dmscale pretrain`` command)
``retrain``   retrain a found structure (the ``dmscale retrain`` command)
============  ==========================================================

Search loss: ``task + searcher.resource_loss(progress=step / total)`` (+ distillation);
weights use SGD or AdamW with warm-up + cosine decay, the structural parameters Adam with
no weight decay. In ``p-`` the weights are frozen (``requires_grad=False``) and only the
structural parameters are optimised.

The run directory holds ``config.yaml`` (resolved), ``state.json`` (phases done, steps),
``metrics.jsonl``, ``search_trace.jsonl`` (:mod:`dmscale.search.search_trace`), ``checkpoint.pt``
(written atomically every ``--checkpoint-every`` steps: model, optimisers, schedulers, the fp16
GradScaler, ``searcher.state_dict()``, RNG states, step), and the outputs: ``supernet.safetensors``,
``structure.json`` and ``model.safetensors`` (the found model), ``summary.json``, ``report.md``.
Batches are a pure function of ``(seed, phase, step)``, so a resumed run computes exactly
what an uninterrupted one does.

Every phase trains with one step loop, :class:`dmscale.engine.loop.StepLoop`; the run
directory's files live in :mod:`dmscale.engine.rundir`, reading run directories in
:mod:`dmscale.run.saved_runs`, each phase in :mod:`dmscale.run.phases`, the LLM evaluation at
the end (``--lm-eval``) in :mod:`dmscale.run.lm_evaluation`; this module runs them in order.

Example:
    >>> import tempfile
    >>> from dmscale.config.run_config import RunConfig
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     cfg = RunConfig(command="pretrain", task="digits", train_limit=64, test_limit=32,
    ...                     model="smallcnn", model_args={"width": 4, "blocks": 1},
    ...                     batch_size=32, epochs=1, quiet=True, out=tmp + "/run")
    ...     summary = Pipeline(cfg).run()
    ...     model, _ = load_run_model(tmp + "/run")
    >>> summary["steps"], type(model).__name__
    (2, 'SmallCNN')
"""

from __future__ import annotations
import math
import shutil
import sys
import time
from dataclasses import replace
from typing import Any

import torch
from torch import nn

import dmscale as dms

from dmscale.config.run_config import (OPTIONS_BY_NAME, RESUME_MUTABLE, ConfigError, RunConfig, load_run_config,
                                       save_config)
from dmscale.core.distributed import is_main_process, world_size
from dmscale.core.fused_norms import fusion_state, reset_fusion
from dmscale.engine.ddp import barrier, check_task_for_ranks
from dmscale.engine.device import Precision, resolve_device, set_threads
from dmscale.engine.loop import MAX_NON_FINITE_STEPS, StepLoop
from dmscale.search.search_trace import SearchTrace
from dmscale.engine.rundir import (
    CHECKPOINT_VERSION,
    Progress,
    RunDir,
    StopOnSignals,
    Stopped,
    fmt_count,
    read_checkpoint,
)
from dmscale.export.files import save_weights
from dmscale.engine.loggers import eval_scalars
from dmscale.run.lm_evaluation import check_lm_eval_run, run_lm_eval
from dmscale.run.phases import Phases, calibrate_on_task
from dmscale.run.saved_runs import (
    check_inputs_from_info,
    evaluate_run,
    example_from_info,
    export_run,
    load_run_model,
    load_teacher,
    load_weights,
    searcher_from_checkpoint,
)
from dmscale.run.watching import Watching
from dmscale.config.defaults import AUTO_OPTIONS, auto_brief, resolve_structure_lr
from dmscale.search.config import resolve_align
from dmscale.tasks.hf_model import is_hf_model
from dmscale.tasks.registry import Distillation, Task, build_task
from dmscale.tasks.start_weights import starts_from_weights

__all__ = [
    "Pipeline",
    "Stopped",
    "RunDir",
    "load_run_model",
    "load_teacher",
    "phases_of",
    "save_weights",
    "load_weights",
    "resolve_device",
    "calibrate_on_task",
    "export_run",
    "evaluate_run",
    # re-exported from dmscale.engine / dmscale.run.saved_runs (their home since the step loop moved)
    "CHECKPOINT_VERSION",
    "MAX_NON_FINITE_STEPS",
    "Progress",
    "StopOnSignals",
    "check_inputs_from_info",
    "example_from_info",
    "fmt_count",
    "read_checkpoint",
    "searcher_from_checkpoint",
    "set_threads",
]

PHASE_SEED = {"pretrain": 1, "search": 2, "finish": 3, "retrain": 4}


def phases_of(cfg: RunConfig) -> list[str]:
    """The phases a run of ``cfg`` goes through."""
    if cfg.command == "pretrain":
        return ["pretrain"]
    if cfg.command == "retrain":
        return ["retrain"]
    phases: list[str] = []
    pretrained = is_hf_model(cfg.model) or starts_from_weights(cfg)  # hf:, --weights, --pretrained
    if cfg.pipeline in ("p", "p-") and cfg.init is None and not (pretrained and not cfg.pretrain_epochs):
        if not cfg.pretrain_epochs:
            raise ConfigError(f"pipeline {cfg.pipeline} needs a pretrained supernet: "
                              "--pretrain-epochs > 0, --init RUN, or --weights PATH / --pretrained "
                              "with --pretrain-epochs 0")
        phases.append("pretrain")
    phases.append("search")
    if cfg.pipeline in ("np", "p") and cfg.retrain_epochs:
        phases.append("retrain")
    return phases


class Pipeline(Phases, Watching):
    """Run (or resume) the phases of ``cfg`` in its run directory.

    Args:
        cfg: the run configuration (``out`` must be set: the run directory).
        resume: continue the run found in ``cfg.out``.
    """

    def __init__(self, cfg: RunConfig, resume: bool = False, explicit: set[str] | None = None) -> None:
        if cfg.out is None:
            raise ConfigError("the run needs a directory (--out)")
        self.rd = RunDir(cfg.out, writes=is_main_process())  # under torchrun: rank 0 writes
        self.resume = resume
        self._explicit = explicit
        self.cfg = self._prepare_config(cfg)
        check_lm_eval_run(self.cfg)  # --lm-eval / --ppl: refused before any model is loaded
        self.device = resolve_device(self.cfg.device)
        if self.cfg.command == "search" and self.cfg.align is None:  # auto: the device's multiple,
            self.cfg.align = resolve_align(None, self.device)  # saved so a resume searches the same
        self.precision = Precision(self.cfg.precision, self.device)
        self.threads = set_threads(self.cfg.threads)
        self._init_watch()  # --logger: a missing package fails here, before any file
        self.phases = phases_of(self.cfg)
        self.task: Task = build_task(self.cfg)
        check_task_for_ranks(self.task)
        if not self.cfg.task_info:
            self.cfg.task_info = dict(self.task.info)
        if self.cfg.command == "search" and self.cfg.structure_lr is None:  # auto: by the search's length
            resolve_structure_lr(self.cfg, self._steps(self.cfg.epochs))
        self.example = self.task.example_inputs().to(self.device)
        self.state = self.rd.read_json("state.json") if resume else None
        if self.state is None:
            self.state = {"phases": self.phases, "done": [], "global_step": 0, "status": "running",
                          "elapsed": 0.0, "counts": {}, "evals": {}, "warnings": []}
        self.global_step = int(self.state["global_step"])
        self.rd_checkpoint: dict[str, Any] | None = None  # the checkpoint a resumed run continues
        self._t0 = time.time()
        self._elapsed0 = float(self.state.get("elapsed", 0.0))

    # ------------------------------------------------------------------ setup
    def _prepare_config(self, given: RunConfig) -> RunConfig:
        """``given`` resolved, or on resume the saved run's configuration (an option given
        differently refused; one left at auto means the run's value)."""
        path = self.rd.path
        cfg = given.resolved()
        if self.resume:
            saved = load_run_config(path)
            if saved.command != cfg.command:
                raise ConfigError(f"{path} is a `dmscale {saved.command}` run, not `{cfg.command}`")
            changed = {}
            for opt in OPTIONS_BY_NAME.values():
                new = getattr(cfg, opt.name)
                if opt.name in RESUME_MUTABLE or new == getattr(saved, opt.name):
                    continue
                if getattr(given, opt.name) is None and opt.name in (*AUTO_OPTIONS, "align"):
                    continue  # auto: the run's resolved value
                if self._explicit is not None and opt.name not in self._explicit:
                    continue
                changed[opt.name] = (getattr(saved, opt.name), new)
            if changed:
                items = ", ".join(f"{OPTIONS_BY_NAME[k].flag} (run: {a!r}, now: {b!r})"
                                  for k, (a, b) in changed.items())
                raise ConfigError(f"cannot change options when resuming {path}: {items}")
            keep = {k: getattr(cfg, k) for k in RESUME_MUTABLE if k != "out"}
            cfg = replace(saved, **keep, out=str(path))
            if not self.rd.checkpoint.exists() and not (path / "state.json").exists():
                raise ConfigError(f"{path} has no checkpoint to resume from")
            return cfg
        if (path / "config.yaml").exists():
            raise ConfigError(f"{path} already holds a run: continue it with --resume, or "
                              "choose another --out")
        self._created = not path.exists() or not any(path.iterdir())
        return cfg

    def elapsed(self) -> float:
        return self._elapsed0 + time.time() - self._t0

    def save_state(self, **updates: Any) -> None:
        self.state.update(updates)
        self.state["global_step"] = self.global_step
        self.state["elapsed"] = self.elapsed()
        self.rd.write_json("state.json", self.state)

    def _log(self, message: str) -> None:
        if not self.cfg.quiet and self.rd.writes:
            print(message, file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ main
    def run(self) -> dict[str, Any]:
        """Run the remaining phases; returns the summary (also in ``summary.json``).

        A new run that fails on a bad option before its first step leaves no directory.
        """
        reset_fusion()  # the summary says how this run's masked norms ran
        try:
            return self._run()
        except ConfigError:
            if not self.resume and getattr(self, "_created", False) and self.global_step == 0 \
                    and self.rd.writes:
                shutil.rmtree(self.rd.path, ignore_errors=True)
            raise
        finally:
            self._close_logger()
            close = getattr(self.task, "close", None)
            if close is not None:
                close()  # loader workers end with the run

    def _save_weights(self, model: nn.Module | None, name: str) -> None:
        if self.rd.writes:
            save_weights(model, self.rd / name)

    def _run(self) -> dict[str, Any]:
        barrier()  # every rank has checked the run directory before rank 0 writes to it
        if self.rd.writes:
            self.rd.path.mkdir(parents=True, exist_ok=True)
            save_config(self.cfg, self.rd.config)
        if self.resume:
            self.rd_checkpoint = self._load_checkpoint()
        else:
            self.rd_checkpoint = None
            self.rd.truncate_metrics(0)
            self.save_state()
        self._open_logger()
        self._log(f"dmscale {self.cfg.command}: {self.task.describe()}")
        self._log(f"run directory: {self.rd.path} ({self.device}"
                  + (f", {self.threads} CPU thread{'s' if self.threads > 1 else ''})" if self.device.type == "cpu" else ")"))
        for phase in self.phases:
            if phase in self.state["done"]:
                continue
            if self._checkpoint_for_any() is None:
                torch.manual_seed(self.cfg.seed * 10 + PHASE_SEED[phase])
            getattr(self, f"_phase_{phase}")()
            self.state["done"].append(phase)
            self.save_state(metrics_offset=self.rd.metrics_size())
            self.rd_checkpoint = None
            self.rd.discard_checkpoint()
            barrier()  # the phase's files are written before any rank reads them
        if not self.rd.writes:
            return self._summary()
        if hasattr(self.task, "save_artifacts") and (self.rd / "model.safetensors").is_file():
            self.state["artifacts"] = self.task.save_artifacts(load_run_model(self.rd.path)[0], self.rd.path)
        if run_lm_eval(self.cfg, self.rd.path, getattr(self.task, "tokenizer", None), self.state, self.device,
                       log=self._log):  # --lm-eval / --ppl: the found model and the original
            self.save_state()
        summary = self._summary()
        self.save_state(status="done")
        self.rd.write_json("summary.json", summary)
        from dmscale.run.report import write_report

        summary["report"] = str(write_report(self.rd.path))
        self.rd.write_json("summary.json", summary)
        return summary

    def _checkpoint_for_any(self) -> dict[str, Any] | None:
        return self.rd_checkpoint

    def _load_checkpoint(self) -> dict[str, Any] | None:
        if not self.rd.checkpoint.exists():
            self.rd.truncate_metrics(int(self.state.get("metrics_offset", 0)))
            return None
        ckpt = read_checkpoint(self.rd.checkpoint)
        self.global_step = int(ckpt["global_step"])
        self.rd.truncate_metrics(int(ckpt["metrics_offset"]))
        self.state = ckpt["state"]
        self._elapsed0 = float(self.state.get("elapsed", 0.0))
        return ckpt

    def checkpoint_for(self, phase: str) -> dict[str, Any] | None:
        ck = self.rd_checkpoint
        return ck if ck is not None and ck["phase"] == phase else None

    # ------------------------------------------------------------------ optimisers
    def _weight_optimizer(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        cfg = self.cfg
        if cfg.optimizer == "sgd":
            return torch.optim.SGD(params, lr=cfg.lr, momentum=0.9, nesterov=True,
                                   weight_decay=cfg.weight_decay)
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)

    def _schedule(self, opt: torch.optim.Optimizer, total: int) -> torch.optim.lr_scheduler.LambdaLR:
        warm = max(1, int(round(self.cfg.warmup * total))) if self.cfg.warmup > 0 else 0

        def factor(step: int) -> float:
            w = min(1.0, (step + 1) / warm) if warm else 1.0
            return w * 0.5 * (1.0 + math.cos(math.pi * min(step, total) / max(1, total)))

        return torch.optim.lr_scheduler.LambdaLR(opt, factor)

    def _steps(self, epochs: float) -> int:
        spe = self.task.steps_per_epoch(self.cfg.batch_size)
        return max(1, int(math.ceil(epochs * spe)))

    # ------------------------------------------------------------------ the loop
    def _train(self, phase: str, model: nn.Module, total: int,
               optimizers: list[torch.optim.Optimizer], schedulers: list[Any],
               searcher: dms.Searcher | None = None, teacher: nn.Module | None = None,
               until: Any = None, teacher_channels: list[int] | None = None) -> None:
        """Train ``model`` for ``total`` steps of ``phase``, resuming from a checkpoint;
        ``teacher_channels``: the teacher's hidden channels ``model`` kept (an export whose
        hidden size was pruned), compared by ``--distill-hidden``."""
        distill = (Distillation.from_config(teacher, self.cfg, teacher_channels)
                   if teacher is not None else None)
        traced = searcher is not None and self.cfg.search_trace
        StepLoop(self, phase, model, total, optimizers, schedulers, searcher=searcher, distill=distill, until=until,
                 trace=SearchTrace(searcher, self.rd.path, self.rd.writes) if traced else None,
                 seed=self.cfg.seed * 10 + PHASE_SEED[phase]).run()

    def evaluate(self, phase: str, model: nn.Module, searcher: dms.Searcher | None, step: int,
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

    # ------------------------------------------------------------------ summary
    def _summary(self) -> dict[str, Any]:
        cfg, st = self.cfg, self.state
        structure = self.rd.read_json("structure.json")
        return {
            "command": cfg.command, "run_dir": str(self.rd.path), "pipeline": cfg.pipeline,
            "phases": self.phases, "task": self.task.describe(), "task_kind": self.task.kind,
            "model": cfg.model, "model_args": cfg.model_args, "expand": cfg.expand,
            "resource": cfg.resource, "target": cfg.target,
            "counts": st["counts"], "resources": st.get("resources"),
            "resources_search_end": st.get("resources_search_end"),
            "evals": st["evals"], "original": st.get("original"), "lm_eval": st.get("lm_eval"),
            "steps": self.global_step, "processes": world_size(),
            "elapsed": round(self.elapsed(), 1), "warnings": st["warnings"],
            "structure": _structure_brief(structure) if structure else None,
            "align": _align_brief(cfg, structure), "auto": auto_brief(cfg), **self._watch_summary(),
            "fused_norms": fusion_state() if cfg.command == "search" else None,
        }


def _align_brief(cfg: RunConfig, structure: dict[str, Any] | None) -> dict[str, Any] | None:
    """The width multiple of a search run and the dims it left unaligned (None for other
    commands); a structure written before alignment existed has none: multiple 1."""
    if cfg.command != "search":
        return None
    found = (structure or {}).get("align") or {}
    return {"multiple": int(found.get("multiple", cfg.align or 1)),
            "unaligned": list(found.get("unaligned", []))}


def _structure_brief(structure: dict[str, Any]) -> dict[str, Any]:
    return {
        "width": [(w["name"], w["size"], w["kept"]) for w in structure.get("width", [])],
        "depth": [(d["name"], len(d["blocks"]), len(d["kept"])) for d in structure.get("depth", [])],
    }
