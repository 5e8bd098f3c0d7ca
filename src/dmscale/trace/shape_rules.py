"""Function rules for tensors that keep their values but move them: reshapes, permutes,
size-1 dims, expands, indexing, splits and concats.

Each rule follows the labelled dim through the new layout. A rule pins the channels when the
new layout depends on sizes or offsets written in the model code (a hard-coded slice, a split
into given sizes): those would select other channels once some are removed.

Example:
    >>> import numpy as np
    >>> from dmscale.trace.graph import Label
    >>> reshape_label((2, 8, 4, 4), Label(1, np.arange(8)), (2, 8, 16)).dim
    1
    >>> flat = reshape_label((2, 8, 4, 4), Label(1, np.arange(8)), (2, 128))  # each id 16 times
    >>> flat.dim, len(flat.ids), flat.ids[14:18].tolist()
    (1, 128, [0, 0, 1, 1])
    >>> sorted(SHAPE_RULES)[:4]
    ['__getitem__', 'broadcast_to', 'cat', 'chunk']
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

from dmscale.trace.graph import PIN, Label
from dmscale.trace.rule_base import Rule, arg, norm_dim, unknown
from dmscale.trace.values import tensors_in

if TYPE_CHECKING:
    from dmscale.trace.protocol import TraceRecorder

__all__ = ["SHAPE_RULES", "reshape_label"]


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
        dims = [norm_dim(int(v), n) for v in dims]
        tr.set_label(out, dims.index(lab.dim), lab.ids)
        return
    if name in ("transpose", "swapaxes", "swapdims", "transpose_"):
        a = norm_dim(int(arg(args, kwargs, 1, "dim0")), n)
        b = norm_dim(int(arg(args, kwargs, 2, "dim1")), n)
        d = b if lab.dim == a else a if lab.dim == b else lab.dim
        tr.set_label(out, d, lab.ids)
        return
    if name == "t":
        tr.set_label(out, (1 - lab.dim) if n == 2 else lab.dim, lab.ids)
        return
    if name in ("movedim", "moveaxis"):
        src = arg(args, kwargs, 1, "source")
        dst = arg(args, kwargs, 2, "destination")
        order = np.moveaxis(np.zeros(tuple(range(1, n + 1))), src, dst).shape
        tr.set_label(out, order.index(lab.dim + 1), lab.ids)
        return
    unknown(tr, name, args, kwargs, out)


def unsqueeze(tr: "TraceRecorder", name: str, args: tuple, kwargs: dict, out: Any) -> None:
    x = args[0]
    lab = tr.label_of(x)
    if lab is None:
        return
    dim = norm_dim(int(arg(args, kwargs, 1, "dim")), x.dim() + 1)
    tr.set_label(out, lab.dim + (1 if dim <= lab.dim else 0), lab.ids)


def squeeze(tr: "TraceRecorder", name: str, args: tuple, kwargs: dict, out: Any) -> None:
    x = args[0]
    lab = tr.label_of(x)
    if lab is None:
        return
    dim = arg(args, kwargs, 1, "dim")
    if dim is None:
        dims = [i for i, s in enumerate(x.shape) if s == 1]
    else:
        dims = [norm_dim(int(v), x.dim()) for v in (dim if isinstance(dim, (list, tuple)) else [dim])]
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
    dim = norm_dim(int(arg(args, kwargs, pos, "dim", 0)), x.dim())
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
    parts = list(arg(args, kwargs, 0, "tensors"))
    labs = [tr.label_of(t) for t in parts]
    if all(lab is None for lab in labs):
        return
    n = out.dim() if name != "stack" else out.dim() - 1
    dim = norm_dim(int(arg(args, kwargs, 1, "dim", 0)), n if name != "stack" else n + 1)
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


SHAPE_RULES: dict[str, Rule] = {}
SHAPE_RULES.update({n: view for n in ("view", "reshape", "flatten", "view_as", "reshape_as", "unflatten")})
SHAPE_RULES.update({n: permute for n in ("permute", "transpose", "transpose_", "swapaxes", "swapdims",
                                         "t", "movedim", "moveaxis")})
SHAPE_RULES.update({n: split for n in ("chunk", "split", "tensor_split", "split_with_sizes", "unbind", "narrow")})
SHAPE_RULES.update({n: cat for n in ("cat", "concat", "concatenate", "stack")})
SHAPE_RULES.update({"unsqueeze": unsqueeze, "squeeze": squeeze, "expand": expand,
                    "expand_as": expand, "broadcast_to": expand, "__getitem__": getitem})
