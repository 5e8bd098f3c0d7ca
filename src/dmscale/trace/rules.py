"""How torch functions carry channel labels (the tracer's rule table).

Each rule receives the tracer, the function's arguments and its output and sets the labels
of the output tensors. A function with a labelled input and no rule pins every channel it
touches (safe: those channels are never searched). Rules only pass a label through when the
function treats every channel on its own, so that removing a channel changes nothing else.

This module holds the element-wise, pooling, padding and reduction rules and the table
:data:`RULES` of all rules; the reshape, permute, indexing, split and concat rules are in
:mod:`dmscale.trace.shape_rules`, the helpers they share in :mod:`dmscale.trace.rule_base`.

Example:
    >>> "add_" in ELEMENTWISE and "conv2d" not in RULES
    True
    >>> RULES["reshape"] is SHAPE_RULES["reshape"]
    True
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dmscale.trace.rule_base import Rule, arg, norm_dim, unknown
from dmscale.trace.shape_rules import SHAPE_RULES
from dmscale.trace.values import tensors_in

if TYPE_CHECKING:
    from dmscale.trace.protocol import TraceRecorder

__all__ = ["RULES", "ELEMENTWISE", "apply_rule"]

ELEMENTWISE = {
    # arithmetic (functions, methods, operators and their in-place forms)
    "add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_", "true_divide", "rsub",
    "__add__", "__radd__", "__iadd__", "__sub__", "__rsub__", "__isub__", "__mul__",
    "__rmul__", "__imul__", "__truediv__", "__rtruediv__", "__itruediv__", "__div__",
    "__pow__", "__rpow__", "pow", "pow_", "__neg__", "neg", "abs", "square", "sqrt", "rsqrt",
    "exp", "log", "reciprocal", "maximum", "minimum", "addcmul", "lerp", "where", "erf",
    "__and__", "__or__", "nan_to_num", "sin", "cos",
    "floor", "ceil", "round", "trunc", "sign", "log1p", "expm1", "log2", "exp2",
    # comparisons and predicates (masks of the same shape)
    "gt", "lt", "ge", "le", "eq", "ne", "__gt__", "__lt__", "__ge__", "__le__", "__eq__",
    "__ne__", "logical_not", "logical_and", "logical_or", "isnan", "isinf", "isfinite",
    # activations
    "relu", "relu_", "relu6", "gelu", "silu", "silu_", "sigmoid", "sigmoid_", "hardswish",
    "hardswish_", "hardsigmoid", "hardsigmoid_", "tanh", "tanh_", "leaky_relu",
    "leaky_relu_", "elu", "elu_", "selu", "celu", "mish", "softplus", "hardtanh",
    "hardtanh_", "logsigmoid", "clamp", "clamp_", "clip", "clip_", "clamp_min", "clamp_max",
    # dropout and copies
    "dropout", "dropout_", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
    "feature_alpha_dropout", "contiguous", "clone", "to", "float", "half", "bfloat16",
    "double", "type", "type_as", "detach", "detach_", "requires_grad_", "cpu", "cuda",
}

SPATIAL = {
    "max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d",
    "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d",
    "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d", "lp_pool2d",
    "interpolate", "upsample", "upsample_nearest", "upsample_bilinear",
    "max_pool2d_with_indices", "_max_pool2d", "boolean_dispatch",
}

REDUCTIONS = {"mean", "sum", "amax", "amin", "max", "min", "var", "std", "norm", "prod",
              "logsumexp", "nansum", "nanmean", "any", "all", "argmax", "argmin"}

ALONG_DIM = {"softmax", "log_softmax", "cumsum", "cumprod", "_softmax", "normalize"}


# ----------------------------------------------------------------------------- elementwise


_DTYPE_DONOR_OPS = {"to", "type_as"}


def _data_operands(name: str, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an element-wise op computes with. ``x.to(other)`` and ``x.type_as(other)``
    only read ``other``'s dtype and device: ``x`` alone is an operand."""
    if name in _DTYPE_DONOR_OPS:
        first = args[0] if args else kwargs.get("input", kwargs.get("self"))
        return [first] if isinstance(first, torch.Tensor) else []
    return tensors_in(args) + tensors_in(kwargs)


def _broadcast_dim(t: torch.Tensor, dim: int, out_ndim: int) -> int | None:
    """The output dim that dim ``dim`` of operand ``t`` lands on under right-aligned
    broadcasting to ``out_ndim`` dims, or None when ``t`` has more dims than the output."""
    d = dim + out_ndim - t.dim()
    return d if 0 <= d < out_ndim else None


def elementwise(tr: "TraceRecorder", name: str, args: tuple, kwargs: dict, out: Any) -> None:
    """Broadcasting element-wise op: labelled operands of full size are tied channel-wise.

    Operands broadcast right-aligned: dim k of an operand with r dims is output dim
    ``k + out.dim() - r``. A labelled operand whose channels are broadcast (size 1 against
    more) or that cannot be aligned pins its channels. An unlabelled operand that spans the
    channel dim is either a parameter (layer scale, position embedding: sliced with the
    channels) or pins them.
    """
    outs = tensors_in(out)
    if len(outs) != 1:
        return unknown(tr, name, args, kwargs, out)
    y = outs[0]
    n_out = y.dim()
    operands = _data_operands(name, args, kwargs)
    aligned: list[tuple[int, np.ndarray]] = []
    for t in operands:
        lab = tr.label_of(t)
        if lab is None:
            continue
        d = _broadcast_dim(t, lab.dim, n_out)
        if d is not None and t.shape[lab.dim] == y.shape[d]:
            aligned.append((d, lab.ids))
        else:
            tr.pin_ids(lab.ids, f"{name} broadcasts a labelled dim (operand {tuple(t.shape)}, "
                                f"channels on dim {lab.dim}, output {tuple(y.shape)})")
    if not aligned:
        return
    dims = {d for d, _ in aligned}
    if len(dims) > 1:
        for _, ids in aligned:
            tr.pin_ids(ids, f"{name} mixes channel dims")
        return
    d, ids = aligned[0]
    for t in operands:  # unlabelled operands of full size along the channel dim
        if tr.label_of(t) is not None:
            continue
        k = d - (n_out - t.dim())  # the operand's own dim on the channel dim (< 0: absent)
        if 0 <= k < t.dim() and t.shape[k] == y.shape[d] and y.shape[d] > 1:
            # a parameter (layer scale, position embedding) is sliced with the channels
            if not tr.label_param(t, k, ids):
                tr.pin_ids(ids, f"{name} with an unlabelled {tuple(t.shape)} operand")
    for _, other in aligned[1:]:
        tr.uf.union_arrays(ids, other)
    tr.set_label(y, d, ids)


def spatial(tr: "TraceRecorder", name: str, args: tuple, kwargs: dict, out: Any) -> None:
    """Pooling / resizing over dims >= 2 of an (N, C, ...) tensor."""
    x = args[0] if args else tensors_in(kwargs)[0]
    lab = tr.label_of(x)
    outs = tensors_in(out)
    if lab is None:
        return
    if lab.dim == 1 and all(o.dim() > 1 and o.shape[1] == len(lab.ids) for o in outs):
        for o in outs[:1]:
            tr.set_label(o, 1, lab.ids)
        return
    unknown(tr, name, args, kwargs, out)


def pad(tr: "TraceRecorder", name: str, args: tuple, kwargs: dict, out: Any) -> None:
    x = args[0]
    lab = tr.label_of(x)
    if lab is None:
        return
    spec = list(arg(args, kwargs, 1, "pad", ()))
    padded = {x.dim() - 1 - i // 2 for i, p in enumerate(spec) if p != 0}
    if lab.dim in padded:
        return unknown(tr, name, args, kwargs, out)
    tr.set_label(out, lab.dim, lab.ids)


# ----------------------------------------------------------------------------- reductions


def reduction(tr: "TraceRecorder", name: str, args: tuple, kwargs: dict, out: Any) -> None:
    x = args[0] if args else kwargs.get("input")
    lab = tr.label_of(x)
    if lab is None:
        return
    dim = arg(args, kwargs, 1, "dim")
    if name in ("max", "min") and isinstance(dim, torch.Tensor):  # torch.max(a, b): elementwise
        return elementwise(tr, name, args, kwargs, out)
    if name == "norm":
        dim = arg(args, kwargs, 2, "dim")
    keepdim = bool(arg(args, kwargs, 2 if name != "norm" else 3, "keepdim", False))
    if dim is None or isinstance(dim, str):
        return unknown(tr, name, args, kwargs, out)
    dims = [norm_dim(int(v), x.dim()) for v in (dim if isinstance(dim, (list, tuple)) else [dim])]
    if lab.dim in dims:
        return unknown(tr, name, args, kwargs, out)
    d = lab.dim if keepdim else lab.dim - sum(1 for i in dims if i < lab.dim)
    for o in tensors_in(out):
        tr.set_label(o, d, lab.ids)


def along_dim(tr: "TraceRecorder", name: str, args: tuple, kwargs: dict, out: Any) -> None:
    x = args[0]
    lab = tr.label_of(x)
    if lab is None:
        return
    dim = arg(args, kwargs, 1, "dim")
    if dim is None or norm_dim(int(dim), x.dim()) == lab.dim:
        return unknown(tr, name, args, kwargs, out)
    tr.set_label(out, lab.dim, lab.ids)


RULES: dict[str, Rule] = {}
RULES.update({n: elementwise for n in ELEMENTWISE})
RULES.update({n: spatial for n in SPATIAL})
RULES.update({n: reduction for n in REDUCTIONS})
RULES.update({n: along_dim for n in ALONG_DIM})
RULES.update(SHAPE_RULES)
RULES.update({"pad": pad})


def apply_rule(tr: "TraceRecorder", name: str, args: tuple, kwargs: dict, out: Any) -> None:
    """Run the rule of torch function ``name`` (:func:`unknown` if it has none)."""
    RULES.get(name, unknown)(tr, name, args, kwargs, out)
