"""What every hook dmscale attaches has in common: its base class (so that
:func:`dmscale.masks.detach` finds it by type) and where a layer's input is.

Example:
    >>> import torch
    >>> first_input((torch.zeros(2),), {})[0], first_input((), {"input": torch.zeros(2)})[0]
    (0, 'input')
"""

from __future__ import annotations

import torch

__all__ = ["DMSHook", "first_input"]


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
