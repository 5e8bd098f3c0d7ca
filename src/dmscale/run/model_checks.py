"""Checks a phase makes on its models before the first step, and the ``hf:`` outputs it writes
at the end: a teacher whose outputs can be compared with the model's (``--teacher``,
``--distill-hidden``), an ``hf:`` model that ``RUN/hf`` (and ``RUN/model.gguf``) can hold.

A refusal is a :class:`~dmscale.core.errors.ConfigError` raised before any step, so that a
new run leaves no directory. Every function takes the run's context (``cfg``, ``task``,
``example``, ``rd``, ``log``: a :class:`~dmscale.run.context.RunContext`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dmscale.config.run_config import ConfigError
from dmscale.engine.ddp import on_all_ranks
from dmscale.tasks.distill import kept_hidden_channels
from dmscale.tasks.hf_model import check_gguf_run, check_hf_dir, is_hf_model, save_hf_outputs

__all__ = ["check_hf", "check_teacher", "save_hf"]


def check_hf(cfg: Any, model: nn.Module) -> None:
    """An ``hf:`` search or retrain ends by writing ``RUN/hf`` (and ``RUN/model.gguf``): refuse
    before the first step a model that could not be written (:func:`check_hf_dir`)."""
    if is_hf_model(cfg.model) and cfg.command != "pretrain":
        check_hf_dir(model, cfg.model, cfg.layer_uniform, cfg.depth_unit)
        if cfg.export == "gguf":
            check_gguf_run(model, cfg.model, cfg.layer_uniform)


def save_hf(ctx: Any, model: nn.Module | None) -> None:
    """``RUN/hf`` (and ``RUN/model.gguf`` with ``--export gguf``): the found model of an
    ``hf:`` run. Called on every rank, rank 0 writes: its error is every rank's."""
    cfg, tok = ctx.cfg, getattr(ctx.task, "tokenizer", None)
    lines = on_all_ranks(lambda: [] if not ctx.rd.writes or model is None else save_hf_outputs(
        model, ctx.rd.path, cfg.model, cfg.export, cfg.gguf_type, tokenizer=tok))
    for line in lines:
        ctx.log(line)


def check_teacher(ctx: Any, teacher: nn.Module, model: nn.Module,
                  structure: dict | None = None) -> list[int] | None:
    """Refuse a teacher whose outputs cannot be compared with ``model``'s; returns the
    teacher's hidden channels that ``model`` kept when ``--distill-hidden`` compares them
    at those channels (``model`` an export of ``structure`` with a pruned hidden size),
    else None."""
    a, b = _on_example(ctx.example, ctx.task.forward, model, teacher)
    if a.shape != b.shape:
        raise ConfigError(f"--teacher {ctx.cfg.teacher}: its logits have shape {tuple(b.shape)}, "
                          f"the model's {tuple(a.shape)}")
    if ctx.cfg.distill_hidden > 0:
        return _check_hidden(ctx, teacher, model, structure)
    return None


def _on_example(example: Any, forward: Any, model: nn.Module, teacher: nn.Module) -> tuple[Any, Any]:
    """``forward(model, example)`` in eval mode (``model``'s mode restored after) and
    ``forward(teacher, example)``, without gradients."""
    with torch.no_grad():
        was = model.training
        model.eval()
        a = forward(model, example)
        model.train(was)
        return a, forward(teacher, example)


def _check_hidden(ctx: Any, teacher: nn.Module, model: nn.Module,
                  structure: dict | None = None) -> list[int] | None:
    """``--distill-hidden``: both forwards return hidden states of the same width, or the
    model's are the teacher's at the kept channels ``structure`` records
    (:func:`~dmscale.tasks.distill.kept_hidden_channels`), which are returned."""
    (_, h_s), (_, h_t) = _on_example(ctx.example, ctx.task.forward_hidden, model, teacher)
    d_s, d_t = h_s[-1].shape[-1], h_t[-1].shape[-1]
    if d_s == d_t:
        return None
    found = kept_hidden_channels(model, structure)
    if found is None:
        why = ("no structure says which of the teacher's channels the model kept"
               if structure is None else
               "the run's structure.json does not record which hidden channels the model kept")
    elif found[1] != d_t:
        why = (f"the run's structure.json keeps {len(found[0])} of a supernet's {found[1]} hidden "
               f"channels, not of the teacher's {d_t}")
    elif len(found[0]) != d_s or max(found[0], default=-1) >= d_t:
        why = (f"the run's structure.json keeps {len(found[0])} hidden channels, the model "
               f"has {d_s}")
    else:
        return found[0]
    raise ConfigError(
        f"--distill-hidden: the model's hidden size {d_s} differs from the teacher's {d_t} "
        f"and {why}, so their hidden states cannot be compared: distil from the model the "
        "search started from (--teacher supernet in the run that searched, or a teacher "
        "of the supernet's hidden size), keep the hidden size (--exclude "
        "lm.model.embed_tokens for an hf: model) or use --distill-hidden 0")
