"""The hooks that put a search's masks on activations (the paper's formulation, A.1.1 and
Sec. 3.2), where a mask cannot be folded into a weight (:mod:`dmscale.core.weight_masks`):

* :class:`ComputeMasks`: the model's forward pre-hook, every mask once per forward;
* :class:`MaskInput`: ``X * m`` on a layer's input (m shaped 1xCx1x1 or C);
* :class:`MaskOutput`: ``Q' = Q m`` on a layer's output;
* :class:`MaskedNorm`: a LayerNorm / RMSNorm over the kept channels (:mod:`dmscale.core.masked_norm`);
* :class:`MaskBranch`: ``f(x) * m_i`` on a residual branch's output (depth);
* :class:`RestoreFastpath`: restores torch's fused-MHA switch after the forward.

Each takes the :class:`~dmscale.core.masks.Gates` whose masks it reads (``gates.channel_mask(key)``,
``gates.norm_weights(key)``, ``gates.depth_value(read)``, ``gates.enabled``); none imports it.

Example:
    >>> import torch
    >>> class _Gates:  # what a hook reads from the gates
    ...     enabled = True
    ...     def channel_mask(self, key): return torch.tensor([1.0, 0.0])
    >>> hook = MaskInput(_Gates(), "k", dim=-1)
    >>> hook(torch.nn.Identity(), (torch.ones(3, 2),), {})[0][0][0].tolist()
    [1.0, 0.0]
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dmscale.core.hook_base import DMSHook, MaskSource, along, cast, first_input, masked_input
from dmscale.core.fused_norms import layer_norm, rms_norm, rms_rescale
from dmscale.core.masked_norm import mask_weights
from dmscale.core.weight_masks import fold_layers

__all__ = ["ComputeMasks", "RestoreFastpath", "MaskInput", "MaskOutput", "MaskedNorm", "MaskBranch"]


class MaskOutput(DMSHook):
    """Forward hook: multiply a layer's output by its channels' masks (Q' = Q m_qk m_head)."""

    def __init__(self, gates: MaskSource, key: str, dim: int) -> None:
        self.gates, self.key, self.dim = gates, key, dim

    def __call__(self, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
        if not self.gates.enabled:
            return None
        return along(out, self.gates.channel_mask(self.key), self.dim)


class ComputeMasks(DMSHook):
    def __init__(self, gates: MaskSource, no_fastpath: bool = False) -> None:
        self.gates = gates
        self.no_fastpath = no_fastpath

    @torch.compiler.disable  # eager under torch.compile(model): a gradient hook per forward
    def __call__(self, module: nn.Module, args: tuple) -> None:
        layers = self.__dict__.get("_layers")
        if layers is None:  # the model's folded layers, found once (core.fold_batch)
            layers = self._layers = fold_layers(module)
        self.gates.forward_masks.fold_layers = layers
        self.gates.compute()
        if self.no_fastpath:  # the fused MHA/encoder kernel would bypass the layer hooks
            self.gates._fastpath = torch.backends.mha.get_fastpath_enabled()
            torch.backends.mha.set_fastpath_enabled(False)


class RestoreFastpath(DMSHook):
    """Forward hook registered with ``always_call=True``: the global fast-path switch is
    restored even when the forward raises."""

    def __init__(self, gates: MaskSource) -> None:
        self.gates = gates

    @torch.compiler.disable  # eager under torch.compile(model), as ComputeMasks: dynamo cannot trace the switch
    def __call__(self, module: nn.Module, args: tuple, out: Any) -> None:
        prev = getattr(self.gates, "_fastpath", None)
        if prev is not None:
            torch.backends.mha.set_fastpath_enabled(prev)
            self.gates._fastpath = None


class MaskInput(DMSHook):
    """Pre-hook (with kwargs): multiply the layer's input by the masks of its channels,
    ``X * m`` with m shaped 1xCx1x1 (conv) or C (linear), A.1.1."""

    def __init__(self, gates: MaskSource, key: str, dim: int) -> None:
        self.gates, self.key, self.dim = gates, key, dim

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        found = first_input(args, kwargs)
        if found is None or not self.gates.enabled:
            return None
        return masked_input(args, kwargs, found, self.gates.channel_mask(self.key), self.dim)


class MaskedNorm(DMSHook):
    """Forward hook (with kwargs) on a norm over the last dim: the output as if mean and
    variance were taken over the kept channels only (weighted by their masks), so hard masks
    give exactly the norm of the pruned model.

    The handler has checked what the layer computes (:mod:`dmscale.trace.handlers.norms`): ``kind`` is
    ``"layernorm"`` (``F.layer_norm`` with the module's weight, bias and eps) or ``"rms"``
    (``y = g * x * rsqrt(mean(x^2) + eps)`` for some per-channel g). Where g is ``weight +
    offset`` (``offset`` 0 or 1: Llama's, Gemma's) and the output is the layer's own forward of x,
    the hook computes the masked RMS norm whole (:class:`~dmscale.core.masked_norm.MaskedRMSNorm`:
    the layer's own graph is dropped, nothing is computed again in the backward); otherwise the
    output is rescaled by ``rsqrt(mean_kept + eps) / rsqrt(mean + eps)``, which keeps whatever g
    the layer applies.
    """

    def __init__(self, gates: MaskSource, key: str, kind: str, eps: float | None,
                 offset: float | None = None) -> None:
        self.gates, self.key, self.kind, self.eps, self.offset = gates, key, kind, eps, offset

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor | None:
        found = first_input(args, kwargs)
        if found is None or not self.gates.enabled:
            return None
        x = found[1]
        if x.dtype == torch.float64:  # the statistics in float64: their weights too (the gates' are float32)
            p = mask_weights(cast(self.gates.channel_mask(self.key), torch.float64)[None])[0]
        else:
            p = cast(self.gates.norm_weights(self.key), torch.float32)  # (C,): m / sum(m)
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps  # nn.RMSNorm(eps=None)
        fuse = getattr(self.gates, "fuse_norms", None)  # None: fused on CUDA (core.fused_norms)
        if self.kind == "rms":  # one autograd node
            recomputable = _recomputable(module, args, kwargs)
            offset = getattr(self, "offset", None)  # (hooks pickled before it existed)
            weight = module._parameters.get("weight")
            if offset is not None and recomputable and weight is not None:  # the norm computed whole
                return rms_norm(x, p, weight, eps, offset, out.dtype, fuse)
            # the output rescaled to the kept mean square
            return rms_rescale(out, x, p, eps, module if recomputable else None, fuse)
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        bias = bias if isinstance(bias, torch.Tensor) else None
        return cast(layer_norm(x, p, weight, bias, eps, fuse), out.dtype)  # one autograd node


def _recomputable(module: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether ``module.forward(x)`` gives again the output this hook saw: called with x
    alone, and no other forward hook (the user's, another library's, a global one) ran on
    the output before this one (only then may the backward compute it again)."""
    return (len(args) == 1 and not kwargs and not nn.modules.module._global_forward_hooks
            and all(isinstance(h, DMSHook) for h in module._forward_hooks.values()))


class MaskBranch(DMSHook):
    """Forward hook: multiply a residual branch's output by its block's depth mask (``read``:
    its scalar's id, ``gates.depth_read``; None: the block's unit)."""

    def __init__(self, gates: MaskSource, dim: int, block: int, read: int | None = None) -> None:
        self.gates, self.dim, self.block, self.read = gates, dim, block, read

    def __call__(self, module: nn.Module, args: tuple, out: Any) -> Any:
        if not self.gates.enabled:
            return None
        read = getattr(self, "read", None)  # (hooks pickled before it existed)
        m = self.gates.depth_unit(self.dim, self.block) if read is None else self.gates.depth_value(read)
        if isinstance(out, torch.Tensor):
            return out * cast(m, out.dtype)
        first = out[0]  # (output, attention weights, ...) as Hugging Face attention returns
        return (first * cast(m, first.dtype),) + tuple(out[1:])
