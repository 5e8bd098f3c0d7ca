"""Turn a finished trace into a :class:`~dmscale.trace.space.SearchSpace`: group the channel
ids the tracer tied together into width dimensions, give every channel its slot in the mask
(``-1`` when it is fixed), add the derived slots of products (heads x head dim) and say why
each fixed producer is fixed.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from dmscale.trace.tracer import Tracer
    >>> tr = Tracer(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    >>> _ = tr.run(torch.randn(1, 4))
    >>> space = build_space(tr, [], {}, 0)
    >>> [(d.name, d.size) for d in space.width], space.layers["2"].in_slots.tolist()
    ([('0', 8)], [0, 1, 2, 3, 4, 5, 6, 7])
    >>> space.pinned_reasons["2"]
    'model output'
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from dmscale.trace.blocks import group_stages
from dmscale.trace.graph import PIN, LayerRecord, UnionFind
from dmscale.trace.handlers.base import handler_for
from dmscale.trace.space import Block, LayerSlots, SearchSpace, WidthDim

if TYPE_CHECKING:
    from dmscale.trace.tracer import Tracer

__all__ = ["build_space"]


def build_space(tr: Tracer, blocks: list[tuple[str, Block]], module_macs: dict[str, int], total_macs: int) -> SearchSpace:
    """The :class:`SearchSpace` of a finished trace: width dims, slots, derived slots, stages."""
    uf = tr.uf
    rec_macs = {n: tr.virtual_macs(n, module_macs) for n, r in tr.layers.items() if r.virtual}
    rec_macs.update({n: r.macs_override for n, r in tr.layers.items() if r.macs_override is not None})
    # second-level union: all channels produced by one layer belong to one dimension
    dim_uf = UnionFind()
    root_token: dict[int, int] = {}

    def token(root: int) -> int:
        if root == PIN:
            return PIN
        if root not in root_token:
            root_token[root] = int(dim_uf.new(1)[0])
        return root_token[root]

    for _, ids in tr.produced:
        toks = [token(uf.find(x)) for x in ids.tolist()]
        for t in toks[1:]:
            dim_uf.union(toks[0], t)
    # slots: each element root gets (dim, slot) in order of first production
    dims: dict[int, WidthDim] = {}
    slot_of_root: dict[int, tuple[int, int]] = {}
    reasons: dict[str, str] = {}
    order: list[int] = []
    for name, ids in tr.produced:
        for x in ids.tolist():
            r = uf.find(x)
            if r == PIN or r in slot_of_root:
                continue
            droot = dim_uf.find(token(r))
            if droot == PIN:
                continue
            if droot not in dims:
                dims[droot] = WidthDim(name, 0, [], tr.produced_kind.get(name, "width"))
                order.append(droot)
            d = dims[droot]
            if name not in d.producers:
                d.producers.append(name)
            slot_of_root[r] = (droot, d.size)
            d.size += 1
    for name, ids in tr.produced:  # every producer, and the part of a width it writes
        local = sorted({slot_of_root[uf.find(x)][1] for x in ids.tolist() if uf.find(x) in slot_of_root})
        if not local:
            continue
        droot = slot_of_root[uf.find(int(ids[0]))][0] if uf.find(int(ids[0])) in slot_of_root else None
        if droot is None:
            continue
        d = dims[droot]
        if name not in d.producers:
            d.producers.append(name)
        if len(local) < d.size and local not in d.required:
            d.required.append(local)
    for name, ids in tr.produced:  # report why a producer's channels are fixed
        r = uf.find(int(ids[0]))
        if r == PIN or dim_uf.find(token(r)) == PIN:
            reasons[name] = _pin_reason(tr, ids)
    width = [dims[r] for r in order]
    offset = {r: o for r, o in zip(order, np.cumsum([0] + [d.size for d in width[:-1]]).tolist())}

    def base_slot(x: int) -> int:
        r = uf.find(x)
        if r not in slot_of_root:
            return -1
        droot, s = slot_of_root[r]
        return offset[droot] + s

    n_base = sum(d.size for d in width)
    derived: list[tuple[int, int]] = []
    derived_of_root: dict[int, int] = {}
    for pid, (a, b) in tr.products.items():
        r = uf.find(pid)
        if r == PIN or r in derived_of_root:
            continue
        sa, sb = base_slot(a), base_slot(b)
        if sa < 0 and sb < 0:
            continue
        derived_of_root[r] = n_base + len(derived)
        derived.append((sa, sb))

    def slots(ids: np.ndarray | None) -> np.ndarray | None:
        if ids is None:
            return None
        out = np.full(len(ids), -1, dtype=np.int64)
        for i, x in enumerate(ids.tolist()):
            r = uf.find(x)
            out[i] = derived_of_root[r] if r in derived_of_root else base_slot(x)
        return out

    modules = dict(tr.model.named_modules())

    def sides(rec: LayerRecord) -> tuple[str, ...]:
        if rec.macs_sides is not None:
            return rec.macs_sides
        m = modules[rec.name]
        return handler_for(m).macs_dims(m)

    layers = {
        name: LayerSlots(name, rec.handler, slots(rec.in_ids), slots(rec.out_ids),
                         rec_macs.get(name, module_macs.get(name, 0)), sides(rec), rec.virtual, rec.masked_norm,
                         rec.mask_output)
        for name, rec in tr.layers.items()
    }
    params = {name: (k, slots(ids)) for name, (k, ids) in tr.param_labels.items()}
    params = {name: (k, sl) for name, (k, sl) in params.items() if (sl >= 0).any()}  # fixed: never sliced
    depth = group_stages(tr.model, blocks)
    return SearchSpace(width, depth, layers, reasons, total_macs, module_macs, params, derived)


def _pin_reason(tr: Tracer, ids: np.ndarray) -> str:
    for x in ids.tolist():  # a reason is stored under the set's root at the time of pinning
        if x in tr.pin_reasons:
            return tr.pin_reasons[x]
    return "tied (residual add, concat, ...) to channels that are fixed"
