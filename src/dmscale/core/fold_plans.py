"""How a mask folds into a layer's weight, and which layers can take it (the plans that
:mod:`dmscale.core.weight_masks`' hooks carry out).

Only layers whose forward is exactly torch's own (``nn.Linear`` and ``nn.Conv1d/2d/3d`` or
subclasses that override neither ``forward`` nor ``_conv_forward``), with a plain ``weight``
parameter, are folded: a weight-standardised convolution, a LoRA wrapper or a parametrised
weight would compute something else from ``W * m`` (:func:`fold_plan` returns None).

Example:
    >>> import torch
    >>> from torch import nn
    >>> conv = nn.Conv2d(4, 6, 3, groups=2)
    >>> plan = fold_plan(conv, 1, "in")
    >>> m, x = torch.rand(4), torch.randn(1, 4, 5, 5)
    >>> folded = nn.functional.conv2d(x, plan.fold(conv.weight, m), conv.bias, groups=2)
    >>> torch.allclose(conv(x * m.view(1, 4, 1, 1)), folded, atol=1e-6)
    True
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dmscale.core.hook_base import cast

__all__ = ["WeightFold", "fold_plan", "depth_foldable", "depth_reads"]

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


@dataclass(frozen=True)
class WeightFold:
    """How a (C,) channel mask folds into a layer's weight (and, on the output side, bias).

    Attributes:
        side: "in" (the mask of the layer's input channels) or "out" (of its output channels).
        shape: the view of the mask that broadcasts against the weight; ``(C,)`` as the mask
            is (a Linear's input side, its weight's last dim).
        index: grouped convolutions, input side: (C_out, C_in / groups) global input channel
            of every weight entry (None otherwise).
    """

    side: str
    shape: tuple[int, ...]
    index: torch.Tensor | None = None

    def _index_on(self, device: torch.device) -> torch.Tensor:
        """``index`` on ``device``, copied there once (not once per forward)."""
        cached = self.__dict__.get("_index_cache")
        if cached is None or cached.device != device:
            cached = self.index.to(device)
            object.__setattr__(self, "_index_cache", cached)
        return cached

    def fold(self, weight: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``weight * m`` along the folded side (m: (C,))."""
        m = mask if self.index is None else mask[self._index_on(mask.device)]
        if len(self.shape) > 1:
            m = m.reshape(self.shape)
        return weight * cast(m, weight.dtype)


def _standard_forward(module: nn.Module) -> type | None:
    """The torch class whose forward ``module`` runs unchanged, or None."""
    cls = type(module)
    if isinstance(module, nn.Linear) and cls.forward is nn.Linear.forward:
        return nn.Linear
    for base in _CONVS:
        if isinstance(module, base) and cls.forward is base.forward \
                and cls._conv_forward is base._conv_forward:
            return base
    return None


def depth_foldable(module: nn.Module) -> bool:
    """Whether a residual branch that ends in ``module`` can take its depth mask in the
    weights: ``f(x) * m`` is ``module`` with weight and bias times m (Sec. 3.2) when it is a
    standard linear, convolution or affine batch norm layer (torch's own forward) whose
    weight and bias are plain parameters."""
    params = module._parameters
    if not isinstance(params.get("weight"), nn.Parameter):
        return False
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return type(module).forward is nn.modules.batchnorm._BatchNorm.forward \
            and isinstance(params.get("bias"), nn.Parameter)
    return _standard_forward(module) is not None and (params.get("bias") is None or
                                                      isinstance(params.get("bias"), nn.Parameter))


def depth_reads(module: nn.Module) -> int:
    """How many depth-mask scalars a :class:`FoldDepth` on ``module`` multiplies in: 2 for a
    weight and a bias of different shapes (each its own read: no addition of their gradients),
    else 1 (no bias, or a norm's affine pair in one multiply)."""
    weight, bias = module._parameters.get("weight"), module._parameters.get("bias")
    return 2 if bias is not None and weight is not None and bias.shape != weight.shape else 1


def fold_plan(module: nn.Module, dim: int, side: str) -> WeightFold | None:
    """How to fold a mask over channel ``dim`` of the layer's input (``side="in"``) or
    output (``"out"``) into its weight, or None where that would not be the same function
    (see the module docs)."""
    base = _standard_forward(module)
    weight = module._parameters.get("weight")
    if base is None or not isinstance(weight, nn.Parameter):
        return None
    if side == "out" and module._parameters.get("bias") is None and getattr(module, "bias", None) is not None:
        return None  # a bias that is not a plain parameter
    nd = weight.dim()
    if base is nn.Linear:
        if dim not in (-1, 1):  # Linear reads channels from the last dim only
            return None
        return WeightFold("in", (weight.shape[1],)) if side == "in" else WeightFold("out", (weight.shape[0], 1))
    if dim != 1:  # (B, C, ...) activations
        return None
    c_out, c_in_g = weight.shape[0], weight.shape[1]
    rest = (1,) * (nd - 2)
    if side == "out":
        return WeightFold("out", (c_out, 1) + rest)
    groups = module.groups
    if groups == 1:
        return WeightFold("in", (1, c_in_g) + rest)
    group_of_out = torch.arange(c_out) // (c_out // groups)  # (C_out,)
    index = group_of_out[:, None] * c_in_g + torch.arange(c_in_g)[None, :]  # (C_out, C_in/g)
    return WeightFold("in", (c_out, c_in_g) + rest, index)
