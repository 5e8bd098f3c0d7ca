"""How torch functions carry channel labels (the tracer's rule table).

Each rule receives the tracer, the function's arguments and its output and sets the labels
of the output tensors. A function with a labelled input and no rule pins every channel it
touches (safe: those channels are never searched). Rules only pass a label through when the
function treats every channel on its own, so that removing a channel changes nothing else.

Example:
    >>> "add_" in ELEMENTWISE and "conv2d" not in RULES
    True
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import torch

from dmscale.trace.graph import PIN, Label
from dmscale.trace.values import tensors_in

if TYPE_CHECKING:
    from dmscale.trace.protocol import TraceRecorder

__all__ = ["RULES", "ELEMENTWISE", "apply_rule"]

Rule = Callable[["TraceRecorder", str, tuple, dict, Any], None]

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


def _arg(args: tuple, kwargs: dict, pos: int, name: str, default: Any = None) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[pos] if len(args) > pos else default


def _norm_dim(d: int, n: int) -> int:
    return d + n if d < 0 else d


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
    spec = list(_arg(args, kwargs, 1, "pad", ()))
    padded = {x.dim() - 1 - i // 2 for i, p in enumerate(spec) if p != 0}
    if lab.dim in padded:
        return unknown(tr, name, args, kwargs, out)
    tr.set_label(out, lab.dim, lab.ids)


# ----------------------------------------------------------------------------- shapes


def reshape_label(in_shape: Sequence[int], lab: Label, out_shape: Sequence[int]) -> Label | None:
    """Where the labelled dim of ``in_shape`` lands in ``out_shape`` (None: it is split)."""
    d, c = lab.dim, in_shape[lab.dim]
    pre = math.prod(in_shape[:d])
    acc, j = 1, 0
    while j < len(out_shape) and acc < pre:
        acc *= out_shape[j]
        j += 1
    if acc != pre:
        return None
    while j < len(out_shape) - 1 and out_shape[j] == 1 and c != 1:
        j += 1
    if j >= len(out_shape):
        return None
    o = out_shape[j]
    if o == c:
        return Label(j, lab.ids)
    if o > c and o % c == 0:  # merged with the following dims: each id repeats
        inner, e, acc2 = o // c, d + 1, 1
        while e < len(in_shape) and acc2 < inner:
            acc2 *= in_shape[e]
            e += 1
        if acc2 == inner:
            return Label(j, np.repeat(lab.ids, inner))
        return None
    if o < c and c % o == 0:  # un-flatten of a repeated label
        block = c // o
        grid = lab.ids.reshape(o, block)
        if (grid == grid[:, :1]).all() and math.prod(out_shape[j + 1:]) % block == 0:
            return Label(j, grid[:, 0].copy())
    return None


def view(tr: "TraceRecorder", name: str, args: tuple, kwargs: dict, out: Any) -> None:
    x = args[0]
    lab = tr.label_of(x)
    if lab is None:
        return
    new = reshape_label(tuple(x.shape), lab, tuple(out.shape))
    if new is None:
        # the new sizes may come from another tensor's width (C // heads): fix that width too
        tr.pin_size_reads(f"{name} splits channels into sizes written in the model code")
        return unknown(tr, name, args, kwargs, out)
    if len(new.ids) == out.shape[new.dim]:  # the channels kept their own dim
        _tie_requested_size(tr, name, args, kwargs, new)
    tr.set_label(out, new.dim, new.ids)


def _requested_shape(name: str, args: tuple, kwargs: dict) -> list[Any] | None:
    """The sizes a ``view``/``reshape`` call asked for, as written (-1 included)."""
    if name not in ("view", "reshape"):
        return None
    shape = kwargs.get("shape", kwargs.get("size"))
    if shape is None:
        rest = args[1:]
        shape = rest[0] if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else rest
    shape = list(shape) if isinstance(shape, (list, tuple)) else None
    return shape if shape is not None and all(isinstance(s, int) for s in shape) else None


def _tie_requested_size(tr: "TraceRecorder", name: str, args: tuple, kwargs: dict, new: Label) -> None:
    """Tie the channels of a reshape to the width its size was taken from.

    ``B, N, C = x.shape; sr(x).reshape(B, C, -1)`` (timm PVT-v2) writes ``x``'s width as the
    size of ``sr``'s channels: after pruning the two must still be equal, so they become one
    dimension (position by position). ``y.reshape_as(other)`` ties to ``other``'s channels.
    """
    if name in ("view_as", "reshape_as"):
        other = tr.label_of(args[1]) if len(args) > 1 else None
        if other is not None and other.dim == new.dim and len(other.ids) == len(new.ids):
            tr.uf.union_arrays(other.ids, new.ids)
        return
    shape = _requested_shape(name, args, kwargs)
    if shape is not None and new.dim < len(shape) and shape[new.dim] != -1:
        tr.tie_size_reads(new.ids)


def permute(tr: "TraceRecorder", name: str, args: tuple, kwargs: dict, out: Any) -> None:
    x = args[0]
    lab = tr.label_of(x)
    if lab is None:
        return
    n = x.dim()
    if name == "permute":
        dims = kwargs.get("dims") or (args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:])
        dims = [_norm_dim(int(v), n) for v in dims]
        tr.set_label(out, dims.index(lab.dim), lab.ids)
        return
    if name in ("transpose", "swapaxes", "swapdims", "transpose_"):
        a = _norm_dim(int(_arg(args, kwargs, 1, "dim0")), n)
        b = _norm_dim(int(_arg(args, kwargs, 2, "dim1")), n)
        d = b if lab.dim == a else a if lab.dim == b else lab.dim
        tr.set_label(out, d, lab.ids)
        return
    if name == "t":
        tr.set_label(out, (1 - lab.dim) if n == 2 else lab.dim, lab.ids)
        return
    if name in ("movedim", "moveaxis"):
        src = _arg(args, kwargs, 1, "source")
        dst = _arg(args, kwargs, 2, "destination")
        order = np.moveaxis(np.zeros(tuple(range(1, n + 1))), src, dst).shape
        tr.set_label(out, order.index(lab.dim + 1), lab.ids)
        return
    unknown(tr, name, args, kwargs, out)


def unsqueeze(tr: "TraceRecorder", name: str, args: tuple, kwargs: dict, out: Any) -> None:
    x = args[0]
    lab = tr.label_of(x)
    if lab is None:
        return
    dim = _norm_dim(int(_arg(args, kwargs, 1, "dim")), x.dim() + 1)
    tr.set_label(out, lab.dim + (1 if dim <= lab.dim else 0), lab.ids)


def squeeze(tr: "TraceRecorder", name: str, args: tuple, kwargs: dict, out: Any) -> None:
    x = args[0]
    lab = tr.label_of(x)
    if lab is None:
        return
    dim = _arg(args, kwargs, 1, "dim")
    if dim is None:
        dims = [i for i, s in enumerate(x.shape) if s == 1]
    else:
        dims = [_norm_dim(int(v), x.dim()) for v in (dim if isinstance(dim, (list, tuple)) else [dim])]
        dims = [i for i in dims if x.shape[i] == 1]
    if lab.dim in dims:
        return unknown(tr, name, args, kwargs, out)
    tr.set_label(out, lab.dim - sum(1 for i in dims if i < lab.dim), lab.ids)


def expand(tr: "TraceRecorder", name: str, args: tuple, kwargs: dict, out: Any) -> None:
    x = args[0]
    lab = tr.label_of(x)
    if lab is None:
        return
    d = lab.dim + out.dim() - x.dim()
    if out.shape[d] != x.shape[lab.dim]:
        return unknown(tr, name, args, kwargs, out)
    tr.set_label(out, d, lab.ids)


def getitem(tr: "TraceRecorder", name: str, args: tuple, kwargs: dict, out: Any) -> None:
    x, index = args[0], args[1]
    lab = tr.label_of(x)
    if lab is None or not isinstance(out, torch.Tensor):
        return
    index = index if isinstance(index, tuple) else (index,)
    if any(isinstance(i, (torch.Tensor, list, bool)) for i in index):
        return unknown(tr, name, args, kwargs, out)
    n_explicit = sum(1 for i in index if i is not None and i is not Ellipsis)
    expanded: list[Any] = []
    for i in index:
        if i is Ellipsis:
            expanded.extend([slice(None)] * (x.dim() - n_explicit))
        else:
            expanded.append(i)
    expanded.extend([slice(None)] * (x.dim() - sum(1 for i in expanded if i is not None)))
    in_dim = out_dim = 0
    for i in expanded:
        if i is None:
            out_dim += 1
            continue
        if in_dim == lab.dim:
            if isinstance(i, slice) and i == slice(None):
                tr.set_label(out, out_dim, lab.ids)
                return
            # a hard-coded channel range would select other channels once some are removed
            return unknown(tr, name, args, kwargs, out)
        if isinstance(i, slice):
            out_dim += 1
        in_dim += 1
    unknown(tr, name, args, kwargs, out)


def split(tr: "TraceRecorder", name: str, args: tuple, kwargs: dict, out: Any) -> None:
    x = args[0]
    lab = tr.label_of(x)
    if lab is None:
        return
    outs = tensors_in(out)
    pos = {"chunk": 2, "split": 2, "tensor_split": 2, "split_with_sizes": 2, "unbind": 1,
           "narrow": 1}[name]
    dim = _norm_dim(int(_arg(args, kwargs, pos, "dim", 0)), x.dim())
    if name == "unbind":
        if dim == lab.dim:
            return unknown(tr, name, args, kwargs, out)
        for o in outs:
            tr.set_label(o, lab.dim - (1 if dim < lab.dim else 0), lab.ids)
        return
    if dim != lab.dim:
        for o in outs:
            tr.set_label(o, lab.dim, lab.ids)
        return
    sizes = {o.shape[dim] for o in outs}
    # split() takes sizes written in the model code: they would not follow a pruned width
    if name != "chunk" or len(sizes) != 1 or len(outs) * sizes.pop() != len(lab.ids):
        # hard-coded sizes or offsets would take the wrong channels once some are removed
        return unknown(tr, name, args, kwargs, out)
    # equal parts stay equal only if they are pruned alike: tie part i's channel j to part 0's
    parts = np.split(lab.ids, len(outs))
    for part in parts[1:]:
        tr.uf.union_arrays(parts[0], part)
    for o, part in zip(outs, parts):
        tr.set_label(o, dim, part)


def cat(tr: "TraceRecorder", name: str, args: tuple, kwargs: dict, out: Any) -> None:
    parts = list(_arg(args, kwargs, 0, "tensors"))
    labs = [tr.label_of(t) for t in parts]
    if all(lab is None for lab in labs):
        return
    n = out.dim() if name != "stack" else out.dim() - 1
    dim = _norm_dim(int(_arg(args, kwargs, 1, "dim", 0)), n if name != "stack" else n + 1)
    label_dims = {lab.dim for lab in labs if lab is not None}
    if len(label_dims) > 1:
        return unknown(tr, name, args, kwargs, out)
    d = label_dims.pop()
    if name != "stack" and dim == d:
        ids = [lab.ids if lab is not None else np.full(t.shape[d], PIN, dtype=np.int64)
               for t, lab in zip(parts, labs)]
        tr.set_label(out, d, np.concatenate(ids))
        return
    ref = next(lab for lab in labs if lab is not None)
    for t, lab in zip(parts, labs):  # unlabelled part next to labelled channels
        if lab is None and not tr.label_param(t, ref.dim - (out.dim() - t.dim()) if name != "stack" else ref.dim, ref.ids):
            tr.pin_ids(ref.ids, f"{name} with an unlabelled part")
            return
    labs = [lab for lab in labs if lab is not None]
    first = labs[0].ids
    for lab in labs[1:]:
        tr.uf.union_arrays(first, lab.ids)
    out_d = d + (1 if name == "stack" and dim <= d else 0)
    tr.set_label(out, out_d, first)


def reduction(tr: "TraceRecorder", name: str, args: tuple, kwargs: dict, out: Any) -> None:
    x = args[0] if args else kwargs.get("input")
    lab = tr.label_of(x)
    if lab is None:
        return
    dim = _arg(args, kwargs, 1, "dim")
    if name in ("max", "min") and isinstance(dim, torch.Tensor):  # torch.max(a, b): elementwise
        return elementwise(tr, name, args, kwargs, out)
    if name == "norm":
        dim = _arg(args, kwargs, 2, "dim")
    keepdim = bool(_arg(args, kwargs, 2 if name != "norm" else 3, "keepdim", False))
    if dim is None or isinstance(dim, str):
        return unknown(tr, name, args, kwargs, out)
    dims = [_norm_dim(int(v), x.dim()) for v in (dim if isinstance(dim, (list, tuple)) else [dim])]
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
    dim = _arg(args, kwargs, 1, "dim")
    if dim is None or _norm_dim(int(dim), x.dim()) == lab.dim:
        return unknown(tr, name, args, kwargs, out)
    tr.set_label(out, lab.dim, lab.ids)


def unknown(tr: "TraceRecorder", name: str, args: tuple, kwargs: dict, out: Any) -> None:
    """No rule: every labelled channel it touches is pinned; outputs carry no label."""
    for t in tensors_in(args) + tensors_in(kwargs):
        lab = tr.label_of(t)
        if lab is not None:
            tr.pin_ids(lab.ids, f"function {name!r} has no channel rule")


RULES: dict[str, Rule] = {}
RULES.update({n: elementwise for n in ELEMENTWISE})
RULES.update({n: spatial for n in SPATIAL})
RULES.update({n: reduction for n in REDUCTIONS})
RULES.update({n: along_dim for n in ALONG_DIM})
RULES.update({n: view for n in ("view", "reshape", "flatten", "view_as", "reshape_as", "unflatten")})
RULES.update({n: permute for n in ("permute", "transpose", "transpose_", "swapaxes", "swapdims",
                                   "t", "movedim", "moveaxis")})
RULES.update({n: split for n in ("chunk", "split", "tensor_split", "split_with_sizes", "unbind", "narrow")})
RULES.update({n: cat for n in ("cat", "concat", "concatenate", "stack")})
RULES.update({"unsqueeze": unsqueeze, "squeeze": squeeze, "expand": expand,
              "expand_as": expand, "broadcast_to": expand, "__getitem__": getitem, "pad": pad})


def apply_rule(tr: "TraceRecorder", name: str, args: tuple, kwargs: dict, out: Any) -> None:
    RULES.get(name, unknown)(tr, name, args, kwargs, out)
