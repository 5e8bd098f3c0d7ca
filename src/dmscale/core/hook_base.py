"""What every hook dmscale attaches has in common: its base class (so that
:func:`dmscale.core.hook_attach.detach` finds it by type), where a layer's input is, and a channel mask
multiplied along one dim of a tensor or into a layer's input.

Example:
    >>> import torch
    >>> first_input((torch.zeros(2),), {})[0], first_input((), {"input": torch.zeros(2)})[0]
    (0, 'input')
    >>> args = (torch.ones(3, 2),)
    >>> masked_input(args, {}, first_input(args, {}), torch.tensor([1.0, 0.0]), dim=-1)[0][0][0].tolist()
    [1.0, 0.0]
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

__all__ = ["DMSHook", "MaskSource", "cast", "first_input", "along", "masked_input"]


class MaskSource(Protocol):
    """What a hook reads from the gates of a search (:class:`dmscale.core.masks.Gates`): kept here,
    below both, so the hooks know the gates only by this protocol."""

    enabled: bool
    forward_masks: Any  # the per-forward mask store (dmscale.core.forward_masks.ForwardMasks)

    def compute(self) -> None: ...

    def channel_mask(self, key: str) -> torch.Tensor: ...

    def norm_weights(self, key: str) -> torch.Tensor: ...

    def depth_unit(self, j: int, block: int) -> torch.Tensor: ...

    def depth_value(self, read: int) -> torch.Tensor: ...


class DMSHook:
    """Base class of every hook dmscale attaches (so that :func:`detach` finds them)."""


def first_input(args: tuple, kwargs: dict) -> tuple[int | str, torch.Tensor] | None:
    """Where a layer's input is: ``(0, args[0])``, or ``(name, kwargs[name])`` for the first
    tensor keyword when it is called with keywords only (``fc(input=h)``); the tracer reads
    the same input (see :meth:`dmscale.trace.tracer.Tracer._opaque_call`)."""
    if args:
        return (0, args[0]) if isinstance(args[0], torch.Tensor) else None
    for key, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            return key, value
    return None


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``; ``t`` itself when it already is (no ``aten::to`` call: the hooks
    run once per layer per forward, and every call is a dispatch on the host)."""
    return t if t.dtype == dtype else t.to(dtype)


def along(x: torch.Tensor, m: torch.Tensor, dim: int) -> torch.Tensor:
    """``x * m`` with the (C,) mask ``m`` along dim ``dim`` of ``x`` (1xCx1x1 for a conv's
    (B, C, H, W) at dim 1, C for the last dim), in ``x``'s dtype."""
    shape = [1] * x.dim()
    shape[dim % x.dim()] = m.numel()
    return x * cast(m.view(shape), x.dtype)


def masked_input(args: tuple, kwargs: dict, found: tuple[int | str, torch.Tensor], m: torch.Tensor,
                 dim: int) -> tuple[tuple, dict]:
    """A forward pre-hook's result that multiplies the layer's input ``found`` (what
    :func:`first_input` returned for ``args``, ``kwargs``) by the channel mask ``m`` along
    ``dim`` (paper A.1.1)."""
    where, x = found
    masked = along(x, m, dim)
    if where == 0:
        return (masked,) + tuple(args[1:]), kwargs
    return args, {**kwargs, where: masked}
