"""A DMS search run by one rank of a DDP job (or by one process on the whole batch).

Used by ``test_distributed.py``: it spawns two CPU processes (gloo) that each call
:func:`worker`, and compares what they save with :func:`search` run in one process.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import dmscale as dms
from dmscale.core.distributed import shard
from torchrun_util import leaving_process_group

STEPS, BATCH, CLASSES = 4, 8, 4


class Block(nn.Module):
    """A residual block (searchable depth) with a searchable inner width."""

    def __init__(self, width: int, bn: bool) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.Conv2d(width, 2 * width, 3, padding=1),
                               nn.BatchNorm2d(2 * width) if bn else nn.Identity(), nn.ReLU(),
                               nn.Conv2d(2 * width, width, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.f(x)


def build(bn: bool) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8) if bn else nn.Identity(),
                         nn.ReLU(), Block(8, bn), Block(8, bn), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, CLASSES))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same global batches on every rank and in the single process."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 3, 8, 8, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g))
            for _ in range(STEPS)]


def search(bn: bool = False, rank: int = 0, world: int = 1, sync: bool = True,
           scaled: bool = False, width_only: bool = False, settle: float = 0.0) -> dict[str, Any]:
    """``STEPS`` search steps; under DDP when ``world > 1`` (each rank on its shard).

    ``sync=False`` never calls ``sync_importance()`` in the loop (the next forward applies
    the pending updates); ``scaled`` runs the backward through a GradScaler; ``width_only``
    freezes depth halfway (``width_only_from``: DDP then needs ``find_unused_parameters``);
    ``settle`` > 0 runs the settle phase over the last steps (depth frozen as well, the band
    loss, the structural lr annealed by ``structure_lr_scale``).
    """
    model = build(bn)
    x0 = torch.randn(2, 3, 8, 8)
    searcher = dms.prepare(model, x0, dms.SearchConfig(resource="macs", target=0.4, settle=settle,
                                                      width_only_from=0.5 if width_only else None))
    net = nn.parallel.DistributedDataParallel(model, find_unused_parameters=width_only or settle > 0) \
        if world > 1 else model
    opt_w = torch.optim.AdamW(searcher.model_parameters(), lr=1e-2)
    opt_a = torch.optim.Adam(searcher.structure_parameters(), lr=5e-2, weight_decay=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if scaled else None
    if scaler is not None:
        searcher.use_grad_scaler(scaler)
    pending_error = None
    for step, (x, y) in enumerate(batches()):
        xs, ys = shard((x, y), rank, world)
        for group in opt_a.param_groups:
            group["lr"] = 5e-2 * searcher.structure_lr_scale((step + 1) / STEPS)
        loss = F.cross_entropy(net(xs), ys) + searcher.resource_loss(progress=(step + 1) / STEPS)
        opt_w.zero_grad(), opt_a.zero_grad()
        if scaler is None:
            loss.backward()
        else:
            scaler.scale(loss).backward()
        if sync:
            searcher.sync_importance()
        elif step == STEPS - 1:  # forgotten on the last step: reads must refuse, not start a collective
            try:
                searcher.structure()
            except dms.DMScaleError as err:
                pending_error = type(err).__name__
            searcher.sync_importance()
        if scaler is None:
            opt_w.step(), opt_a.step()
        else:
            scaler.step(opt_w), scaler.step(opt_a), scaler.update()
    return _result(searcher, x0, pending_error)


def _gates(searcher: dms.Searcher) -> list[Any]:
    return list(searcher.gates.width) + list(searcher.gates.depth)


def _result(searcher: dms.Searcher, x0: torch.Tensor, pending_error: str | None) -> dict[str, Any]:
    structure = searcher.structure()
    small = searcher.export()
    return {
        "a": torch.stack([t.a.detach().clone() for t in _gates(searcher)]),
        "importance": [t.importance.clone() for t in _gates(searcher)],
        "width": [(d["name"], d["kept"]) for d in structure["width"]],
        "depth": [(d["name"], d["kept"]) for d in structure["depth"]],
        "layers": {n: (s["in"], s["out"]) for n, s in structure["layers"].items()},
        "shapes": {n: tuple(p.shape) for n, p in small.named_parameters()},
        "hard": searcher.resources()["hard"],
        "pending_error": pending_error,
    }


def nonfinite_step(rank: int, world: int) -> dict[str, Any]:
    """One backward where only rank 1's shard is non-finite: importance must stay untouched
    on every rank (the averaged gradient is non-finite everywhere)."""
    model = build(False)
    searcher = dms.prepare(model, torch.randn(2, 3, 8, 8), dms.SearchConfig(target=0.4))
    net = nn.parallel.DistributedDataParallel(model)
    for x, y in batches()[:2]:
        xs, ys = shard((x, y), rank, world)
        F.cross_entropy(net(xs), ys).backward()
        searcher.sync_importance()
    before = [t.importance.clone() for t in searcher.gates.width]
    xs, ys = shard(batches()[2], rank, world)
    if rank == 1:
        xs = xs.clone()
        xs[0, 0, 0, 0] = float("inf")
    F.cross_entropy(net(xs), ys).backward()
    applied = searcher.sync_importance()
    after = [t.importance.clone() for t in searcher.gates.width]
    return {"applied": applied, "unchanged": all(torch.equal(b, a) for b, a in zip(before, after)),
            "after": after}


def worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """Entry point of one spawned rank: every case, results saved to ``out_dir/rank{r}.pt``."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    with leaving_process_group():
        results = {"plain": search(False, rank, world), "bn": search(True, rank, world),
                   "forgot": search(False, rank, world, sync=False),
                   "scaled": search(False, rank, world, scaled=True),
                   "width_only": search(False, rank, world, width_only=True),
                   "settle": search(False, rank, world, settle=0.5),
                   "nonfinite": nonfinite_step(rank, world)}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
