"""Switch a model to eval or train mode for a moment and give every module its own mode back.

``model.eval()`` followed by ``model.train(was_training)`` is not a restore: it sets *every*
module to the root's flag, so a BatchNorm the user froze (``bn.eval()`` inside a training
model) would come back in training mode. These context managers record each module's flag
and restore it.

Example:
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)).train()
    >>> _ = net[1].eval()  # a frozen norm
    >>> with eval_mode(net):
    ...     net.training, net[1].training
    (False, False)
    >>> net.training, net[1].training
    (True, False)
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn

__all__ = ["eval_mode", "train_mode", "module_modes", "restore_modes"]


def module_modes(model: nn.Module) -> dict[nn.Module, bool]:
    """Every module's own ``training`` flag."""
    return {m: m.training for m in model.modules()}


def restore_modes(modes: dict[nn.Module, bool]) -> None:
    """Set each module's ``training`` flag back (no ``train()`` recursion)."""
    for m, flag in modes.items():
        m.training = flag


@contextlib.contextmanager
def _switched(model: nn.Module, training: bool) -> Iterator[nn.Module]:
    modes = module_modes(model)
    model.train(training)
    try:
        yield model
    finally:
        restore_modes(modes)


def eval_mode(model: nn.Module) -> contextlib.AbstractContextManager[nn.Module]:
    """``model.eval()`` for the block, then every module's own mode again."""
    return _switched(model, False)


def train_mode(model: nn.Module) -> contextlib.AbstractContextManager[nn.Module]:
    """``model.train()`` for the block, then every module's own mode again."""
    return _switched(model, True)
