"""The pipelines of the ``dmscale`` command: phases and the orchestration of a run, resume.

A run is a sequence of *phases* (paper Table 1), listed per pipeline in
:mod:`dmscale.run.phase_list`.

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

:class:`Pipeline` builds the run's :class:`~dmscale.run.context.RunContext` once and runs the
phase objects of :mod:`dmscale.run.phases` in order, each ``phase.run(ctx)``; every phase
trains with one step loop, :class:`dmscale.engine.loop.StepLoop`. The run directory's files
live in :mod:`dmscale.engine.rundir`, reading run directories in :mod:`dmscale.run.saved_runs`,
the LLM evaluation at the end (``--lm-eval``) in :mod:`dmscale.run.lm_evaluation`.

Two extension points change or observe the search without subclassing: ``search_overrides``
(fields of the run's :class:`~dmscale.SearchConfig`, e.g. a baseline's ``gate_factory``) and
``search_hooks`` (a :class:`~dmscale.run.phase_search.SearchHooks`, called with the searcher).

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

import shutil
from typing import Any, cast

import torch
from torch import nn

import dmscale as dms

from dmscale.config.defaults import auto_brief
from dmscale.config.run_config import ConfigError, RunConfig, save_config
from dmscale.core.distributed import world_size
from dmscale.core.fused_norms import fusion_state, reset_fusion
from dmscale.engine.ddp import barrier
from dmscale.engine.device import resolve_device, set_threads
from dmscale.engine.loop import MAX_NON_FINITE_STEPS
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
from dmscale.run.context import PhaseResult, RunContext
from dmscale.run.lm_evaluation import run_lm_eval
from dmscale.run.phase_list import PHASE_SEED, phases_of
from dmscale.run.phase_search import SearchHooks, SearchPhase
from dmscale.run.phases import build_phases, calibrate_on_task
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

__all__ = [
    "PHASE_SEED",
    "Pipeline",
    "SearchHooks",
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


class Pipeline:
    """Run (or resume) the phases of ``cfg`` in its run directory.

    Args:
        cfg: the run configuration (``out`` must be set: the run directory).
        resume: continue the run found in ``cfg.out``.
        explicit: the options given on the command line (a resume refuses only those that
            differ from the run's); None: every option of ``cfg`` counts as given.
        search_overrides: fields of the run's :class:`~dmscale.SearchConfig` to replace.
        search_hooks: observers of the search's searcher (:class:`SearchHooks`).
    """

    def __init__(self, cfg: RunConfig, resume: bool = False, explicit: set[str] | None = None, *,
                 search_overrides: dict[str, Any] | None = None, search_hooks: SearchHooks | None = None) -> None:
        self.resume = resume
        self.ctx = RunContext.build(cfg, resume, explicit)
        self.phase_objects = build_phases(search_overrides, search_hooks)
        self.results: dict[str, PhaseResult] = {}  # what each phase this process ran did

    def make_searcher(self, model: nn.Module, extra_exclude: list[str]) -> dms.Searcher:
        """The searcher this run's search phase builds for ``model`` (its overrides and hooks
        included). The run's configuration, task, device, run directory and state are
        ``self.ctx``'s (:class:`~dmscale.run.context.RunContext`)."""
        search = cast(SearchPhase, self.phase_objects["search"])
        return search.make_searcher(self.ctx, model, extra_exclude)

    # ------------------------------------------------------------------ main
    def run(self) -> dict[str, Any]:
        """Run the remaining phases; returns the summary (also in ``summary.json``).

        A new run that fails on a bad option before its first step leaves no directory.
        """
        ctx = self.ctx
        reset_fusion()  # the summary says how this run's masked norms ran
        try:
            return self._run()
        except ConfigError:
            if not self.resume and ctx.created and ctx.global_step == 0 and ctx.rd.writes:
                shutil.rmtree(ctx.rd.path, ignore_errors=True)
            raise
        finally:
            ctx.watch.close()
            close = getattr(ctx.task, "close", None)
            if close is not None:
                close()  # loader workers end with the run

    def _run(self) -> dict[str, Any]:
        ctx = self.ctx
        barrier()  # every rank has checked the run directory before rank 0 writes to it
        if ctx.rd.writes:
            ctx.rd.path.mkdir(parents=True, exist_ok=True)
            save_config(ctx.cfg, ctx.rd.config)
        if self.resume:
            ctx.checkpoint = _load_checkpoint(ctx)
        else:
            ctx.checkpoint = None
            ctx.rd.truncate_metrics(0)
            ctx.save_state()
        ctx.watch.open(ctx.rd, self.resume, ctx.global_step)
        ctx.log(f"dmscale {ctx.cfg.command}: {ctx.task.describe()}")
        ctx.log(f"run directory: {ctx.rd.path} ({ctx.device}"
                + (f", {ctx.threads} CPU thread{'s' if ctx.threads > 1 else ''})" if ctx.device.type == "cpu" else ")"))
        for phase in ctx.phases:
            if phase in ctx.state["done"]:
                continue
            if ctx.checkpoint is None:
                torch.manual_seed(ctx.cfg.seed * 10 + PHASE_SEED[phase])
            self.results[phase] = self.phase_objects[phase].run(ctx)
            ctx.state["done"].append(phase)
            ctx.save_state(metrics_offset=ctx.rd.metrics_size())
            ctx.checkpoint = None
            ctx.rd.discard_checkpoint()
            barrier()  # the phase's files are written before any rank reads them
        if not ctx.rd.writes:
            return _summary(ctx)
        return self._conclude()

    def _conclude(self) -> dict[str, Any]:
        """Rank 0 after the last phase: the task's artifacts, the LLM evaluation, the summary
        and the report."""
        ctx = self.ctx
        if hasattr(ctx.task, "save_artifacts") and (ctx.rd / "model.safetensors").is_file():
            ctx.state["artifacts"] = ctx.task.save_artifacts(load_run_model(ctx.rd.path)[0], ctx.rd.path)
        if run_lm_eval(ctx.cfg, ctx.rd.path, getattr(ctx.task, "tokenizer", None), ctx.state, ctx.device,
                       log=ctx.log):  # --lm-eval / --ppl: the found model and the original
            ctx.save_state()
        summary = _summary(ctx)
        ctx.save_state(status="done")
        ctx.rd.write_json("summary.json", summary)
        from dmscale.run.report import write_report

        summary["report"] = str(write_report(ctx.rd.path))
        ctx.rd.write_json("summary.json", summary)
        return summary


def _load_checkpoint(ctx: RunContext) -> dict[str, Any] | None:
    """The checkpoint a resumed run continues (its step, state and metrics restored), or None
    when the run stopped between phases."""
    if not ctx.rd.checkpoint.exists():
        ctx.rd.truncate_metrics(int(ctx.state.get("metrics_offset", 0)))
        return None
    ckpt = read_checkpoint(ctx.rd.checkpoint)
    ctx.global_step = int(ckpt["global_step"])
    ctx.rd.truncate_metrics(int(ckpt["metrics_offset"]))
    ctx.state = ckpt["state"]
    ctx.elapsed0 = float(ctx.state.get("elapsed", 0.0))
    return ckpt


def _summary(ctx: RunContext) -> dict[str, Any]:
    """The run's summary (``summary.json``)."""
    cfg, st = ctx.cfg, ctx.state
    structure = ctx.rd.read_json("structure.json")
    return {
        "command": cfg.command, "run_dir": str(ctx.rd.path), "pipeline": cfg.pipeline,
        "phases": ctx.phases, "task": ctx.task.describe(), "task_kind": ctx.task.kind,
        "model": cfg.model, "model_args": cfg.model_args, "expand": cfg.expand,
        "resource": cfg.resource, "target": cfg.target,
        "counts": st["counts"], "resources": st.get("resources"),
        "resources_search_end": st.get("resources_search_end"),
        "evals": st["evals"], "original": st.get("original"), "lm_eval": st.get("lm_eval"),
        "steps": ctx.global_step, "processes": world_size(),
        "elapsed": round(ctx.elapsed(), 1), "warnings": st["warnings"],
        "structure": _structure_brief(structure) if structure else None,
        "align": _align_brief(cfg, structure), "auto": auto_brief(cfg), **ctx.watch.summary(st),
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
