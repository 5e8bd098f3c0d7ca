"""LayerNorm over the kept channels, as one autograd function (the masked norm of a search).

A norm over a searched hidden dim must, with hard masks, compute what the pruned model's
norm computes: mean and variance over the kept channels only. With soft masks m (C,) the
statistics are the mask-weighted ones, p = m / sum(m):

    mu = sum_c p_c x_c,   var = sum_c p_c (x_c - mu)^2,   y = (x - mu) / sqrt(var + eps) * w + b

Written with tensor operations this saves three float32 copies of the activation for the
backward pass (x - mu, its square, the normalised x) and launches about 15 kernels forward
and 25 backward. :class:`MaskedLayerNorm` saves only the input, the per-position mean and
inverse deviation and the mask, and computes the gradients in closed form (x̂ = (x - mu) r,
g = dL/dy * w, G1 = sum_c g_c, G2 = sum_c g_c x̂_c, summed per position):

    dL/dx_k = r (g_k - p_k (G1 + x̂_k G2))
    dL/dm_k = (1/S) sum_positions (-x̂_k G1 - G2 (x̂_k^2 - var r^2) / 2),   S = sum(m)

Example:
    >>> import torch
    >>> x, m = torch.randn(2, 3, 8, dtype=torch.float64), torch.rand(8, dtype=torch.float64)
    >>> w, b = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    >>> args = (x.requires_grad_(), m.requires_grad_(), w.requires_grad_(), b.requires_grad_())
    >>> torch.autograd.gradcheck(lambda *a: masked_layer_norm(*a, eps=1e-5), args)
    True
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["MaskedLayerNorm", "masked_layer_norm"]

_MIN_TOTAL = 1e-6  # sum(m) is clamped here (all channels masked to ~0)


class MaskedLayerNorm(torch.autograd.Function):
    """``y = (x - mu_m) rsqrt(var_m + eps) w + b`` over the last dim with mask-weighted
    statistics; x (..., C), m (C,), w and b (C,) or None. Computes in float32 (float64
    inputs in float64) and returns x's dtype."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, m: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, eps: float) -> torch.Tensor:
        dt = torch.float64 if x.dtype == torch.float64 else torch.float32
        xf, mf = x.to(dt), m.to(dt)
        total = mf.sum().clamp_min(_MIN_TOTAL)  # S; the gradient assumes S = sum(m) (unclamped)
        p = mf / total  # (C,)
        mu = xf @ p  # (...)
        xc = xf - mu.unsqueeze(-1)
        var = (xc * xc) @ p  # (...)
        r = torch.rsqrt(var + eps)  # (...)
        y = xc * r.unsqueeze(-1)
        if weight is not None:
            y = y * weight.to(dt)
        if bias is not None:
            y = y + bias.to(dt)
        ctx.save_for_backward(x, p, mu, r, total, weight)
        ctx.eps, ctx.has_bias, ctx.dt = eps, bias is not None, dt
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, p, mu, r, total, weight = ctx.saved_tensors
        dt = ctx.dt
        gyf = gy.to(dt)
        r1 = r.unsqueeze(-1)
        xhat = (x.to(dt) - mu.unsqueeze(-1)) * r1  # (..., C)
        g = gyf * weight.to(dt) if weight is not None else gyf
        g1 = g.sum(-1, keepdim=True)  # (..., 1)
        g2 = (g * xhat).sum(-1, keepdim=True)
        lead = tuple(range(x.dim() - 1))
        dx = dm = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = (r1 * (g - p * (g1 + xhat * g2))).to(x.dtype)
        if ctx.needs_input_grad[1]:  # through p = m / S and both statistics
            vr2 = 1.0 - ctx.eps * r1 * r1  # var r^2 = var / (var + eps), (..., 1)
            dm = (-(xhat * g1).sum(lead) - 0.5 * (g2 * (xhat * xhat - vr2)).sum(lead)) / total
            dm = dm.to(p.dtype)
        if weight is not None and ctx.needs_input_grad[2]:
            dw = (gyf * xhat).sum(lead).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[3]:
            db = gyf.sum(lead)
        return dx, dm, dw, db, None


def masked_layer_norm(x: torch.Tensor, m: torch.Tensor, weight: torch.Tensor | None,
                      bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """:class:`MaskedLayerNorm` as a function (autograd-aware); see the module docs."""
    return MaskedLayerNorm.apply(x, m, weight, bias, eps)
