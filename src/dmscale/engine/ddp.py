"""The step loop under ``torchrun``: process group, DDP wrapping, and the few decisions every
rank must take together.

``torchrun --nproc_per_node N -m dmscale search ...`` starts N processes with ``WORLD_SIZE``,
``RANK`` and ``LOCAL_RANK`` in their environment. :func:`process_group` then initialises
torch.distributed once (gloo on CPU, NCCL on CUDA with ``cuda:LOCAL_RANK``) and destroys it
at exit; without ``WORLD_SIZE > 1`` it does nothing and every helper here is a no-op, so one
code path serves one process and many.

What must be the same on every rank, or the ranks deadlock or drift apart:

* :func:`any_rank`: a step is skipped (non-finite loss) or a run stops (SIGINT / SIGTERM)
  when *any* rank asks; :func:`agreed_signal` gives every rank the same signal number;
* :func:`on_all_ranks`: setup (validation of the run directory, ``--resume`` checks) runs
  on every rank before any rank writes; one rank's error becomes every rank's error;
* :func:`from_rank0`: a value only rank 0 may choose (the default run directory's name);
* :func:`barrier`: rank 0 has written what the other ranks read next.

Example (one process: every helper passes through):
    >>> import torch
    >>> any_rank(False), agreed_signal(None), mean_over_ranks([1.0, 2.0]), from_rank0("runs/a")
    (False, None, [1.0, 2.0], 'runs/a')
    >>> m = torch.nn.Linear(2, 2)
    >>> wrap_model(m, torch.device("cpu")) is m
    True
"""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from typing import Any, Callable, Iterator, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from dmscale.core.distributed import is_distributed, rank, world_size
from dmscale.core.errors import ConfigError, DMScaleError
from dmscale.engine.device import resolve_device
from dmscale.engine.fsdp import sharded

__all__ = ["agreed_signal", "any_rank", "barrier", "check_task_for_ranks", "from_rank0", "launched", "local_rank",
           "main_rank_env", "mean_over_ranks", "on_all_ranks", "process_group", "shard_of_this_rank",
           "wrap_model"]

T = TypeVar("T")
TIMEOUT = timedelta(minutes=30)  # a rank waiting this long for the others fails with an error


def launched() -> bool:
    """True when a launcher (``torchrun``) started this process as one of several."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def local_rank() -> int:
    """This process's rank on its node (``LOCAL_RANK``); 0 without a launcher."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def main_rank_env() -> bool:
    """True on global rank 0 by the launcher's environment (valid before and after the
    process group exists): the process that prints."""
    return int(os.environ.get("RANK", "0")) == 0


@contextlib.contextmanager
def process_group(device_name: str) -> Iterator[None]:
    """Initialise torch.distributed for a ``torchrun`` job inside the block, destroy it after.

    Does nothing in one process, or when the caller already initialised a process group.

    Raises:
        ConfigError: ``--device cuda`` (or ``auto`` with CUDA) with fewer GPUs on this node
            than processes (from :func:`dmscale.engine.device.resolve_device`).
    """
    if not launched() or (dist.is_available() and dist.is_initialized()):
        yield
        return
    device = resolve_device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=TIMEOUT, device_id=device)
    else:
        dist.init_process_group("gloo", timeout=TIMEOUT)
    try:
        yield
    finally:
        _leave_together()
        dist.destroy_process_group()


def _leave_together(timeout_s: float = 60.0) -> None:
    """Wait for every rank before the process group is destroyed: a rank that tears gloo down
    while another still talks to it aborts at exit ("terminate called without an active
    exception", seen on 1 run in 4 stopped with --stop-after). A rank that crashed makes the
    wait time out after ``timeout_s``; that is ignored (the crash is the error to report)."""
    try:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timedelta(seconds=timeout_s))
        else:
            dist.barrier()
    except Exception:  # a peer is gone: nothing to wait for
        pass


def wrap_model(model: nn.Module, device: torch.device) -> nn.Module:
    """``model`` in DistributedDataParallel when more than one process runs; else ``model``.

    The gates of a search are submodules of the model, so DDP averages the gradients of the
    structural parameters with the weights'. Parameters with ``requires_grad=False`` when it
    is built (the weights in ``p-``, depth's ``a`` once frozen) are left out: wrap again when
    that changes (the step loop does), so every parameter DDP holds gets a gradient in every
    step and ``find_unused_parameters`` (an extra graph traversal per step, and a warning from
    torch on every rank when none is unused) is not needed. A model sharded with FSDP
    (:func:`dmscale.engine.fsdp.shard_model`) is returned as it is.
    """
    if not is_distributed() or sharded(model) is not None:
        return model
    ids = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids)


def _device() -> torch.device:
    """Where collectives of small tensors run: CUDA for NCCL, CPU for gloo."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _max(value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is True on at least one (one collective)."""
    return bool(_max(int(flag))) if is_distributed() else flag


def agreed_signal(received: int | None) -> int | None:
    """The (largest) signal number any rank received, on every rank; None when none did."""
    if not is_distributed():
        return received
    got = _max(received or 0)
    return got or None


def mean_over_ranks(values: list[float]) -> list[float]:
    """The mean of each value over the ranks (for logging the global batch's loss)."""
    if not is_distributed():
        return values
    t = torch.tensor(values, dtype=torch.float64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return (t / world_size()).tolist()


def barrier() -> None:
    """Wait until every rank gets here (rank 0 has written what the others read next)."""
    if is_distributed():
        dist.barrier()


def from_rank0(value: T) -> T:
    """Rank 0's ``value`` on every rank."""
    if not is_distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def on_all_ranks(fn: Callable[[], T]) -> T:
    """Run ``fn`` on every rank; when it raises on any rank, raise on every rank.

    A rank whose own ``fn`` raised re-raises its error; the others raise a
    :class:`ConfigError` (or :class:`DMScaleError`) naming the first failing rank and its
    message. No rank goes on to a collective the others will never reach.
    """
    try:
        result, error = fn(), None
    except Exception as err:  # re-raised below, after the other ranks heard of it
        result, error = None, err
    if not is_distributed():
        if error is not None:
            raise error
        return result  # type: ignore[return-value]
    told: list[Any] = [None] * world_size()
    mine = None if error is None else (isinstance(error, ConfigError), f"{type(error).__name__}: {error}")
    dist.all_gather_object(told, mine)
    if error is not None:
        raise error
    failed = [(r, m) for r, m in enumerate(told) if m is not None]
    if failed:
        r, (config, text) = failed[0]
        kind = ConfigError if config else DMScaleError
        raise kind(f"rank {r} of {world_size()} failed: {text}")
    return result  # type: ignore[return-value]


def shard_of_this_rank(batch: T) -> T:
    """This rank's equal share of a global batch (the whole batch in one process)."""
    from dmscale.core.distributed import shard

    return shard(batch, rank(), world_size()) if is_distributed() else batch


def check_task_for_ranks(task: Any) -> None:
    """Refuse a task whose batches cannot be split by rank (detection: its targets are rows
    of boxes, not one row per image) when more than one process runs."""
    if is_distributed() and getattr(task, "kind", "") == "detection":
        raise ConfigError(f"detection tasks do not run under torchrun yet ({world_size()} processes): "
                          "their targets cannot be split by rank; run them as one process")
