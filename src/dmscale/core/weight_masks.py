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

In eager mode a layer's folds come from one batch of every layer's folds per forward
(:mod:`dmscale.core.fold_batch`, one autograd node instead of about six operators per fold): the
layer's first fold hook puts the batch's weight and bias in the ``__dict__`` for the call
(:meth:`Unfold.install_batched`); the hooks fold on their own where the batch cannot stand for
them (a grouped convolution's input, a sharded or parametrised weight) or a fold takes the
activation for the call.

Only layers whose forward is exactly torch's own (``nn.Linear`` and ``nn.Conv1d/2d/3d`` or
subclasses that override neither ``forward`` nor ``_conv_forward``), with a plain
``weight`` parameter, are folded: a weight-standardised convolution, a LoRA wrapper or a
parametrised weight would compute something else from ``W * m``, so they keep the
activation mask (:func:`fold_plan` returns None).

Example (a fold on its own, without a batch):
    >>> import torch
    >>> from torch import nn
    >>> class _Gates:  # what a hook reads from the gates
    ...     enabled = True
    ...     def channel_mask(self, key): return torch.tensor([1.0, 0.0, 0.5])
    >>> fc = nn.Linear(3, 2)
    >>> _ = fc.register_forward_pre_hook(FoldMask(_Gates(), "k", fold_plan(fc, -1, "in"), dim=-1), with_kwargs=True)
    >>> _ = fc.register_forward_hook(Unfold(), always_call=True)
    >>> x = torch.ones(4, 3)  # 12 inputs against 6 weights: the weight is multiplied
    >>> masked_x = nn.functional.linear(x * torch.tensor([1.0, 0.0, 0.5]), fc.weight, fc.bias)
    >>> torch.allclose(fc(x), masked_x), "weight" in fc.__dict__  # the shadow is gone after the call
    (True, False)
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dmscale.core.fold_plans import _CONVS, WeightFold, _standard_forward, depth_foldable, depth_reads, fold_plan
from dmscale.core.hook_base import DMSHook, MaskSource, along, cast, first_input, masked_input

__all__ = ["WeightFold", "fold_plan", "depth_foldable", "depth_reads", "FoldMask", "FoldDepth", "Unfold", "fold_layers"]

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
        if not compiling and _batched(self, module, args, kwargs):
            return None  # the layer's weight and bias come from the forward's batch (core.fold_batch)
        if self.plan.side == "out" and not self.on_weight(module, args, kwargs):
            self._on_output_now = True  # (read and cleared by the layer's Unfold after the call)
            return None
        if self.plan.side == "in":
            found = first_input(args, kwargs)
            if found is not None and (compiling or not self.on_weight(module, args, kwargs)):
                return masked_input(args, kwargs, found, self.gates.channel_mask(self.key), self.dim)
        module.__dict__["weight"], bias = self.fold_params(_current(module, "weight"), _current(module, "bias"))
        if bias is not None and self.plan.side == "out":
            module.__dict__["bias"] = bias
        return None

    def on_weight(self, module: nn.Module, args: tuple, kwargs: dict) -> bool:
        """Whether this eager call multiplies the weight: not the input where it is the smaller
        tensor, nor the output (in its :class:`Unfold`) where that is."""
        if self.plan.side == "out":
            return not _output_is_smaller(self, module, args, kwargs)
        found = first_input(args, kwargs)
        return found is None or found[1].numel() >= _current(module, "weight").numel()

    def multiplies(self, w_dim: int, b_dim: int | None, keys: dict[str, int], masks: Any) -> list[tuple] | None:
        """This fold in a batch (:class:`~dmscale.core.fold_batch.Multiply` fields, the tensor
        as 0 weight / 1 bias), or None where it cannot be: a grouped convolution's input (its
        mask is gathered per weight entry), a key outside the batch's block. ``masks``: the
        forward's mask store (:class:`~dmscale.core.forward_masks.ForwardMasks`)."""
        bias_key = getattr(self, "bias_key", None) or self.key
        if self.plan.index is not None or self.key not in keys or (b_dim is not None and bias_key not in keys):
            return None
        if self.plan.side == "in":  # (C_in,) + (1,) * k against (C_out, C_in, *k)
            return [(0, "c", keys[self.key], max(w_dim - 2, 0), tuple(d for d in range(w_dim) if d != 1), -1)]
        out = [(0, "c", keys[self.key], w_dim - 1, tuple(range(1, w_dim)), -1)]  # (C_out,) + (1,) * ...
        return out + ([(1, "c", keys[bias_key], 0, (), -1)] if b_dim is not None else [])

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

    def on_weight(self, module: nn.Module, args: tuple, kwargs: dict) -> bool:
        """Whether this eager call multiplies the weight and bias (not the output)."""
        return not _output_is_smaller(self, module, args, kwargs)

    def multiplies(self, w_dim: int, b_dim: int | None, keys: dict[str, int], masks: Any) -> list[tuple]:
        """This fold in a batch (see :meth:`FoldMask.multiplies`): the weight and the bias
        times their () depth masks (flat block indices, from the mask store ``masks``)."""
        reads = getattr(self, "reads", ())
        flat = [masks.reads[r] for r in (reads[0], reads[-1])] if reads else \
            [masks.depth_flat(self.dim, self.block)] * 2
        # a norm's affine pair, one read: its hook multiplies one (2, C) stack (a group of two)
        group = 0 if b_dim is not None and len(set(reads)) <= 1 and w_dim == b_dim == 1 else -1
        out = [(0, "d", flat[0], 0, tuple(range(w_dim)), group)]
        return out + ([(1, "d", flat[1], 0, tuple(range(b_dim)), group)] if b_dim is not None else [])

    def __call__(self, module: nn.Module, args: tuple) -> None:
        if not self.gates.enabled or _traced(self):  # compiling: in Unfold
            return
        if _batched(self, module, args, {}):
            return
        if not self.on_weight(module, args, {}):  # f(x) m on the output, in Unfold
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

    def mask_keys(self) -> list[str]:
        """The channel-mask keys its folds read (each input or output fold's, an output fold's
        bias slice), in the folds' order."""
        return [k for f in self.folds if isinstance(f, FoldMask)  # (bias_key: hooks pickled before it existed)
                for k in (f.key, getattr(f, "bias_key", None)) if k is not None]

    def multiplies(self, w_dim: int, b_dim: int | None, keys: dict[str, int], masks: Any
                   ) -> list[list[tuple]] | None:
        """Per fold, in the order the hooks multiply, its multiplies in a batch
        (:meth:`FoldMask.multiplies`); None where one fold cannot be batched."""
        out = []
        for f in getattr(self, "folds", ()):
            found = f.multiplies(w_dim, b_dim, keys, masks) if hasattr(f, "multiplies") else None
            if found is None:
                return None
            out.append(found)
        return out or None

    def install_batched(self, module: nn.Module, args: tuple, kwargs: dict) -> bool:
        """At the layer's first fold hook of an eager call: put the layer's weight (and bias)
        from the forward's batch (:meth:`~dmscale.core.forward_masks.ForwardMasks.batched_params`)
        in its instance dict for this call, where every fold takes the weight this call; False
        (each fold hook then does its own) where one takes the activation instead, which also
        leaves the layer out of the next forward's batch, or where the batch has no entry for it."""
        gates = self.folds[0].gates
        # taken (and let go of by the batch) before the check: a layer that turns to its activation
        # this call must not leave its folded weight held by the batch until the forward ends
        found = gates.batched_params(self) if hasattr(gates, "batched_params") else None
        if not all(f.on_weight(module, args, kwargs) for f in self.folds):
            self._skip = True
            return False
        self._skip = False
        if found is None:
            return False
        module.__dict__["weight"] = found[0]
        if found[1] is not None:
            module.__dict__["bias"] = found[1]
        self._batched_now = True
        return True

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
        self.__dict__.pop("_batched_now", None)
        now = [f for f in folds if f.__dict__.pop("_on_output_now", False)]
        if not now or not isinstance(out, torch.Tensor):
            return None
        for f in now:
            out = f.on_output(out)
        return out


def _batched(fold: FoldMask | FoldDepth, module: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether this eager call of the layer takes its folded weight from the forward's batch:
    decided at its first fold hook (:meth:`Unfold.install_batched`); the others follow."""
    unfold = getattr(fold, "unfold", None)  # (hooks pickled before it existed: each folds alone)
    folds = getattr(unfold, "folds", None)
    if not folds:
        return False
    if folds[0] is fold:
        return unfold.install_batched(module, args, kwargs)
    return bool(unfold.__dict__.get("_batched_now", False))


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


def fold_layers(model: nn.Module) -> list[tuple[nn.Module, Unfold]]:
    """Every layer of ``model`` whose masks are folded into its weight, with its :class:`Unfold`
    (which knows the layer's folds)."""
    return [(m, h) for m in model.modules() for h in m._forward_hooks.values() if isinstance(h, Unfold)]
