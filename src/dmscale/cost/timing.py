"""Timing a module or a call on its device: a low quantile of single calls.

Part of the latency constraint (:mod:`dmscale.cost.latency`): on a busy machine pauses only ever
add time, so a low quantile of many single calls is the most stable estimate.

Example:
    >>> import torch
    >>> from torch import nn
    >>> t = measure_latency(nn.Linear(8, 8), torch.randn(4, 8), repeats=5, warmup=1)
    >>> t > 0
    True
"""

from __future__ import annotations

import itertools
import math
import time
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from dmscale.core.errors import ConfigError
from dmscale.trace.values import split_inputs

__all__ = ["measure_latency"]


# ---------------------------------------------------------------------- timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_block(fn: Callable[[], Any], n: int, device: torch.device) -> float:
    """Seconds per call of ``n`` back-to-back calls of ``fn``."""
    _sync(device)
    start = time.perf_counter()
    for _ in range(n):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / n


def measure_latency(module: nn.Module | Callable[..., Any], example_inputs: Any, repeats: int = 30,
                    warmup: int = 3, quantile: float = 0.1, min_block_s: float = 5e-5) -> float:
    """Latency in **seconds** of one call ``module(*inputs)`` (no grad): a quantile of timings.

    ``repeats`` samples are timed one call each (calls shorter than ``min_block_s`` are
    repeated back to back and averaged, to stay above the timer's resolution); the result is
    their ``quantile`` (default 0.1, the statistic :class:`LatencyCostModel` uses; 0.5 is the
    median). Pauses of a busy machine (the scheduler taking a core away) only ever add time;
    single-call samples keep them out of most samples, where a long block would average them
    in, and a low quantile ignores the samples they hit. The caller chooses eval/train mode
    and ``torch.set_num_threads``.

    Example:
        >>> import torch
        >>> measure_latency(torch.nn.Linear(8, 8), torch.randn(1, 8), repeats=3) > 0
        True
    """
    if repeats < 1 or warmup < 0 or not 0.0 <= quantile <= 1.0:
        raise ConfigError(f"need repeats >= 1, warmup >= 0, 0 <= quantile <= 1; got repeats={repeats}, "
                          f"warmup={warmup}, quantile={quantile}")
    args, kwargs = split_inputs(example_inputs)
    device = _device_of(module, args, kwargs)
    call = lambda: module(*args, **kwargs)  # noqa: E731
    with torch.no_grad():
        for _ in range(warmup):
            call()
        t1 = _time_block(call, 1, device)
        n = _calls_per_block(t1, min_block_s)
        times = [t1] if n == 1 else []
        times += [_time_block(call, n, device) for _ in range(repeats - len(times))]
    return float(np.quantile(times, quantile))


def _calls_per_block(t1: float, min_block_s: float) -> int:
    return int(min(10_000, max(1, math.ceil(min_block_s / max(t1, 1e-9)))))


def _device_of(module: Any, args: tuple, kwargs: dict) -> torch.device:
    if isinstance(module, nn.Module):
        for p in itertools.chain(module.parameters(), module.buffers()):
            return p.device
    for t in list(args) + list(kwargs.values()):
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")
