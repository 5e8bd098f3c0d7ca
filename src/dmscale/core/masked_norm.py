"""LayerNorm over the kept channels, as one autograd function (the masked norm of a search).

A norm over a searched hidden dim must, with hard masks, compute what the pruned model's
norm computes: mean and variance over the kept channels only. With soft masks m (C,) the
statistics are the mask-weighted ones, p = m / sum(m):

    mu = sum_c p_c x_c,   var = sum_c p_c (x_c - mu)^2,   y = (x - mu) / sqrt(var + eps) * w + b

Written with tensor operations this saves three float32 copies of the activation for the
backward pass (x - mu, its square, the normalised x) and launches about 15 kernels forward
and 25 backward. :class:`MaskedLayerNorm` takes the weights p (:func:`mask_weights`, computed
once for every norm that reads the same mask), saves only the input, the per-position mean and
inverse deviation and p, and computes the gradients in closed form (x̂ = (x - mu) r,
g = dL/dy * w, G1 = sum_c g_c, G2 = sum_c g_c x̂_c, per position):

    dL/dx_k = r (g_k - p_k (G1 + x̂_k G2))
    dL/dp_k = -sum_positions (G1 x̂_k + G2 x̂_k^2 / 2)    (+ a constant: see below)

and :func:`mask_weights` carries dL/dp back to m: dL/dm = (dL/dp - <dL/dp, p>) / S, S = sum(m).
The gradient in p drops the term ``-sum_positions G1 r mu``, the same for every channel, which
that projection (as any map onto the sum-1 weights) removes: written with x instead of the
centred x̂ it cancelled in float32 where activations have a large mean (4x the error at 1e4).

Example:
    >>> import torch
    >>> x, m = torch.randn(2, 3, 8, dtype=torch.float64), torch.rand(8, dtype=torch.float64)
    >>> w, b = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    >>> args = (x.requires_grad_(), m.requires_grad_(), w.requires_grad_(), b.requires_grad_())
    >>> torch.autograd.gradcheck(lambda *a: masked_layer_norm(*a, eps=1e-5), args)
    True
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from dmscale.core.hook_base import cast

__all__ = ["MaskWeights", "mask_weights", "MaskedLayerNorm", "masked_layer_norm", "MaskedRMSNorm", "masked_rms_norm",
           "MaskedRMSRescale", "masked_rms_rescale", "no_autocast", "autocast_as"]

_MIN_TOTAL = 1e-6  # sum(m) is clamped here (all channels masked to ~0)


def _refuse_second_derivative(what: str) -> None:
    """Raise where a backward runs under ``create_graph=True``: these backwards use numbers
    saved without their graph (statistics, weights), so a second derivative through them would
    be silently wrong."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"a second derivative through {what} is not supported (its backward uses "
                           "statistics saved without their graph); compute the gradient without "
                           "create_graph=True, or exclude the layer from the search")


class _AutocastAs:
    """Autocast on ``device_type`` set to ``enabled`` and ``dtype`` inside the block, restored
    after (also on an error), with the nesting count and cast-cache drop ``torch.autocast`` keeps:
    flag reads, and flag writes only where the state changes. ``torch.autocast`` does the same
    with about 20 us of Python per use, and a masked norm used it twice per call."""

    __slots__ = ("device_type", "enabled", "dtype", "before")

    def __init__(self, device_type: str, enabled: bool, dtype: torch.dtype | None) -> None:
        self.device_type, self.enabled, self.dtype = device_type, enabled, dtype

    def __enter__(self) -> None:
        self.before = (torch.is_autocast_enabled(self.device_type), torch.get_autocast_dtype(self.device_type))
        if self.before != (self.enabled, self.dtype):
            torch.set_autocast_enabled(self.device_type, self.enabled)
            torch.set_autocast_dtype(self.device_type, self.dtype)
            torch.autocast_increment_nesting()  # as torch.autocast: its cast cache is dropped at the end

    def __exit__(self, *exc: object) -> None:
        if self.before != (self.enabled, self.dtype):
            if torch.autocast_decrement_nesting() == 0:
                torch.clear_autocast_cache()
            torch.set_autocast_enabled(self.device_type, self.before[0])
            torch.set_autocast_dtype(self.device_type, self.before[1])


def autocast_as(device_type: str, enabled: bool, dtype: torch.dtype | None) -> Any:
    """A context with autocast ``enabled`` in ``dtype`` on ``device_type``, cheaply (the backward
    of a norm that computes its output again, as the forward ran); ``torch.autocast`` while
    dynamo traces (it knows that one)."""
    if not torch.amp.is_autocast_available(device_type):  # ``meta``: no autocast state to set
        return contextlib.nullcontext()
    if torch.compiler.is_compiling():
        return torch.autocast(device_type, dtype=dtype, enabled=enabled)
    return _AutocastAs(device_type, enabled, dtype)


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype | None]:
    """(enabled, dtype) of autocast on ``device_type``; (False, None) where it has none (meta)."""
    if not torch.amp.is_autocast_available(device_type):
        return False, None
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


def no_autocast(device_type: str) -> Any:
    """A context with autocast off on ``device_type`` (the statistics in float32, as
    LayerNorm's): :func:`autocast_as` with ``enabled=False``."""
    return autocast_as(device_type, False, _autocast_state(device_type)[1])


class MaskWeights(torch.autograd.Function):
    """``p = m / sum(m)`` over the last dim, m (..., C): the statistics' weights of a masked
    norm, one row per mask (every norm that reads the same mask shares its row). The backward
    is the projection ``dL/dm = (dL/dp - <dL/dp, p>) / S`` in four operations (autograd through
    the division, the sum and a clamp takes about nine); S is clamped at 1e-6 (every channel
    masked to ~0), and the gradient assumes it is not."""

    @staticmethod
    def forward(ctx: Any, m: torch.Tensor) -> torch.Tensor:
        total = m.sum(-1, keepdim=True).clamp_min(_MIN_TOTAL)  # S, (..., 1)
        p = m / total
        ctx.save_for_backward(p, total)
        return p

    @staticmethod
    def backward(ctx: Any, gp: torch.Tensor) -> torch.Tensor:
        _refuse_second_derivative("a masked norm's weights p = m / sum(m)")
        p, total = ctx.saved_tensors
        return (gp - torch.linalg.vecdot(gp, p).unsqueeze(-1)) / total


def mask_weights(m: torch.Tensor) -> torch.Tensor:
    """:class:`MaskWeights`: ``m / sum(m)`` over the last dim, the weights p that
    :class:`MaskedLayerNorm` and :class:`MaskedRMSRescale` take.

    Example:
        >>> mask_weights(torch.tensor([[1.0, 1.0, 0.0, 2.0]])).tolist()
        [[0.25, 0.25, 0.0, 0.5]]
    """
    return MaskWeights.apply(m)


class MaskedLayerNorm(torch.autograd.Function):
    """``y = (x - mu_p) rsqrt(var_p + eps) w + b`` over the last dim with p-weighted
    statistics; x (..., C), p (C,) weights that sum to 1, made by :func:`mask_weights` (the
    gradient with respect to p is exact up to a shift of every channel by one number, which its
    backward removes), w and b (C,) or None.
    Computes in float32 (float64 inputs in float64) and returns x's dtype."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, p: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, eps: float) -> torch.Tensor:
        with no_autocast(x.device.type):  # statistics in float32, as LayerNorm's
            return MaskedLayerNorm._forward(ctx, x, p, weight, bias, eps)

    @staticmethod
    def _forward(ctx: Any, x: torch.Tensor, p: torch.Tensor, weight: torch.Tensor | None,
                 bias: torch.Tensor | None, eps: float) -> torch.Tensor:
        dt = torch.float64 if x.dtype == torch.float64 else torch.float32
        xf = cast(x, dt)  # (..., C)
        p = cast(p, dt)  # (C,)
        mu = xf @ p  # (...)
        xc = xf - mu.unsqueeze(-1)  # (..., C), ours: normalised in place below
        var = (xc * xc) @ p  # (...)
        r = (var + eps).rsqrt_()  # (...)
        # the output is never a tensor changed in place: torch 2.11's torch.compile of such an
        # autograd function gave wrong gradients (tests/core/test_masked_norm.py)
        if weight is not None and bias is not None:  # one pass for w x̂ + b
            y = torch.addcmul(cast(bias, dt), xc.mul_(r.unsqueeze(-1)), cast(weight, dt))
        elif weight is not None:
            y = xc.mul_(r.unsqueeze(-1)) * cast(weight, dt)
        elif bias is not None:
            y = xc.mul_(r.unsqueeze(-1)) + cast(bias, dt)
        else:
            y = xc * r.unsqueeze(-1)  # x̂
        ctx.save_for_backward(x, p, mu, r, weight)
        ctx.has_bias, ctx.dt = bias is not None, dt
        return cast(y, x.dtype)

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        _refuse_second_derivative("a masked LayerNorm")
        with no_autocast(gy.device.type):
            return MaskedLayerNorm._backward(ctx, gy)

    @staticmethod
    def _backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, p, mu, r, weight = ctx.saved_tensors
        dt, c = ctx.dt, x.shape[-1]
        gyf = cast(gy.reshape(-1, c), dt)  # (N, C): every position one row
        r1 = r.reshape(-1, 1)  # (N, 1)
        xf = cast(x.reshape(-1, c), dt)  # (N, C)
        xhat = (xf - mu.reshape(-1, 1)).mul_(r1)  # (N, C)
        gx = gyf * xhat  # dL/dy_k x̂_k, (N, C): G2 and dw from one product
        if weight is not None:
            wf = cast(weight, dt)
            g = gyf * wf
            g1, g2 = (gyf @ wf).unsqueeze(-1), (gx @ wf).unsqueeze(-1)  # G1, G2: (N, 1)
        else:
            g = gyf
            g1, g2 = g.sum(-1, keepdim=True), gx.sum(-1, keepdim=True)
        dx = dp = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = cast(torch.addcmul(g, torch.addcmul(g1, xhat, g2), p, value=-1.0).mul_(r1), x.dtype).reshape(x.shape)
        if ctx.needs_input_grad[1]:  # through both statistics: -x̂^T G1 - (x̂^2)^T G2 / 2, (C,)
            gr = torch.mv(xhat.T, g1.reshape(-1))  # sum_n G1_n x̂_nk
            dp = cast(torch.addmv(gr, (xhat * xhat).T, g2.reshape(-1), beta=-1.0, alpha=-0.5), p.dtype)
        if weight is not None and ctx.needs_input_grad[2]:
            dw = cast(gx.sum(0), weight.dtype)  # sum_n gy_nk x̂_nk
        if ctx.has_bias and ctx.needs_input_grad[3]:
            db = gyf.sum(0)
        return dx, dp, dw, db, None


def masked_layer_norm(x: torch.Tensor, m: torch.Tensor, weight: torch.Tensor | None,
                      bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """:class:`MaskedLayerNorm` of the mask ``m`` (C,) as a function (autograd-aware); see the
    module docs."""
    return MaskedLayerNorm.apply(x, mask_weights(m), weight, bias, eps)


class MaskedRMSNorm(torch.autograd.Function):
    """An RMS norm over the kept channels, computed whole: ``y = g x rsqrt(sum_c p_c x_c^2 + eps)``
    over the last dim with the gain ``g = weight + offset`` (``offset`` 0: Llama's ``weight *
    norm(x)``; 1: Gemma's ``(1 + weight) * norm(x)``), computed in float32 (float64 inputs in
    float64), returned in ``out_dtype`` (the norm's own output dtype).

    Where the norm is known to compute ``(weight + offset) * x * rsqrt(mean(x^2) + eps)``
    (:mod:`dmscale.trace.handlers.norms` checks it), this replaces the norm's output instead of
    rescaling it (:class:`MaskedRMSRescale`): no backward through the norm's own graph and no
    recomputation of its output, about 7 operators forward and 12 backward in all. Saves the
    input, q = rsqrt(...) per position, p and the weight. With x̂ = x q, gg = dL/dy g and
    G = sum_c gg_c x̂_c per position:

        dL/dx_k = q (gg_k - p_k x̂_k G)
        dL/dp_k = -sum_positions G x̂_k^2 / 2      (exact for any p)
        dL/dw_k = sum_positions dL/dy_k x̂_k

    Example:
        >>> x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
        >>> p = (torch.rand(8, dtype=torch.float64) + 0.1).requires_grad_()
        >>> w = torch.randn(8, dtype=torch.float64, requires_grad=True)
        >>> f = lambda x, p, w: MaskedRMSNorm.apply(x, p, w, 1e-5, 1.0, torch.float64)
        >>> torch.autograd.gradcheck(f, (x, p, w))
        True
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, p: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
                out_dtype: torch.dtype) -> torch.Tensor:
        with no_autocast(x.device.type):
            dt = torch.float64 if x.dtype == torch.float64 else torch.float32
            xf = cast(x, dt)  # (..., C)
            q = ((xf * xf) @ cast(p, dt)).add_(eps).rsqrt_()  # (...): rsqrt(sum_c p_c x_c^2 + eps)
            # out of place: the output is never a tensor changed in place (see MaskedLayerNorm)
            y = (xf * q.unsqueeze(-1)) * MaskedRMSNorm._gain(weight, offset, dt)
            ctx.save_for_backward(x, p, q, weight)
            ctx.dt, ctx.offset = dt, offset
            return cast(y, out_dtype)

    @staticmethod
    def _gain(weight: torch.Tensor, offset: float, dt: torch.dtype) -> torch.Tensor:
        g = cast(weight, dt)
        return g + offset if offset else g

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        _refuse_second_derivative("a masked RMS norm")  # q is saved without its graph to x and p
        x, p, q, weight = ctx.saved_tensors
        with no_autocast(gy.device.type):
            dt, c = ctx.dt, x.shape[-1]
            gyf = cast(gy, dt).reshape(-1, c)  # (N, C): every position one row
            q1 = q.reshape(-1, 1)  # (N, 1)
            xhat = cast(x, dt).reshape(-1, c) * q1  # (N, C)
            gg = gyf * MaskedRMSNorm._gain(weight, ctx.offset, dt)  # dL/dx̂
            big_g = torch.linalg.vecdot(gg, xhat)  # G: (N,)
            pf = cast(p, dt)  # (C,)
            dx = dp = dw = None
            if ctx.needs_input_grad[0]:  # q (gg - p x̂ G)
                dx = torch.addcmul(gg, xhat, torch.outer(big_g, pf), value=-1.0).mul_(q1)
                dx = cast(dx, x.dtype).reshape(x.shape)
            if ctx.needs_input_grad[1]:  # -(x̂^2)^T G / 2, (C,): beta=0 ignores the input (p)
                dp = cast(torch.addmv(pf, (xhat * xhat).T, big_g, beta=0.0, alpha=-0.5), p.dtype)
            if ctx.needs_input_grad[2]:
                dw = cast((gyf * xhat).sum(0), weight.dtype)
            return dx, dp, dw, None, None, None


def masked_rms_norm(x: torch.Tensor, m: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """:class:`MaskedRMSNorm` of the mask ``m`` (C,) as a function (autograd-aware); ``out_dtype``
    defaults to x's."""
    return MaskedRMSNorm.apply(x, mask_weights(m), weight, eps, offset, out_dtype or x.dtype)


class MaskedRMSRescale(torch.autograd.Function):
    """An RMS norm's output rescaled to the kept channels' mean square:
    ``y = out * sqrt((mean_c x_c^2 + eps) / (sum_c p_c x_c^2 + eps))``, p = m / sum(m), over
    the last dim; ``out`` (..., C) is what the norm computed with all channels (so whatever
    gain it applies, ``weight`` or ``1 + weight``, is kept), x (..., C) its input.

    Saves the input (the norm's own backward holds it anyway) and per-position numbers; with
    ``norm`` (the norm's forward, ``x -> out``) the backward computes ``out`` again from x
    instead of keeping it (one elementwise pass against one activation held per norm); without
    it, y is saved. With s = y / out per position and G = sum_j dL/dy_j out_j:

        dL/dout = s dL/dy
        dL/dx_k = G s x_k (1 / (C (ms_all + eps)) - p_k / (ms_kept + eps))
        dL/dp_k = sum_positions -G s x_k^2 / (2 (ms_kept + eps))

    p (C,): the weights of the kept mean square, ``ms_kept = sum_c p_c x_c^2``
    (:func:`mask_weights`; the gradients are exact for any p).
    """

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, x: torch.Tensor, p: torch.Tensor, eps: float,
                norm: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        ctx.autocast = _autocast_state(x.device.type)
        with no_autocast(x.device.type):
            dt = torch.float64 if x.dtype == torch.float64 else torch.float32
            xf = cast(x, dt)
            p = cast(p, dt)
            x2 = xf * xf
            all_eps = x2.mean(-1).add_(eps)  # ms_all + eps, (...)
            kept_eps = (x2 @ p).add_(eps)  # ms_kept + eps: sum_c p_c x_c^2, one matrix-vector product
            s = torch.sqrt(all_eps / kept_eps)  # (...)
            y = cast(cast(out, dt) * s.unsqueeze(-1), out.dtype)
            kept = () if norm is not None else (y,)
            ctx.save_for_backward(x, s, all_eps, kept_eps, p, *kept)
            ctx.dt, ctx.norm = dt, norm
            return y

    @staticmethod
    def _out(ctx: Any, x: torch.Tensor, kept: tuple) -> tuple[torch.Tensor, bool]:
        """(``out``, False) computed again from x as the forward computed it; or (the saved y,
        True)."""
        if ctx.norm is None:
            return kept[0], True
        enabled, dtype = ctx.autocast
        with torch.no_grad(), autocast_as(x.device.type, enabled, dtype):
            return ctx.norm(x), False

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        _refuse_second_derivative("a masked RMS norm")  # s and the mean squares: saved without a graph
        x, s, all_eps, kept_eps, p, *kept = ctx.saved_tensors
        out, is_y = MaskedRMSRescale._out(ctx, x, tuple(kept))
        with no_autocast(gy.device.type):
            dt, c = ctx.dt, x.shape[-1]
            gyf = cast(gy, dt)
            d_out = cast(gyf * s.unsqueeze(-1), out.dtype) if ctx.needs_input_grad[0] else None
            # G s with G = sum_j dL/dy_j out_j, (..., 1): sum_j dL/dy_j y_j (y = out s)
            gs = torch.linalg.vecdot(gyf, cast(out, dt))
            gs = (gs if is_y else gs * s).unsqueeze(-1)
            v = gs / kept_eps.unsqueeze(-1)  # (..., 1)
            dx = dp = None
            xf = cast(x, dt)
            if ctx.needs_input_grad[1]:  # x_k (G s / (C (ms_all + eps)) - p_k G s / (ms_kept + eps))
                u = gs / (all_eps * c).unsqueeze(-1)  # (..., 1)
                dx = cast(xf * torch.addcmul(u, p, v, value=-1.0), x.dtype)
            if ctx.needs_input_grad[2]:
                # -sum_n v_n x_nk^2 / 2, (C,): beta=0 ignores the input (p, any (C,) tensor)
                dp = torch.addmv(p, (xf * xf).reshape(-1, c).T, v.reshape(-1), beta=0.0, alpha=-0.5)
            return d_out, dx, dp, None, None


def masked_rms_rescale(out: torch.Tensor, x: torch.Tensor, m: torch.Tensor, eps: float,
                       norm: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """:class:`MaskedRMSRescale` of the mask ``m`` (C,) as a function (autograd-aware); ``norm``:
    the norm's forward (``x -> out``, no hooks), to compute ``out`` again in the backward
    instead of keeping y."""
    return MaskedRMSRescale.apply(out, x, mask_weights(m), eps, norm)
