"""torch.distributed helpers: who am I, my shard of a global batch, a mean all-reduce.

Every helper works without a process group (one process: world size 1, rank 0), so the same
training loop runs under ``python`` and under ``torchrun``. The all-reduce uses only
``ReduceOp.SUM`` (``AVG`` exists for NCCL only), so it runs on gloo (CPU) and NCCL alike.

Data parallelism with DMS: each rank's loss is the mean over its shard of B / world samples,
so the mean of the ranks' gradients is the gradient of the global batch of B. That is what
DDP does for the weights and what :meth:`dmscale.Searcher.sync_importance` does for the
gradients of the masks, before the Taylor importance (paper Eq. 4) is updated.

Example:
    >>> import torch
    >>> from dmscale.core.distributed import world_size, rank, is_main_process, shard, all_reduce_mean
    >>> world_size(), rank(), is_main_process()   # no process group: one process
    (1, 0, True)
    >>> x, y = torch.arange(8).view(4, 2), torch.arange(4)
    >>> xs, ys = shard((x, y), rank=1, world=2)    # rank 1's half of the global batch
    >>> xs.tolist(), ys.tolist()
    ([[4, 5], [6, 7]], [2, 3])
    >>> shard(range(6), rank=0, world=3)           # indices of a sampler
    range(0, 2)
    >>> all_reduce_mean(torch.tensor([1.0, 3.0])).tolist()   # world size 1: unchanged
    [1.0, 3.0]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from dmscale.core.errors import ConfigError

__all__ = ["world_size", "rank", "is_main_process", "is_distributed", "shard", "all_reduce_mean"]

T = TypeVar("T")


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size(group: Any = None) -> int:
    """Processes in ``group`` (default: the default group); 1 without a process group."""
    return dist.get_world_size(group) if _initialized() else 1


def rank(group: Any = None) -> int:
    """This process's rank in ``group`` (default: the default group); 0 without one."""
    return dist.get_rank(group) if _initialized() else 0


def is_main_process() -> bool:
    """True on global rank 0 (and in a single process): the one that logs and saves."""
    return rank() == 0


def is_distributed(group: Any = None) -> bool:
    """True when a process group is initialised and ``group`` has more than one process.

    ``group=False`` means "never synchronise" and always gives False.
    """
    if group is False:
        return False
    return world_size(group) > 1


def shard(batch: T, rank: int, world: int) -> T:
    """Rank ``rank``'s equal share of a global batch of B samples (B / world of them).

    ``batch`` may be a tensor or numpy array (split along dim 0), a tuple of such (each one
    split: ``(inputs, targets)``), a dict of such (keyword inputs), or a list / range of
    sample indices (sliced). Shard ``r`` holds samples ``r * B/world`` to ``(r+1) * B/world``.

    Raises:
        ValueError: ``world < 1``, ``rank`` outside ``[0, world)``, or a batch size that
            ``world`` does not divide (every rank must see the same number of samples, or
            the mean of the ranks' gradients is not the global batch's gradient).
    """
    if world < 1:
        raise ConfigError(f"world size must be >= 1, got {world}")
    if not 0 <= rank < world:
        raise ConfigError(f"rank must be in [0, {world}) for world size {world}, got {rank}")
    if isinstance(batch, Mapping):
        return type(batch)({k: shard(v, rank, world) for k, v in batch.items()})  # type: ignore[return-value]
    if isinstance(batch, tuple) and not hasattr(batch, "_fields"):
        return tuple(shard(v, rank, world) for v in batch)  # type: ignore[return-value]
    if not hasattr(batch, "__len__") or not hasattr(batch, "__getitem__"):
        raise TypeError(f"cannot shard a {type(batch).__name__}: pass a tensor, an array, a tuple "
                        "or dict of them, or a list/range of sample indices")
    size = len(batch)
    if size % world:
        raise ConfigError(
            f"global batch size {size} is not divisible by world size {world}: every rank needs "
            f"the same number of samples; use a global batch size that is a multiple of {world} "
            f"(e.g. {size - size % world or world})")
    per = size // world
    return batch[rank * per:(rank + 1) * per]  # type: ignore[index]


def all_reduce_mean(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Average ``tensor`` over the ranks of ``group`` in place and return it.

    One collective (``SUM``, then a division: works on gloo and NCCL). Without a process
    group, or with ``group=False``, the tensor is returned unchanged. Every rank must call
    it with a tensor of the same shape and dtype.
    """
    if not is_distributed(group):
        return tensor
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor.div_(world_size(group))
