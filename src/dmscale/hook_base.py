"""What every hook dmscale attaches has in common: its base class (so that
:func:`dmscale.masks.detach` finds it by type) and where a layer's input is.

Example:
    >>> import torch
    >>> first_input((torch.zeros(2),), {})[0], first_input((), {"input": torch.zeros(2)})[0]
    (0, 'input')
"""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["DMSHook", "MaskSource", "first_input"]


class MaskSource(Protocol):
    """What a hook reads from the gates of a search (:class:`dmscale.masks.Gates`): kept here,
    below both, so the hooks know the gates only by this protocol."""

    enabled: bool

    def compute(self) -> None: ...

    def channel_mask(self, key: str) -> torch.Tensor: ...

    def depth_mask(self, j: int) -> torch.Tensor: ...


class DMSHook:
    """Base class of every hook dmscale attaches (so that :func:`detach` finds them)."""


def first_input(args: tuple, kwargs: dict) -> tuple[int | str, torch.Tensor] | None:
    """Where a layer's input is: ``(0, args[0])``, or ``(name, kwargs[name])`` for the first
    tensor keyword when it is called with keywords only (``fc(input=h)``); the tracer reads
    the same input (see :meth:`dmscale.tracer.Tracer._opaque_call`)."""
    if args:
        return (0, args[0]) if isinstance(args[0], torch.Tensor) else None
    for key, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            return key, value
    return None
