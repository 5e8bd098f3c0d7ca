"""The retrain phase: train the found structure's weights (pipelines np / p after their
search, or ``dmscale retrain RUN``), starting from the search's export (``--retrain-init
inherit``), the pretrained supernet's kept channels (``pretrained``) or new weights
(``scratch``), distilled from a teacher when the run has one; then write
``model.safetensors`` (and ``RUN/hf`` for an ``hf:`` model)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import dmscale as dms

from dmscale.config.run_config import ConfigError
from dmscale.engine.fsdp import unsharded
from dmscale.engine.rundir import RunDir
from dmscale.run.context import PhaseResult, RunContext
from dmscale.run.model_checks import check_hf, check_teacher, save_hf
from dmscale.run.saved_runs import load_run_model, load_teacher, new_supernet
from dmscale.run.supernets import pretrained_supernet, record_supernet, searched_supernet, source_supernet
from dmscale.run.training import cosine_schedule, shard, train, weight_optimizer
from dmscale.tasks.hf_model import is_hf_model

__all__ = ["RetrainPhase"]


class RetrainPhase:
    """Retrain the structure of the run (or of ``--source`` for ``dmscale retrain``)."""

    name = "retrain"

    def run(self, ctx: RunContext) -> PhaseResult:
        cfg = ctx.cfg
        source = RunDir(cfg.source) if cfg.command == "retrain" else ctx.rd
        structure = _source_structure(ctx, source)
        model = self._start_model(ctx, source, structure)
        check_hf(cfg, model)
        model.to(ctx.device)
        _record_counts(ctx, source, model)
        teacher = self._teacher(ctx, source)
        channels = check_teacher(ctx, teacher, model, structure) if teacher is not None else None
        total = ctx.steps(cfg.epochs if cfg.command == "retrain" else cfg.retrain_epochs)
        shard(cfg, model, teacher=teacher)
        opt = weight_optimizer(cfg, list(model.parameters()))
        train(ctx, "retrain", model, total, [opt], [cosine_schedule(cfg, opt, total)], teacher=teacher,
              teacher_channels=channels)
        metrics = ctx.watch.phase_result(ctx, "retrain", model, total, ctx.evaluate("retrain", model, None, total))
        ctx.state["evals"]["retrain"] = metrics
        ctx.state["evals"]["final"] = metrics
        full = unsharded(model)  # --shard fsdp: gathered on rank 0, None on the other ranks
        ctx.save_weights(full, "model.safetensors")
        wrote = ["model.safetensors"]
        if is_hf_model(cfg.model):
            save_hf(ctx, full)
            wrote.append("hf")
        return PhaseResult(wrote=wrote, metrics=metrics)

    def _start_model(self, ctx: RunContext, source: RunDir, structure: dict[str, Any]) -> nn.Module:
        """The found structure with the weights of ``--retrain-init``."""
        cfg = ctx.cfg
        if cfg.retrain_init == "inherit":
            return load_run_model(source.path)[0]
        if cfg.retrain_init == "pretrained":  # the kept channels of the weights before the search
            model = pretrained_supernet(ctx)[0] if cfg.command == "search" else searched_supernet(ctx, source)
        else:
            model, _ = new_supernet(cfg, ctx.task.info, cfg.seed * 7 + 1)
        dms.apply_structure(model, structure)
        return model

    def _teacher(self, ctx: RunContext, source: RunDir) -> nn.Module | None:
        """The search's frozen teacher of this run, else the one ``--teacher`` names (with a
        distillation term), else None."""
        cfg, teacher = ctx.cfg, ctx.teacher
        if cfg.teacher and cfg.distills and teacher is None:
            sup = None
            if cfg.teacher == "supernet":
                sup = pretrained_supernet(ctx)[0] if cfg.command == "search" else source_supernet(ctx, source)
            teacher = load_teacher(cfg.teacher, ctx.device, supernet=sup, copy_supernet=False)
        return teacher


def _source_structure(ctx: RunContext, source: RunDir) -> dict[str, Any]:
    """The structure to retrain (``dmscale retrain``: copied into the run with the searched
    run's original evaluation)."""
    structure = source.read_json("structure.json")
    if structure is None:
        raise ConfigError(f"{source.path} has no structure.json: run `dmscale search` first")
    if ctx.cfg.command == "retrain" and not (ctx.rd / "structure.json").exists():
        ctx.rd.write_json("structure.json", structure)
    if ctx.cfg.command == "retrain" and "original" not in ctx.state:  # the searched run's original
        original = (source.read_json("state.json") or {}).get("original")
        if original is not None:
            ctx.state["original"] = original
    return structure


def _record_counts(ctx: RunContext, source: RunDir, model: nn.Module) -> None:
    """The supernet's counts (the searched run's, or counted here) and the found model's."""
    if "supernet" not in ctx.state["counts"]:
        counts = (source.read_json("state.json") or {}).get("counts", {})
        if "supernet" in counts:
            ctx.state["counts"]["supernet"] = counts["supernet"]
        else:
            with torch.random.fork_rng(devices=[]):
                record_supernet(ctx, new_supernet(ctx.cfg, ctx.task.info, ctx.cfg.seed)[0])
    ctx.state["counts"]["found"] = dms.count(model, ctx.example)
