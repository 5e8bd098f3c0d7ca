"""Norms over the last dim (LayerNorm, RMSNorm and its variants), recognised by what they compute.

A norm's statistics mix all channels, so when channels are removed the pruned norm computes
something other than the masked supernet, unless the search recomputes the statistics over
the kept channels only (``masked_norm``, see :class:`dmscale.core.mask_hooks.MaskedNorm`). That hook
must reproduce the layer's own formula, and a class name says nothing about the formula:
Gemma's ``GemmaRMSNorm`` computes ``norm(x) * (1 + weight)`` where Llama's computes
``norm(x) * weight``. So a layer is handled here only after :func:`norm_formula` has run it
on probe inputs and found one of two forms:

* ``"layernorm"``: an ``nn.LayerNorm`` (or subclass) whose output equals
  ``F.layer_norm(x, (C,), weight, bias, eps)`` on a (2, 3, C) input;
* ``"rms"``: a leaf layer with a single 1-D parameter ``weight`` whose output is
  ``g * x * rsqrt(mean(x^2, -1) + eps)`` for one per-channel g (``weight``, ``1 + weight``,
  ...) at two input scales (so the eps the layer declares is the one it uses).

Anything else (a norm over several dims, a channels-first norm, an unknown variant) gets no
handler from this module: it is traced through and the channels it mixes stay fixed, or
:func:`dmscale.trace.discover.check_supported` refuses it.

Example:
    >>> import torch
    >>> from torch import nn
    >>> class OffsetRMSNorm(nn.Module):  # norm(x) * (1 + weight), as in Gemma
    ...     def __init__(self, n):
    ...         super().__init__(); self.weight = nn.Parameter(torch.zeros(n)); self.eps = 1e-6
    ...     def forward(self, x):
    ...         return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)
    >>> norm_formula(OffsetRMSNorm(8)), norm_formula(nn.LayerNorm(8)).kind
    (NormFormula(kind='rms', eps=1e-06, offset=1.0), 'layernorm')
    >>> norm_formula(nn.Linear(8, 8)) is None
    True
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import nn

from dmscale.trace.handlers.base import _NORM_DIMS, Handler, _slice_param, register_handler

if TYPE_CHECKING:
    from dmscale.trace.protocol import TraceRecorder

__all__ = ["NormFormula", "norm_formula", "share_formula", "LAYERNORM", "RMSNORM"]


@dataclass(frozen=True)
class NormFormula:
    """What a norm over the last dim computes: ``kind`` "layernorm" or "rms", and its eps
    (None: ``torch.finfo(dtype).eps``, as ``nn.RMSNorm(eps=None)``); for an RMS norm whose
    gain is ``weight + offset`` (Llama's ``weight``: 0, Gemma's ``1 + weight``: 1), ``offset``
    (None: another gain; the search then rescales the norm's output instead of computing it)."""

    kind: str
    eps: float | None
    offset: float | None = None


_CACHE: "weakref.WeakKeyDictionary[nn.Module, NormFormula | None]" = weakref.WeakKeyDictionary()


def norm_formula(module: nn.Module) -> NormFormula | None:
    """The checked formula of a last-dim norm, or None when ``module`` is not one we know.

    The probe runs ``module.forward`` (no hooks) on small random inputs once per module; a
    module on the ``meta`` device (no values) is probed as a CPU copy with random weights.
    """
    if module in _CACHE:
        return _CACHE[module]
    try:
        found = _probe(module)
    except Exception:  # a layer that cannot run on a (2, 3, C) input is not such a norm
        found = None
    _CACHE[module] = found
    return found


def share_formula(copy: nn.Module, original: nn.Module) -> None:
    """Give ``copy`` the formula probed on ``original`` (for a copy that cannot be probed
    itself, e.g. one whose weights are on the meta device)."""
    _CACHE[copy] = norm_formula(original)


def _on_meta(module: nn.Module) -> bool:
    return any(t.device.type == "meta" for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)))


@torch.no_grad()
def _cpu_twin(module: nn.Module) -> nn.Module:
    """A shallow CPU copy of a meta-device norm (forward only: hooks and children shared), its
    floating tensors random in [0.5, 1.5]: the formula is found from what the layer computes,
    whatever its weights."""
    g = torch.Generator().manual_seed(0)

    def real(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point():
            return torch.zeros(t.shape, dtype=t.dtype)
        return (0.5 + torch.rand(t.shape, generator=g)).to(t.dtype)

    twin = copy.copy(module)
    twin._parameters = {k: None if p is None else nn.Parameter(real(p), requires_grad=False)
                        for k, p in module._parameters.items()}
    twin._buffers = {k: None if b is None else real(b) for k, b in module._buffers.items()}
    return twin


def _eps(module: nn.Module) -> float | None:
    for attr in ("eps", "variance_epsilon", "epsilon"):
        value = getattr(module, attr, None)
        if isinstance(value, (int, float)):
            return float(value)
    return None


def _probe(module: nn.Module) -> NormFormula | None:
    if any(True for _ in module.children()):
        return None
    params = dict(module.named_parameters(recurse=False))
    weight = params.get("weight")
    if isinstance(module, nn.LayerNorm):
        if len(tuple(module.normalized_shape)) != 1:
            return None
        return _probe_layernorm(_cpu_twin(module) if _on_meta(module) else module)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or set(params) != {"weight"}:
        return None
    if not weight.dtype.is_floating_point:
        return None
    if _on_meta(module):  # a candidate (one 1-D weight): a CPU copy of C numbers to run
        module = _cpu_twin(module)
        weight = module.weight
    return _probe_rms(module, weight)


def _inputs(c: int, like: torch.Tensor, scale: float, seed: int) -> torch.Tensor:
    """(2, 3, c) values with |x| in [0.5, 1.5] * scale (no near-zero divisors)."""
    g = torch.Generator().manual_seed(seed)
    mag = 0.5 + torch.rand(2, 3, c, generator=g)
    sign = torch.where(torch.rand(2, 3, c, generator=g) < 0.5, -1.0, 1.0)
    return (mag * sign * scale).to(device=like.device, dtype=like.dtype)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    tol = 1e-4 if a.dtype in (torch.float32, torch.float64) else 2e-2
    a, b = a.float(), b.float()
    return a.shape == b.shape and bool(((a - b).abs() <= tol * (1.0 + b.abs())).all())


@torch.no_grad()
def _probe_layernorm(module: nn.LayerNorm) -> NormFormula | None:
    c = int(module.normalized_shape[0])
    like = module.weight if module.weight is not None else torch.zeros(())
    x = _inputs(c, like, 1.0, 0)
    expected = F.layer_norm(x, (c,), module.weight, module.bias, module.eps)
    return NormFormula("layernorm", float(module.eps)) if _close(module.forward(x), expected) else None


@torch.no_grad()
def _probe_rms(module: nn.Module, weight: torch.Tensor) -> NormFormula | None:
    c = weight.numel()
    eps = _eps(module)
    e = torch.finfo(weight.dtype).eps if eps is None else eps

    def normed(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + e)

    x1 = _inputs(c, weight, 1.0, 0)
    y1 = module.forward(x1)
    if not isinstance(y1, torch.Tensor) or y1.shape != x1.shape:
        return None
    gain = (y1.float() / normed(x1))[0, 0]  # (C,): the per-channel factor g
    # eps matters when mean(x^2) is of its size: the declared eps must be the one used
    for scale, seed in ((1.0, 1), (max(e, 1e-12) ** 0.5, 2)):
        x = _inputs(c, weight, scale, seed)
        if not _close(module.forward(x), (normed(x) * gain).to(weight.dtype)):
            return None
    return NormFormula("rms", eps, _gain_offset(module, normed))


@torch.no_grad()
def _gain_offset(module: nn.Module, normed: Callable[[torch.Tensor], torch.Tensor]) -> float | None:
    """0 where the gain is the weight itself, 1 where it is ``1 + weight``, else None: found on a
    shallow copy with weights of both signs (whatever the module's own are, e.g. all ones or
    zeros at initialisation)."""
    weight = module._parameters["weight"]
    g = torch.Generator().manual_seed(3)
    signed = (torch.rand(weight.shape, generator=g) * 3.0 - 1.5).to(device=weight.device, dtype=weight.dtype)
    twin = copy.copy(module)
    twin._parameters = {"weight": nn.Parameter(signed, requires_grad=False)}
    x = _inputs(weight.numel(), weight, 1.0, 4)
    y = twin.forward(x)
    for offset in (0.0, 1.0):
        if _close(y, (normed(x) * (signed.float() + offset)).to(weight.dtype)):
            return offset
    return None


# ----------------------------------------------------------------------------- handlers


def _trace(kind: str) -> Callable[..., None]:
    """Statistics over the last dim, channel-wise affine.

    Channels on the last dim pass through and get a masked norm during the search. Channels
    on another dim (heads of a q/k norm over the head dim) pass through untouched: each row
    is normalised on its own.
    """

    def trace(tr: "TraceRecorder", name: str, m: nn.Module, args: tuple, out: torch.Tensor) -> None:
        x = args[0]
        lab = tr.label_of(x)
        if not isinstance(out, torch.Tensor) or out.shape != x.shape:
            tr.pin_label(lab, f"{type(m).__name__} {name} changes the shape of its input")
            tr.record_layer(name, kind, None, None)
            return
        if lab is not None and lab.dim == x.dim() - 1:
            tr.record_layer(name, kind, lab.ids, lab.ids, macs_sides=(), masked_norm=True)
            tr.set_label(out, lab.dim, lab.ids)
            return
        tr.record_layer(name, kind, None, None)
        if lab is not None:
            tr.set_label(out, lab.dim, lab.ids)

    return trace


def _prune(m: nn.Module, in_keep: torch.Tensor | None, out_keep: torch.Tensor | None) -> None:
    keep = out_keep if out_keep is not None else in_keep
    if keep is None:
        return
    _slice_param(m, "weight", 0, keep)
    _slice_param(m, "bias", 0, keep)
    n = int(keep.numel())
    if hasattr(m, "normalized_shape"):
        m.normalized_shape = (n,)
    if hasattr(m, "hidden_size"):
        m.hidden_size = n


def _is(kind: str) -> Callable[[nn.Module], bool]:
    def check(m: nn.Module) -> bool:
        if not isinstance(m, nn.LayerNorm) and not isinstance(getattr(m, "weight", None), torch.Tensor):
            return False  # cheap exit: the probe only runs on candidates
        f = norm_formula(m)
        return f is not None and f.kind == kind

    return check


LAYERNORM = Handler("layernorm", _trace("layernorm"), _prune, _NORM_DIMS, lambda m: (), channel_dim=-1)
RMSNORM = Handler("rmsnorm", _trace("rmsnorm"), _prune, lambda m: {"weight": {0: "out"}},
                  lambda m: (), channel_dim=-1)

register_handler(_is("rms"), RMSNORM)
register_handler(_is("layernorm"), LAYERNORM)
