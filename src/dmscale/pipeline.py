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
The run directory holds ``config.yaml`` (resolved), ``state.json`` (phases done, steps),
``metrics.jsonl``, ``checkpoint.pt`` (written atomically every ``--checkpoint-every`` steps:
model, optimisers, schedulers, the fp16 GradScaler, ``searcher.state_dict()``, RNG states,
step), and the outputs: ``supernet.safetensors`` (pretrained supernet), ``structure.json``
and ``model.safetensors`` (the found model), ``summary.json``, ``report.md`` with plots.
Batches are a pure function of ``(seed, phase, step)``, so a resumed run computes exactly
what an uninterrupted one does.

Every phase trains with one step loop, :class:`dmscale.engine.loop.StepLoop` (autocast,
gradient scaling, the non-finite skip, checkpoints, progress); the run directory's files live
in :mod:`dmscale.engine.rundir`, reading run directories (export, eval) in
:mod:`dmscale.runs`. Their public names stay importable from here.

Example:
    >>> import tempfile
    >>> from dmscale.config import RunConfig
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
from pathlib import Path
from typing import Any

import torch
from torch import nn

import dmscale as dms

from .config import (
    OPTIONS_BY_NAME,
    RESUME_MUTABLE,
    ConfigError,
    RunConfig,
    load_run_config,
    save_config,
)
from .distributed import is_main_process, world_size
from .engine.ddp import barrier, check_task_for_ranks
from .engine.device import Precision, resolve_device, set_threads
from .errors import NoImportanceError
from .engine.loop import MAX_NON_FINITE_STEPS, StepLoop, calibrated_resource_loss
from .engine.rundir import (
    CHECKPOINT_VERSION,
    Progress,
    RunDir,
    StopOnSignals,
    Stopped,
    fmt_count,
    read_checkpoint,
)
from .io import save_weights
from .report import posthoc_line
from .runs import (
    check_inputs_from_info,
    evaluate_run,
    example_from_info,
    export_run,
    load_run_model,
    load_teacher,
    load_weights,
    make_searcher,
    search_config,
    new_supernet,
    searcher_from_checkpoint,
)
from .tasks.hf_model import HF_DIR, is_hf_model, save_hf_dir
from .tasks.registry import Distillation, Task, build_task

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
    "recalibrate_batchnorm",
    "export_run",
    "evaluate_run",
    # re-exported from dmscale.engine / dmscale.runs (their home since the step loop moved)
    "CHECKPOINT_VERSION",
    "MAX_NON_FINITE_STEPS",
    "Progress",
    "StopOnSignals",
    "calibrated_resource_loss",
    "check_inputs_from_info",
    "example_from_info",
    "fmt_count",
    "read_checkpoint",
    "searcher_from_checkpoint",
    "set_threads",
]

PHASE_SEED = {"pretrain": 1, "search": 2, "finish": 3, "retrain": 4}
FINISH_STEPS = 300  # structure-only steps allowed after the search to get under the target
BUDGET_FILL = 0.98  # a found model under this fraction of its target gets the unused budget back
BN_CALIBRATION_BATCHES = 20  # batches that re-estimate BatchNorm statistics of the export


def phases_of(cfg: RunConfig) -> list[str]:
    """The phases a run of ``cfg`` goes through."""
    if cfg.command == "pretrain":
        return ["pretrain"]
    if cfg.command == "retrain":
        return ["retrain"]
    phases: list[str] = []
    if cfg.pipeline in ("p", "p-") and cfg.init is None and not (
            is_hf_model(cfg.model) and not cfg.pretrain_epochs):  # hf: already pretrained
        if not cfg.pretrain_epochs:
            raise ConfigError(f"pipeline {cfg.pipeline} needs a pretrained supernet: "
                              "--pretrain-epochs > 0 or --init RUN")
        phases.append("pretrain")
    phases.append("search")
    if cfg.pipeline in ("np", "p") and cfg.retrain_epochs:
        phases.append("retrain")
    return phases


def recalibrate_batchnorm(model: nn.Module, task: Task, batch_size: int, seed: int,
                          device: torch.device | str = "cpu", n_batches: int = BN_CALIBRATION_BATCHES) -> int:
    """Re-estimate the running statistics of every BatchNorm layer of ``model`` on training
    batches (no gradients, weights untouched); returns the number of layers.

    The statistics a supernet collects during the search are those of soft masks (channels
    scaled by 0.5 - 0.9, blocks partly on); the exported model computes hard-masked
    activations, so its inherited running statistics are off until re-estimated.
    """
    def batches():
        for step in range(n_batches):
            x, _ = task.train_batch(step, batch_size, seed)
            yield x.to(device)

    with torch.random.fork_rng(devices=[]):
        return dms.recalibrate_batchnorm(model, batches(), forward=task.forward)


class Pipeline:
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
        self.cfg = self._prepare_config(cfg.resolved())
        self.device = resolve_device(self.cfg.device)
        self.precision = Precision(self.cfg.precision, self.device)
        self.threads = set_threads(self.cfg.threads)
        self.phases = phases_of(self.cfg)
        self.task: Task = build_task(self.cfg)
        check_task_for_ranks(self.task)
        if not self.cfg.task_info:
            self.cfg.task_info = dict(self.task.info)
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
    def _prepare_config(self, cfg: RunConfig) -> RunConfig:
        path = self.rd.path
        if self.resume:
            saved = load_run_config(path)
            if saved.command != cfg.command:
                raise ConfigError(f"{path} is a `dmscale {saved.command}` run, not `{cfg.command}`")
            changed = {}
            for opt in OPTIONS_BY_NAME.values():
                new = getattr(cfg, opt.name)
                if opt.name in RESUME_MUTABLE or new == getattr(saved, opt.name):
                    continue
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
        try:
            return self._run()
        except ConfigError:
            if not self.resume and getattr(self, "_created", False) and self.global_step == 0 \
                    and self.rd.writes:
                shutil.rmtree(self.rd.path, ignore_errors=True)
            raise

    def _save_weights(self, model: nn.Module, name: str) -> None:
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
        summary = self._summary()
        self.save_state(status="done")
        self.rd.write_json("summary.json", summary)
        from .report import write_report

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
               until: Any = None) -> None:
        """Train ``model`` for ``total`` steps of ``phase``, resuming from a checkpoint."""
        distill = Distillation.from_config(teacher, self.cfg) if teacher is not None else None
        StepLoop(self, phase, model, total, optimizers, schedulers, searcher=searcher,
                 distill=distill, until=until,
                 seed=self.cfg.seed * 10 + PHASE_SEED[phase]).run()

    def evaluate(self, phase: str, model: nn.Module, searcher: dms.Searcher | None, step: int,
                 limit: int | None = None) -> dict[str, float]:
        """Metrics of ``model`` (hard masks during a search) on the test split, under the
        run's autocast; recorded in ``metrics.jsonl``."""
        with self.precision.autocast():
            if searcher is not None:
                with searcher.hardened():
                    metrics = self.task.evaluate(model, device=self.device, limit=limit)
            else:
                metrics = self.task.evaluate(model, device=self.device, limit=limit)
        self.rd.append_metrics({"phase": phase, "event": "eval", "step": step,
                                "global_step": self.global_step, **metrics})
        return metrics

    # ------------------------------------------------------------------ phases
    def _phase_pretrain(self) -> None:
        cfg = self.cfg
        model, _ = new_supernet(cfg, self.task.info, cfg.seed)
        model.to(self.device)
        self._record_supernet(model)
        epochs = cfg.epochs if cfg.command == "pretrain" else cfg.pretrain_epochs
        total = self._steps(epochs)
        opt = self._weight_optimizer(list(model.parameters()))
        sch = self._schedule(opt, total)
        self._train("pretrain", model, total, [opt], [sch])
        metrics = self.evaluate("pretrain", model, None, total)
        self.state["evals"]["pretrain"] = metrics
        self._save_weights(model, "supernet.safetensors")
        if cfg.command == "pretrain":
            self._save_weights(model, "model.safetensors")
            self.state["counts"]["found"] = self.state["counts"]["supernet"]

    def _record_supernet(self, model: nn.Module) -> None:
        if "supernet" not in self.state["counts"]:
            c = dms.count(model, self.example)
            c["parameters_total"] = sum(p.numel() for p in model.parameters())
            self.state["counts"]["supernet"] = c

    def _pretrained_supernet(self) -> tuple[nn.Module, list[str]]:
        """The supernet with pretrained weights (pretrain phase output or --init), and the
        model's own exclusions."""
        cfg = self.cfg
        model, exclude = new_supernet(cfg, self.task.info, cfg.seed)
        if cfg.init is None and "pretrain" not in self.phases:  # hf:PATH, pretrained as loaded
            return model, exclude
        if cfg.init is None:
            return load_weights(model, self.rd / "supernet.safetensors"), exclude
        p = Path(cfg.init)
        if p.is_dir():
            src = load_run_config(p)
            if src.command != "pretrain":
                raise ConfigError(f"--init {p}: expected a `dmscale pretrain` run, got a "
                                  f"`dmscale {src.command}` run")
            p = p / "model.safetensors"
        return load_weights(model, p), exclude

    def search_config(self, exclude: list[str]) -> dms.SearchConfig:
        """The library config of this run's search (a subclass may change it, e.g. the gate of
        the baselines in bench/gates.py)."""
        return search_config(self.cfg, exclude)

    def _make_searcher(self, model: nn.Module, extra_exclude: list[str]) -> dms.Searcher:
        return make_searcher(self.cfg, model, self.example, extra_exclude, self.search_config)

    def _phase_search(self) -> None:
        cfg = self.cfg
        pretrained = cfg.pipeline in ("p", "p-")
        if pretrained:
            model, extra_exclude = self._pretrained_supernet()
        else:
            model, extra_exclude = new_supernet(cfg, self.task.info, cfg.seed)
        model.to(self.device)
        self._record_supernet(model)
        teacher = None
        if cfg.teacher and cfg.distills:
            teacher = load_teacher(cfg.teacher, self.device, supernet=model if pretrained else None)
            self._check_teacher(teacher, model)
            self._teacher = teacher  # kept for the retrain phase of this run: one frozen copy
        searcher = self._make_searcher(model, extra_exclude)
        s_opt = torch.optim.Adam(list(searcher.structure_parameters()), lr=cfg.structure_lr,
                                 weight_decay=0.0)
        total = self._steps(cfg.epochs)
        if cfg.pipeline == "p-":
            for prm in searcher.model_parameters():
                prm.requires_grad_(False)
            optimizers, schedulers = [s_opt], []
        else:
            w_opt = self._weight_optimizer(list(searcher.model_parameters()))
            optimizers, schedulers = [w_opt, s_opt], [self._schedule(w_opt, total)]
        if self.checkpoint_for("finish") is None:
            self._train("search", model, total, optimizers, schedulers, searcher, teacher)
        self._finish_search(model, searcher, teacher, s_opt)
        if not searcher.has_importance():  # every step skipped (non-finite loss or gradients)
            raise NoImportanceError(
                f"the search ran {total} steps but none updated importance (each was skipped for a "
                "non-finite loss or gradient, see metrics.jsonl), so it found no structure (an "
                "export would keep the first channels of every layer); no structure.json was written: "
                "search again with more --epochs, a lower --lr or --precision 32")
        self.rd.write_json("structure.json", searcher.structure())
        small = searcher.export()
        recalibrate_batchnorm(small, self.task, cfg.batch_size, cfg.seed * 10 + 5, self.device)
        metrics = self.evaluate("search", small, None, total)
        self.state["evals"]["search"] = metrics
        self.state["evals"]["final"] = metrics
        self._save_weights(small, "model.safetensors")
        if is_hf_model(cfg.model) and "retrain" not in self.phases:
            self._save_hf(small)
        self.state["counts"]["found"] = dms.count(small, self.example)
        self.state["resources"] = searcher.resources()
        if cfg.resource == "latency":
            fit = searcher.latency_fit()
            self.state["latency_fit"] = {k: fit[k] for k in ("fit_rmse_rel", "fit_rmse_rel_max",
                                                             "parts_rel_error", "calibration")}
            self._log(f"latency model: fit error {fit['fit_rmse_rel']:.1%} (pooled relative RMSE, "
                      f"worst layer {fit['fit_rmse_rel_max']:.1%}); the parts add up to the timed "
                      f"model within {fit['parts_rel_error']:+.1%}, calibration x{fit['calibration']:.3f}")

    def _check_teacher(self, teacher: nn.Module, model: nn.Module) -> None:
        with torch.no_grad():
            was = model.training
            model.eval()
            a = self.task.forward(model, self.example)
            model.train(was)
            b = self.task.forward(teacher, self.example)
        if a.shape != b.shape:
            raise ConfigError(f"--teacher {self.cfg.teacher}: its logits have shape {tuple(b.shape)}, "
                              f"the model's {tuple(a.shape)}")
        if self.cfg.distill_hidden > 0:
            self._check_hidden(teacher, model)

    def _check_hidden(self, teacher: nn.Module, model: nn.Module) -> None:
        """``--distill-hidden``: both forwards return hidden states of the same width."""
        with torch.no_grad():
            was = model.training
            model.eval()
            _, h_s = self.task.forward_hidden(model, self.example)
            model.train(was)
            _, h_t = self.task.forward_hidden(teacher, self.example)
        if h_s[-1].shape[-1] != h_t[-1].shape[-1]:
            raise ConfigError(
                f"--distill-hidden: the model's hidden size {h_s[-1].shape[-1]} differs from the "
                f"teacher's {h_t[-1].shape[-1]} (the search pruned the hidden size), so their "
                "hidden states cannot be compared: keep the hidden size (--exclude "
                "lm.model.embed_tokens for an hf: model) or finetune with --distill-hidden 0")

    def _finish_search(self, model: nn.Module, searcher: dms.Searcher, teacher: nn.Module | None,
                       s_opt: torch.optim.Optimizer) -> None:
        """Structure-only steps at the final target until the hard cost is under it; then the
        budget solver when the cost is still over, or under ``BUDGET_FILL`` x target (a
        budget left unused is capacity the found model could have had)."""
        def under() -> bool:
            res = searcher.resources()
            return res["hard"] <= res["target"] * (1 + 1e-9)

        def filled() -> bool:
            res = searcher.resources()
            return res["hard"] >= BUDGET_FILL * res["target"]

        if self.checkpoint_for("finish") is None:
            self.state["resources_search_end"] = searcher.resources()
        if self.checkpoint_for("finish") is not None or not under():
            frozen = [p for p in searcher.model_parameters() if p.requires_grad]
            for prm in frozen:
                prm.requires_grad_(False)
            try:
                self._train("finish", model, FINISH_STEPS, [s_opt], [], searcher, teacher, until=under)
            finally:
                for prm in frozen:
                    prm.requires_grad_(True)
        if not under() or not filled():  # common shift of every ratio, then refill unit by unit
            searcher.meet_target()
        moved = posthoc_line(self.state.get("resources_search_end"), searcher.resources())
        if moved:
            self._log(moved)
        if not under():
            res = searcher.resources()
            self.state["warnings"].append(
                f"the found model costs {fmt_count(res['hard'])} {res['resource']}, over the target "
                f"{fmt_count(res['target'])}: raise --resource-weight or --structure-lr, or search longer")

    def _phase_retrain(self) -> None:
        cfg = self.cfg
        source = RunDir(cfg.source) if cfg.command == "retrain" else self.rd
        structure = source.read_json("structure.json")
        if structure is None:
            raise ConfigError(f"{source.path} has no structure.json: run `dmscale search` first")
        if cfg.command == "retrain" and not (self.rd / "structure.json").exists():
            self.rd.write_json("structure.json", structure)
        if cfg.retrain_init == "inherit":
            model, _ = load_run_model(source.path)
        else:
            model, _ = new_supernet(cfg, self.task.info, cfg.seed * 7 + 1)
            dms.apply_structure(model, structure)
        model.to(self.device)
        if "supernet" not in self.state["counts"]:
            counts = (source.read_json("state.json") or {}).get("counts", {})
            if "supernet" in counts:
                self.state["counts"]["supernet"] = counts["supernet"]
            else:
                with torch.random.fork_rng(devices=[]):
                    self._record_supernet(new_supernet(cfg, self.task.info, cfg.seed)[0])
        self.state["counts"]["found"] = dms.count(model, self.example)
        teacher = getattr(self, "_teacher", None)
        if cfg.teacher and cfg.distills and teacher is None:
            sup = None
            if cfg.teacher == "supernet":
                sup = self._pretrained_supernet()[0] if cfg.command == "search" else None
            teacher = load_teacher(cfg.teacher, self.device, supernet=sup, copy_supernet=False)
            self._check_teacher(teacher, model)
        epochs = cfg.epochs if cfg.command == "retrain" else cfg.retrain_epochs
        total = self._steps(epochs)
        opt = self._weight_optimizer(list(model.parameters()))
        sch = self._schedule(opt, total)
        self._train("retrain", model, total, [opt], [sch], teacher=teacher)
        metrics = self.evaluate("retrain", model, None, total)
        self.state["evals"]["retrain"] = metrics
        self.state["evals"]["final"] = metrics
        self._save_weights(model, "model.safetensors")
        if is_hf_model(cfg.model):
            self._save_hf(model)

    def _save_hf(self, model: nn.Module) -> None:
        """``RUN/hf``: the found model of an ``hf:`` run as a ``from_pretrained`` directory."""
        if not self.rd.writes:
            return
        fmt = save_hf_dir(model, self.rd / HF_DIR, self.cfg.model,
                          tokenizer=getattr(self.task, "tokenizer", None))
        how = "from_pretrained" + (" (trust_remote_code=True)" if fmt == "per_layer" else "")
        self._log(f"saved {self.rd / HF_DIR}: Hugging Face {fmt} format with the tokenizer (loads with {how})")

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
            "evals": st["evals"], "steps": self.global_step, "processes": world_size(),
            "elapsed": round(self.elapsed(), 1), "warnings": st["warnings"],
            "structure": _structure_brief(structure) if structure else None,
        }


def _structure_brief(structure: dict[str, Any]) -> dict[str, Any]:
    return {
        "width": [(w["name"], w["size"], w["kept"]) for w in structure.get("width", [])],
        "depth": [(d["name"], len(d["blocks"]), len(d["kept"])) for d in structure.get("depth", [])],
    }


