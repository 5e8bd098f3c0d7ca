"""``dmscale inspect --memory``: the per-rank memory of the search a command line describes,
before launching it.

:func:`inspect_memory` builds the model of ``cfg`` as ``dmscale search`` would, prepares it,
and hands it to :func:`dmscale.engine.memory.estimate_search_memory` with the run's world
size, ``--shard``, ``--precision``, optimiser (``--optimizer``; pipeline ``p-`` trains no
weights), distillation teacher (``--teacher``; ``supernet`` counts a copy of the model) and the
per-rank batch (``--batch-size`` divided by the world size, as the step loop splits it), whose
forward, losses and backward pass are traced under ``FakeTensorMode`` (no data, no memory).
The estimate is for a GPU (multi-tensor optimiser temporaries) unless ``--device cpu``.

A ``--model hf:PATH`` is never loaded: it is built from its ``config.json`` on the ``meta``
device (:func:`dmscale.tasks.hf_meta.meta_hf_model`: no weights read, so a 70 B model is
planned in seconds on a laptop; a directory holding only ``config.json`` will do, or
``hf:DIR/config.json``), prepared there (``dms.prepare`` traces shapes: the gates are those
of the loaded model) and traced on random token ids of ``--seq-len``, without the tokenizer
or ``--data``. The numbers are those of the loaded model; the table's notes say how it was
built.

Example:
    >>> from dmscale.config.run_config import RunConfig
    >>> cfg = RunConfig(command="search", task="digits", model="smallcnn",
    ...                 model_args={"width": 4, "blocks": 1}, train_limit=64, test_limit=32, batch_size=8)
    >>> est = inspect_memory(cfg, world_size=2)
    >>> est.world_size, est.optimizer, est.activations > 0
    (2, 'sgd', True)
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

import dmscale as dms
from dmscale.config.run_config import ConfigError, RunConfig
from dmscale.engine.memory import MemoryEstimate, estimate_search_memory
from dmscale.run.saved_runs import load_teacher, make_searcher
from dmscale.tasks.distill import Distillation
from dmscale.tasks.hf_meta import ShapeTextTask, config_path, meta_hf_model
from dmscale.tasks.hf_model import is_hf_model, parse_hf_spec
from dmscale.tasks.registry import Task, build_model, build_task

__all__ = ["inspect_memory"]


def inspect_memory(cfg: RunConfig, world_size: int = 1, load: bool = False) -> MemoryEstimate:
    """The per-rank memory estimate of the search ``cfg`` describes, on ``world_size`` ranks.

    ``load=True`` loads an ``hf:`` model with its weights, tokenizer and data as ``dmscale
    search`` does, instead of building it on the meta device (the same numbers, for checking).
    """
    if world_size < 1:
        raise ConfigError(f"--world-size must be >= 1, got {world_size}")
    cfg = cfg.resolved()
    per_rank = cfg.batch_size // world_size
    if per_rank < 1:
        raise ConfigError(f"--batch-size {cfg.batch_size} is split over {world_size} ranks: "
                          f"expected at least one example per rank")
    built: str | None = None
    if is_hf_model(cfg.model) and not load:
        task, model, built = _meta_hf(cfg)
        exclude: list[str] = []
    else:
        task = build_task(cfg)
        model, exclude = build_model(cfg, task.info)
    make_searcher(cfg, model, task.example_inputs(), exclude)  # attaches the gates to model (the plan's subject)
    try:
        teacher: nn.Module | None = None
        if cfg.teacher and cfg.distills:
            teacher = (None if cfg.teacher == "supernet" else load_teacher(cfg.teacher, torch.device("cpu")))
        x, y = task.train_batch(0, per_rank, cfg.seed)

        def forward_loss(m: nn.Module) -> torch.Tensor:
            if not cfg.teacher or not cfg.distills:
                return task.task_loss(task.forward(m, x), y)
            distill = Distillation.from_config(teacher if teacher is not None else m, cfg)
            logits, terms = distill(task, m, x)
            return task.task_loss(logits, y) + sum(w * v for _, w, v in terms)

        est = estimate_search_memory(
            model, forward_loss, world_size=world_size, shard=cfg.shard, precision=cfg.precision,
            optimizer=cfg.optimizer, train_weights=cfg.pipeline != "p-",
            teacher=model if cfg.teacher == "supernet" and cfg.distills else teacher,  # supernet: a copy of it
            device="cpu" if str(cfg.device) == "cpu" else "cuda")
        return est if built is None else replace(est, notes=(built, *est.notes))
    finally:
        dms.detach(model)


def _meta_hf(cfg: RunConfig) -> tuple[Task, nn.Module, str]:
    """``(task, model, note)`` of an ``hf:`` model built from its config on the meta device."""
    path = parse_hf_spec(cfg.model) or ""
    if cfg.task != "text":
        raise ConfigError(f"--model {cfg.model} does not fit task {cfg.task!r}: a pretrained "
                          "--model hf:PATH goes with --task text (its own tokenizer)")
    if cfg.expand:
        raise ConfigError(f"--expand enlarges the built-in models only, not the pretrained --model {cfg.model}")
    model, config = meta_hf_model(path, cfg.model_args)
    where = Path(config_path(path)).expanduser()
    where = where / "config.json" if where.is_dir() else where
    note = (f"built from {where} on the meta device, without its weights (shapes only: nothing "
            "loaded, nothing allocated); prepared there, so the gates are counted exactly")
    return ShapeTextTask(int(cfg.seq_len), int(config.vocab_size)), model, note
