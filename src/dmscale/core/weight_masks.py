"""Masks multiplied into a layer's weight instead of its activation, where that is the same function.

The paper multiplies a channel mask into the input of every consumer, ``conv(X * m, W)``
(A.1.1). For a convolution or linear layer that is the same as ``conv(X, W * m)`` with m
along the weight's input channels: the same output, the same gradient with respect to m (so
the same Taylor importance, Eq. 4) and the same weight gradient, but the multiply and what
it saves for the backward pass are the size of the weight (C_out x C_in x k x k), not of the
activation (B x C_in x H x W), and no masked copy of the activation is kept for the backward
pass. An output mask (``Q' = Q m``, the per-head dims of timm attention) folds the same way
into the weight's rows and the bias. Call by call the smaller multiply is taken: where the
input (or, for an output or depth mask, the output) has fewer elements than the weight, as
at a few tokens, the activation is multiplied instead.

How: a forward pre-hook computes ``W * m`` and puts it in the module's instance ``__dict__``
under ``weight`` (and ``bias``), where Python's attribute lookup finds it before
``nn.Module.__getattr__`` reaches ``_parameters``; a forward hook (``always_call``, also on an
exception) removes it again. The parameters themselves, ``named_parameters``,
``state_dict`` and optimisers never see anything but the user's weights.

Under ``torch.compile`` (while dynamo traces the hooks) nothing is shadowed: torch 2.11's
dynamo cannot remove a key from a module's ``__dict__`` (a graph break in every folded layer,
then a recompilation per layer until ``recompile_limit``). A linear layer's :class:`Unfold`
hook computes the layer again from its input with the folded weight and bias
(``F.linear(x, W m, b m)``), taking the smaller multiply per fold as in eager mode; the layer's
own output is then unused and inductor drops it from the graph. The mask gradients become
reductions over the weight instead of over the token rows, which inductor split into kernels of
their own at a real batch (a ViT-S step: 197 graph kernels with the masks on the activations,
115 folded, 100 plain). Convolutions (see :func:`_recomputed`), a layer called with its input
as a keyword, and a batch norm's depth fold (its forward updates the running statistics, which a
second call would repeat) take the masks on the activations: the input side multiplies the
input, the output side and a depth fold the output (``(W x + b) m``, ``BN(x) m``).

Only layers whose forward is exactly torch's own (``nn.Linear`` and ``nn.Conv1d/2d/3d`` or
subclasses that override neither ``forward`` nor ``_conv_forward``), with a plain
``weight`` parameter, are folded: a weight-standardised convolution, a LoRA wrapper or a
parametrised weight would compute something else from ``W * m``, so they keep the
activation mask (:func:`fold_plan` returns None).

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

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dmscale.core.hook_base import DMSHook, MaskSource, along, cast, first_input, masked_input

__all__ = ["WeightFold", "fold_plan", "depth_foldable", "depth_reads", "FoldMask", "FoldDepth", "Unfold"]

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


def _current(module: nn.Module, name: str) -> torch.Tensor | None:
    """The tensor the module's forward would read as ``name`` now: an earlier fold's shadow
    of this call (folds of one layer stack), else the parameter itself."""
    return module.__dict__.get(name, module._parameters.get(name))


def _output_numel(module: nn.Module, x: torch.Tensor) -> int:
    """The elements of ``module``'s output for input ``x`` (B, C_in, ...): a linear layer's
    exactly, a convolution's up to what its padding adds back (its strides divide the input's
    positions), a batch norm's exactly (its input's)."""
    if isinstance(module, nn.Linear):
        return x.numel() // max(module.in_features, 1) * module.out_features
    if isinstance(module, _CONVS):
        return x.numel() // max(module.in_channels, 1) * module.out_channels // math.prod(module.stride)
    return x.numel()


def _output_below_params(module: nn.Module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the layer's output for input ``x`` has fewer elements than ``weight`` and ``bias``
    together: multiplying the output is then the smaller multiply of an output or depth fold."""
    return _output_numel(module, x) < weight.numel() + (0 if bias is None else bias.numel())


def _output_is_smaller(fold: FoldMask | FoldDepth, module: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether this (eager) call multiplies the layer's output instead of its weight and bias,
    the same function: where the output has fewer elements than what the fold would copy (a
    transformer's projections at a few tokens), and the layer's :class:`Unfold` can do it."""
    found = first_input(args, kwargs)
    if found is None or not getattr(fold, "via_unfold", False):
        return False
    return _output_below_params(module, found[1], _current(module, "weight"), _current(module, "bias"))


def _recomputed(module: nn.Module, args: tuple) -> bool:
    """Whether, under ``torch.compile``, the layer's :class:`Unfold` computes the layer again
    from its positional input with the folded weight and bias: a linear layer with torch's own
    forward (see the module docs). Convolutions keep the masks on their activations there:
    inductor fuses a channel mask's multiply and its gradient's reduction over the positions
    into the neighbouring batch norm's kernels, while a folded weight's reduction is a kernel of
    its own (a small CNN's compiled step: 26 graph kernels with activation masks, 31 folded)."""
    return (bool(args) and isinstance(args[0], torch.Tensor) and isinstance(module, nn.Linear)
            and _standard_forward(module) is nn.Linear)


def _traced(fold: FoldMask | FoldDepth) -> bool:
    """Whether dynamo traces this call and the layer's :class:`Unfold` multiplies the output
    (``via_unfold``, set where the hooks are attached; a fold pickled before it shadows as in
    eager mode)."""
    return bool(getattr(fold, "via_unfold", False)) and torch.compiler.is_compiling()


class FoldMask(DMSHook):
    """Forward pre-hook (with kwargs): shadow the module's ``weight`` (and on the output side
    ``bias``) with the masked one for this call. Stacks: an input and an output fold of one
    layer multiply the same shadowed weight.

    The smaller of the two multiplies is taken, call by call: a layer whose input is smaller
    than its weight (a language model's head over a large vocabulary, any layer at batch 1) gets
    ``X * m`` instead, the same function (``dim``: the input's channel dim); on the output side a
    layer whose output is smaller than its weight and bias gets ``(W x + b) m`` in its
    :class:`Unfold`. An output fold multiplies the bias by the slice ``bias_key`` (the same
    channels; None: the weight's)."""

    def __init__(self, gates: MaskSource, key: str, plan: WeightFold, dim: int = 1,
                 bias_key: str | None = None) -> None:
        self.gates, self.key, self.plan, self.dim, self.bias_key = gates, key, plan, dim, bias_key
        self.via_unfold = False  # (see _traced)

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not self.gates.enabled:
            return None
        compiling = _traced(self)
        if compiling and (self.plan.side == "out" or _recomputed(module, args)):
            return None  # folded or multiplied in Unfold (see the module docs)
        if self.plan.side == "out" and _output_is_smaller(self, module, args, kwargs):
            self._on_output_now = True  # (read and cleared by the layer's Unfold after the call)
            return None
        weight = _current(module, "weight")
        if self.plan.side == "in":
            found = first_input(args, kwargs)
            if found is not None and (compiling or found[1].numel() < weight.numel()):
                return masked_input(args, kwargs, found, self.gates.channel_mask(self.key), self.dim)
        module.__dict__["weight"], bias = self.fold_params(weight, _current(module, "bias"))
        if bias is not None and self.plan.side == "out":
            module.__dict__["bias"] = bias
        return None

    def fold_params(self, weight: torch.Tensor, bias: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``W m`` along the folded side, and on the output side ``b m`` (the bias's slice
        ``bias_key``); the input side leaves the bias as it is."""
        m = self.gates.channel_mask(self.key)  # (C,)
        weight = self.plan.fold(weight, m)
        if self.plan.side == "out" and bias is not None:
            key = getattr(self, "bias_key", None)  # (hooks pickled before it existed)
            mb = m if key is None else self.gates.channel_mask(key)
            bias = bias * cast(mb, bias.dtype)
        return weight, bias

    def on_output(self, out: torch.Tensor) -> torch.Tensor:
        """Under ``torch.compile``: the output fold as ``out * m`` along the output's channel
        dim (``(W x + b) m``: the same function); the input side is not on the output."""
        if self.plan.side != "out":
            return out
        return along(out, self.gates.channel_mask(self.key), self.dim)


class FoldDepth(DMSHook):
    """Forward pre-hook on the last layer of a residual branch: its weight and bias times
    the block's depth mask m_i, so the branch computes ``f(x) * m_i`` (Sec. 3.2) without a
    multiply of (and a saved copy of) the branch's output activation; where that output is the
    smaller tensor (a few tokens), the output is multiplied instead, in the layer's
    :class:`Unfold`. ``reads``: the ids of the depth scalars it multiplies in
    (``gates.depth_read``), the weight's and the bias's (one id: both, or a norm's affine pair)."""

    def __init__(self, gates: MaskSource, dim: int, block: int, reads: tuple[int, ...] = ()) -> None:
        self.gates, self.dim, self.block, self.reads = gates, dim, block, reads
        self.via_unfold = False  # (see _traced)

    def _masks(self) -> tuple[torch.Tensor, torch.Tensor]:
        reads = getattr(self, "reads", ())  # (hooks pickled before it existed: the block's unit)
        if not reads:
            m = self.gates.depth_unit(self.dim, self.block)
            return m, m
        return self.gates.depth_value(reads[0]), self.gates.depth_value(reads[-1])  # () scalars

    def on_output(self, out: torch.Tensor) -> torch.Tensor:
        """Under ``torch.compile``: the branch's output times its depth mask, ``f(x) m`` (the
        weight's and the bias's reads are one value; the gradient goes through the first)."""
        m, _ = self._masks()
        return out * cast(m, out.dtype)

    def __call__(self, module: nn.Module, args: tuple) -> None:
        if not self.gates.enabled or _traced(self):  # compiling: in Unfold
            return
        if _output_is_smaller(self, module, args, {}):  # f(x) m on the output, in Unfold
            self._on_output_now = True
            return
        weight, bias = self.fold_params(_current(module, "weight"), _current(module, "bias"))
        module.__dict__["weight"] = weight
        if bias is not None:
            module.__dict__["bias"] = bias

    def fold_params(self, weight: torch.Tensor, bias: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``W m_i`` and ``b m_i``: the layer then computes ``f(x) m_i``."""
        m, mb = self._masks()
        if bias is not None and weight.shape == bias.shape and weight.dtype == bias.dtype:
            # a norm's affine pair, (2, C): one multiply, and one gradient for m in the backward
            weight, bias = (torch.stack((weight, bias)) * cast(m, weight.dtype)).unbind(0)
            return weight, bias
        return weight * cast(m, weight.dtype), None if bias is None else bias * cast(mb, bias.dtype)


class Unfold(DMSHook):
    """Forward hook registered with ``always_call=True``, first among the layer's forward hooks
    (``prepend=True``: a hook registered before sees the output the model gets): the module's
    own parameters are visible again after the call, also when the forward raised. Under
    ``torch.compile`` nothing was shadowed: a linear layer is computed again with all its folds
    (``folds``, in the order they were registered; :func:`_folded_call`), any other layer's
    output and depth folds multiply its output; in eager mode the folds that found the output
    the smaller tensor for this call do."""

    def __init__(self) -> None:
        self.folds: list[FoldMask | FoldDepth] = []

    def __call__(self, module: nn.Module, args: tuple, out: Any) -> Any:
        folds = getattr(self, "folds", ())  # (hooks pickled before it existed: they shadowed)
        if folds and torch.compiler.is_compiling():
            if not folds[0].gates.enabled or not isinstance(out, torch.Tensor):
                return None
            if _recomputed(module, args):
                return _folded_call(module, args[0], folds)
            for f in folds:
                out = f.on_output(out)
            return out
        module.__dict__.pop("weight", None)
        module.__dict__.pop("bias", None)
        now = [f for f in folds if f.__dict__.pop("_on_output_now", False)]
        if not now or not isinstance(out, torch.Tensor):
            return None
        for f in now:
            out = f.on_output(out)
        return out


def _folded_call(module: nn.Module, x: torch.Tensor, folds: list[FoldMask | FoldDepth]) -> torch.Tensor:
    """Under ``torch.compile``: the linear layer computed again from its input ``x`` with its folds,
    each taking the smaller multiply as in eager mode: an input fold ``W m`` (or ``x m`` where
    the input is smaller than the weight), an output or depth fold ``W m``, ``b m`` (or the
    output times m where the output is smaller than the weight and bias)."""
    weight, bias = module.weight, module.bias
    on_output = _output_below_params(module, x, weight, bias)
    after = []
    for f in folds:
        if isinstance(f, FoldMask) and f.plan.side == "in":
            if x.numel() < weight.numel():
                x = along(x, f.gates.channel_mask(f.key), f.dim)
            else:
                weight = f.fold_params(weight, None)[0]
        elif on_output:
            after.append(f)
        else:
            weight, bias = f.fold_params(weight, bias)
    y = F.linear(x, weight, bias)
    for f in after:
        y = f.on_output(y)
    return y
