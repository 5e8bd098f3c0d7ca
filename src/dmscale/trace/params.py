"""Parameter tracking for the tracer: which traced tensors are model parameters or views of
them, which parameters are sliced along channels, and which are read some other way.

Layers without a handler are traced through, so a parameter that meets channels element-wise
(a layer scale, a position embedding) is sliced with them. That is safe only if nothing else
reads it: :meth:`ParamTracker.pin_shared_params` fixes the channels of a parameter that is
also read unsliced. :class:`~dmscale.trace.tracer.Tracer` mixes this class in.

Example:
    >>> import numpy as np
    >>> from torch import nn
    >>> from dmscale.trace.graph import UnionFind
    >>> class Recorder(ParamTracker):
    ...     def __init__(self, model: nn.Module) -> None:
    ...         self.uf, self.layers = UnionFind(), {}
    ...         self._init_param_tracking(model)
    ...     def pin_ids(self, ids: np.ndarray, reason: str) -> None:
    ...         pass
    >>> lin = nn.Linear(2, 3)
    >>> rec = Recorder(lin)
    >>> rec.param_source(lin.bias)
    ('bias', {0: 0})
    >>> rec.label_param(lin.bias, 0, rec.uf.new(3)), rec.param_labels["bias"][0]
    (True, 0)
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from dmscale.trace.graph import LayerRecord, UnionFind

__all__ = ["ParamTracker", "SHAPE_READS"]

# functions that read a tensor's metadata, not its values
SHAPE_READS = {"__get__", "size", "dim", "ndimension", "numel", "stride", "is_contiguous",
               "data_ptr", "element_size", "nelement", "__len__", "is_floating_point",
               "is_complex", "get_device", "storage_offset", "__repr__", "__format__"}

# ops whose output is the parameter's values again, dims right-aligned (expand adds dims)
_PARAM_VIEWS = {"expand", "expand_as", "to", "type_as", "float", "half", "bfloat16",
                "contiguous", "clone", "detach", "broadcast_to"}
# ops that only add or drop size-1 dims of a parameter (gamma.view(1, -1, 1, 1))
_PARAM_RESHAPES = {"view", "reshape", "unsqueeze", "squeeze", "flatten", "view_as", "reshape_as"}


class ParamTracker:
    """The parameter bookkeeping of a trace, mixed into the tracer.

    The host class provides ``uf``, ``layers`` and ``pin_ids`` and calls
    :meth:`_init_param_tracking` from its ``__init__``.
    """

    uf: UnionFind
    layers: dict[str, LayerRecord]
    pin_ids: Callable[[np.ndarray, str], None]

    def _init_param_tracking(self, model: nn.Module) -> None:
        self.param_labels: dict[str, tuple[int, np.ndarray]] = {}
        # id(tensor) -> (tensor, param name, {tensor dim: param dim}) for views of parameters
        self.param_derived: dict[int, tuple[torch.Tensor, str, dict[int, int]]] = {}
        self.param_seen: set[str] = set()  # parameters some traced function read
        # parameter -> functions that read it without slicing it along channels
        self.param_other_uses: dict[str, set[str]] = {}
        self._labelled_now: set[str] = set()  # parameters labelled by the current function
        self.params = {id(p): n for n, p in model.named_parameters()}

    def _derive_param_view(self, name: str, src: torch.Tensor, out: torch.Tensor) -> None:
        """If ``out`` is a view of a parameter (``gamma.view(1, -1, 1, 1)``, an expand, a
        dtype cast), remember which of its dims are which of the parameter's."""
        source = self.param_source(src)
        if source is None:
            return
        pname, mapping = source
        if name in _PARAM_VIEWS:  # right-aligned; expanded dims were size 1 (unmapped)
            shift = out.dim() - src.dim()
            self.param_derived[id(out)] = (out, pname, {d + shift: k for d, k in mapping.items()})
        elif name in _PARAM_RESHAPES:  # only size-1 dims come or go: the others keep order
            big_in = [d for d in range(src.dim()) if src.shape[d] > 1]
            big_out = [d for d in range(out.dim()) if out.shape[d] > 1]
            if [src.shape[d] for d in big_in] == [out.shape[d] for d in big_out]:
                moved = {a: b for a, b in zip(big_in, big_out)}
                self.param_derived[id(out)] = (out, pname, {moved[d]: k for d, k in mapping.items() if d in moved})

    def _note_param_uses(self, name: str, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        """Record which parameters ``name`` read, and whether it sliced them along channels."""
        if name in SHAPE_READS and not outs:
            return
        for t in ins:
            source = self.param_source(t)
            if source is None:
                continue
            pname = source[0]
            self.param_seen.add(pname)
            view = len(outs) == 1 and self.param_derived.get(id(outs[0]), (None,))[0] is outs[0]
            if pname not in self._labelled_now and not view:
                self.param_other_uses.setdefault(pname, set()).add(name)

    def pin_shared_params(self) -> None:
        """A parameter sliced along channels must be read only where it is sliced: a
        parameter also read by another function (``F.linear(x, w)``, ``w.sum()``) or sliced
        by its layer's handler too keeps its channels (and those it meets) fixed."""
        for pname, (_, ids) in self.param_labels.items():
            others = self.param_other_uses.get(pname)
            owner = pname.rpartition(".")[0]
            if others:
                self.pin_ids(ids, f"parameter {pname} is also read by {', '.join(sorted(others))}")
            elif owner in self.layers:
                self.pin_ids(ids, f"parameter {pname} belongs to the handled layer {owner}")

    def param_source(self, t: Any) -> tuple[str, dict[int, int]] | None:
        """(parameter name, {dim of ``t``: dim of the parameter}) if ``t`` is a model
        parameter or a view of one; only dims of size > 1 are mapped."""
        if not isinstance(t, torch.Tensor):
            return None
        if id(t) in self.params and isinstance(t, nn.Parameter):
            return self.params[id(t)], {d: d for d in range(t.dim()) if t.shape[d] > 1}
        entry = self.param_derived.get(id(t))
        if entry is None or entry[0] is not t:
            return None
        return entry[1], entry[2]

    def label_param(self, t: torch.Tensor, dim: int, ids: np.ndarray) -> bool:
        """Record that the parameter ``t`` is (or views) carries ``ids`` along ``t``'s ``dim``."""
        src = self.param_source(t)
        if src is None:
            return False
        pname, mapping = src
        k = mapping.get(dim)
        if k is None:
            return False
        self._labelled_now.add(pname)
        if pname in self.param_labels:
            prev_dim, prev = self.param_labels[pname]
            if prev_dim != k or len(prev) != len(ids):
                self.pin_ids(ids, f"parameter {pname} used with two channel layouts")
                return True
            self.uf.union_arrays(prev, ids)
        else:
            self.param_labels[pname] = (k, ids)
        return True
