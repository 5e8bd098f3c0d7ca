"""What the phases of a run train with: the weights' optimiser and schedule, the step loop
of one phase, ``--shard fsdp`` and the re-estimated BatchNorm statistics of an export.

Every function takes the run's :class:`~dmscale.run.context.RunContext` (or the plain values
it uses) as an argument; nothing here keeps state between calls.

Example:
    >>> import torch
    >>> from types import SimpleNamespace
    >>> cfg = SimpleNamespace(optimizer="sgd", lr=0.1, weight_decay=0.0, warmup=0.0)
    >>> opt = weight_optimizer(cfg, [torch.nn.Parameter(torch.zeros(1))])
    >>> sched = cosine_schedule(cfg, opt, total=4)
    >>> [round(f(k), 3) for f in sched.lr_lambdas for k in range(5)]
    [1.0, 0.854, 0.5, 0.146, 0.0]
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import nn

import dmscale as dms

from dmscale.core.distributed import all_reduce_mean
from dmscale.engine.fsdp import shard_frozen, shard_model
from dmscale.engine.loop import StepLoop
from dmscale.run.context import RunContext
from dmscale.run.phase_list import PHASE_SEED
from dmscale.search.search_trace import SearchTrace
from dmscale.tasks.registry import Distillation, Task

__all__ = ["BN_CALIBRATION_BATCHES", "calibrate_on_task", "cosine_schedule", "shard", "train",
           "weight_optimizer"]

BN_CALIBRATION_BATCHES = 20  # batches that re-estimate BatchNorm statistics of the export


def weight_optimizer(cfg: Any, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """The weights' optimiser of ``--optimizer``: SGD (Nesterov momentum 0.9) or AdamW."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=0.9, nesterov=True, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def cosine_schedule(cfg: Any, opt: torch.optim.Optimizer, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``--warmup`` x ``total`` steps, then cosine decay to 0 at ``total``."""
    warm = max(1, int(round(cfg.warmup * total))) if cfg.warmup > 0 else 0

    def factor(step: int) -> float:
        w = min(1.0, (step + 1) / warm) if warm else 1.0
        return w * 0.5 * (1.0 + math.cos(math.pi * min(step, total) / max(1, total)))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def train(ctx: RunContext, phase: str, model: nn.Module, total: int,
          optimizers: list[torch.optim.Optimizer], schedulers: list[Any],
          searcher: dms.Searcher | None = None, teacher: nn.Module | None = None,
          until: Callable[[], bool] | None = None, teacher_channels: list[int] | None = None) -> None:
    """Train ``model`` for ``total`` steps of ``phase``, resuming from the run's checkpoint;
    ``teacher_channels``: the teacher's hidden channels ``model`` kept (an export whose
    hidden size was pruned), compared by ``--distill-hidden``."""
    cfg = ctx.cfg
    distill = Distillation.from_config(teacher, cfg, teacher_channels) if teacher is not None else None
    traced = searcher is not None and cfg.search_trace
    StepLoop(ctx, phase, model, total, optimizers, schedulers, searcher=searcher, distill=distill, until=until,
             trace=SearchTrace(searcher, ctx.rd.path, ctx.rd.writes) if traced else None,
             seed=cfg.seed * 10 + PHASE_SEED[phase]).run()


def shard(cfg: Any, model: nn.Module, searcher: dms.Searcher | None = None,
          teacher: nn.Module | None = None) -> None:
    """``--shard fsdp``: shard ``model`` in place, before its optimisers are built
    (:func:`~dmscale.engine.fsdp.shard_model`; in one process there is nothing to shard),
    and the frozen ``teacher`` (:func:`~dmscale.engine.fsdp.shard_frozen`, once per run).
    Under ``--precision bf16`` the model's weights are gathered in bfloat16 and the
    teacher's stored in bfloat16 (not for models with BatchNorm layers)."""
    if cfg.shard == "fsdp":
        dtype = torch.bfloat16 if cfg.precision == "bf16" else None
        shard_model(model, space=searcher.space if searcher is not None else None, param_dtype=dtype)
        if teacher is not None:
            shard_frozen(teacher, param_dtype=dtype)


def calibrate_on_task(model: nn.Module, task: Task, batch_size: int, seed: int,
                      device: torch.device | str = "cpu", n_batches: int = BN_CALIBRATION_BATCHES) -> int:
    """Re-estimate the running statistics of every BatchNorm layer of ``model`` on training
    batches (no gradients, weights untouched); returns the number of layers.

    The statistics a supernet collects during the search are those of soft masks (channels
    scaled by 0.5 - 0.9, blocks partly on); the exported model computes hard-masked
    activations, so its inherited running statistics are off until re-estimated.

    Under torchrun a task that loads only this rank's share of each batch
    (``task.shards_by_rank``) gives every rank the statistics of its shares; they are then
    averaged over the ranks (the means are the global batches' means), so every rank holds
    the same statistics.
    """
    def batches():
        for step in range(n_batches):
            x, _ = task.train_batch(step, batch_size, seed)
            yield x.to(device)

    with torch.random.fork_rng(devices=[]):
        n = dms.recalibrate_batchnorm(model, batches(), forward=task.forward)
    if getattr(task, "shards_by_rank", False):
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
                all_reduce_mean(m.running_mean)
                all_reduce_mean(m.running_var)
    return n
