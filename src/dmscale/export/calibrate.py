"""Re-estimate BatchNorm statistics of an exported model.

A supernet collects BatchNorm running statistics under *soft* masks (channels scaled by
0.5 - 0.9, blocks partly on); the exported model computes the hard-masked activations, so its
inherited statistics are off until re-estimated on a few training batches. Weights are not
touched and no gradient is computed.

Example:
    >>> import torch
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
    >>> recalibrate_batchnorm(net, [torch.randn(16, 4) + 3.0 for _ in range(4)])
    1
    >>> bool(net[1].running_mean.abs().sum() > 0)
    True
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

from dmscale.core.modes import train_mode

__all__ = ["recalibrate_batchnorm"]


def recalibrate_batchnorm(model: nn.Module, batches: Iterable[Any],
                          forward: Callable[[nn.Module, Any], Any] | None = None) -> int:
    """Reset every tracking BatchNorm of ``model`` and average its statistics over
    ``batches`` (cumulative average, train-mode BN, no grad); returns how many layers.

    ``forward(model, batch)`` runs one batch (default: ``model(batch)``). The model's
    training flag and the layers' momenta are restored, also on error.
    """
    norms = [m for m in model.modules()
             if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    if not norms:
        return 0
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # cumulative average over the calibration batches
    run = forward or (lambda mod, b: mod(b))
    try:
        with torch.no_grad(), train_mode(model):
            for batch in batches:
                run(model, batch)
    finally:
        for m, mom in zip(norms, momenta):
            m.momentum = mom
    return len(norms)
