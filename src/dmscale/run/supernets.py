"""The supernet a phase starts from: a new one, with ``--weights`` / ``--pretrained``, the
pretrained one (the pretrain phase's, ``--init``'s), the one another run searched; its counts
and, for an ``hf:`` model, the original model's evaluation.

Every function takes the run's :class:`~dmscale.run.context.RunContext`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import dmscale as dms

from dmscale.config.run_config import ConfigError, load_run_config
from dmscale.engine.rundir import RunDir
from dmscale.run.context import RunContext
from dmscale.run.saved_runs import load_weights, new_supernet
from dmscale.tasks.hf_model import is_hf_model
from dmscale.tasks.start_weights import load_start_weights, load_weights_file, starts_from_weights

__all__ = ["evaluate_original", "load_init", "pretrained_supernet", "record_supernet", "searched_supernet",
           "source_supernet", "start_weights"]


def load_init(model: nn.Module, init: str, model_name: str | None) -> nn.Module:
    """``model`` with the weights of ``--init``: a ``dmscale pretrain`` run directory's model,
    or a weights file."""
    p = Path(init)
    if p.is_dir():
        src = load_run_config(p)
        if src.command != "pretrain":
            raise ConfigError(f"--init {p}: expected a `dmscale pretrain` run, got a "
                              f"`dmscale {src.command}` run")
        return load_weights(model, p / "model.safetensors")
    return load_weights_file(model, str(p), "--init", f"--model {model_name}")


def start_weights(ctx: RunContext, model: nn.Module) -> None:
    """Load ``--weights`` / ``--pretrained`` into the supernet a phase starts from (never
    into one a checkpoint restores), and say so."""
    text = load_start_weights(model, ctx.cfg, ctx.task.info)
    if text:
        ctx.log(text)
        ctx.state["start_weights"] = text


def evaluate_original(ctx: RunContext, model: nn.Module | None = None) -> None:
    """An ``hf:`` run's original model -- the pretrained model as loaded, before any step --
    evaluated once on the same held-out tokens as the found model (``--test-limit``
    applies), so that the summary can say what pruning cost ("original -> found"). Kept
    in the state (and so in every checkpoint): a resumed run does not evaluate it again.
    ``model``: the model as loaded, when the phase holds it (else it is loaded here)."""
    if not is_hf_model(ctx.cfg.model) or "original" in ctx.state:
        return
    if model is None:
        with torch.random.fork_rng(devices=[]):
            model = new_supernet(ctx.cfg, ctx.task.info, ctx.cfg.seed)[0]
    model.to(ctx.device)
    ctx.state["original"] = ctx.evaluate("original", model, None, 0)
    ctx.log(f"original model: {ctx.task.format_metrics(ctx.state['original'])}")
    ctx.save_state()


def record_supernet(ctx: RunContext, model: nn.Module) -> None:
    """``state["counts"]["supernet"]``: the supernet's counts, once per run."""
    if "supernet" not in ctx.state["counts"]:
        c = dms.count(model, ctx.example)
        c["parameters_total"] = sum(p.numel() for p in model.parameters())
        ctx.state["counts"]["supernet"] = c


def pretrained_supernet(ctx: RunContext) -> tuple[nn.Module, list[str]]:
    """The supernet with pretrained weights (pretrain phase output, --init, or without a
    pretraining the weights the run starts from), and the model's own exclusions."""
    cfg = ctx.cfg
    model, exclude = new_supernet(cfg, ctx.task.info, cfg.seed)
    if cfg.init is None and "pretrain" not in ctx.phases:
        if not starts_from_weights(cfg):  # hf:PATH, pretrained as loaded
            return model, exclude
        if not (ctx.rd / "supernet.safetensors").is_file():  # loaded once, then the run's own
            start_weights(ctx, model)
            ctx.save_weights(model, "supernet.safetensors")
            return model, exclude
    if cfg.init is None:
        return load_weights(model, ctx.rd / "supernet.safetensors"), exclude
    return load_init(model, cfg.init, cfg.model), exclude


def searched_supernet(ctx: RunContext, source: RunDir) -> nn.Module:
    """``dmscale retrain RUN --retrain-init pretrained``: the pretrained supernet the p search
    ``RUN`` started from (its ``supernet.safetensors``, else the weights of its ``--init``)."""
    found = source_supernet(ctx, source)
    init = load_run_config(source.path).init
    if found is None and init is not None:
        found = load_init(new_supernet(ctx.cfg, ctx.task.info, ctx.cfg.seed)[0], init, ctx.cfg.model)
    if found is None:
        raise ConfigError(f"--retrain-init pretrained: {source.path} holds no pretrained supernet "
                          "(supernet.safetensors, or an --init); retrain with --retrain-init inherit or scratch")
    return found


def source_supernet(ctx: RunContext, source: RunDir) -> nn.Module | None:
    """``dmscale retrain --teacher supernet``: the pretrained supernet the run at ``source``
    searched -- its ``supernet.safetensors``, or for an ``hf:`` model searched without
    pretraining the model as loaded; None when neither applies (a random supernet, or
    one pretrained elsewhere: give that run as ``--teacher``)."""
    cfg = ctx.cfg
    src = load_run_config(source.path)
    if src.pipeline not in ("p", "p-"):
        return None
    if (source / "supernet.safetensors").is_file():
        return load_weights(new_supernet(cfg, ctx.task.info, cfg.seed)[0], source / "supernet.safetensors")
    if is_hf_model(cfg.model) and src.init is None:
        return new_supernet(cfg, ctx.task.info, cfg.seed)[0]
    return None
