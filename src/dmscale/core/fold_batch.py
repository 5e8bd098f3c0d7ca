"""The weight folds of a forward in a few autograd nodes (eager mode).

Folded one layer at a time (:mod:`dmscale.core.weight_masks`), each mask costs about six
operators per training step: its view, ``W * m``, and in the backward ``g * m``, ``g * W``, the
sum of that over the weight's other dims and the view's backward. A ResNet-50 has 65 folds, a
ViT-B 85 and a 30-layer Llama 271. Here the foldable layers, in the model's order, are
:data:`CHUNKS` :class:`FoldAll` nodes (:class:`ForwardFolds`), each computed when one of its
layers is first called:

* forward: the masks' views in one split per view shape and one unbind of the depth masks,
  then one ``torch._foreach_mul`` per pass (pass j: every layer's j-th fold, in the order its
  hooks multiply, so each weight gets exactly the product the per-layer hooks compute);
* backward, pass by pass in reverse: ``g * m`` for every tensor in one ``_foreach_mul``, ``g * W``
  in one more, then per fold the sum over the weight's other dims (the mask's gradient: the same
  reduction the per-layer multiply's backward takes) added into the block's and the depth
  masks' gradients in one ``_foreach_add_`` each.

The values are the per-layer hooks' to the bit, the gradients up to the order of float
additions. The batch issues fewer operators per step; it does not save host time on the CPU,
where a ``_foreach_mul`` over tensors of different shapes multiplies them one by one inside, so on
a GPU it saves at most one kernel of the few each fold launches (:data:`ENABLED` turns it off).

A layer is left to its own hooks where the batch cannot stand for them: a grouped
convolution's input fold (its mask is gathered per weight entry), a weight or bias that is not
a plain parameter (FSDP's sharded DTensor, a parametrisation) or not on the masks' device, a
call under saved-tensor hooks (an activation checkpoint recomputes the layer in the backward),
and for the call, a fold that takes the smaller multiply on the activation
(:meth:`~dmscale.core.weight_masks.Unfold.install_batched`).

Example:
    >>> import torch
    >>> w, b = torch.randn(3, 2, requires_grad=True), torch.randn(3, requires_grad=True)
    >>> block = torch.rand(5, requires_grad=True)  # segments: 2 input channels, 3 output channels
    >>> plan = FoldPlan(sizes=[2, 3], passes=[[Multiply(0, "c", 0, 0, (0,)), Multiply(1, "c", 1, 0, ())],
    ...                                       [Multiply(0, "c", 1, 1, (1,))]])
    >>> fw, fb = FoldAll.apply(plan, block, torch.zeros(0), w, b)  # returns the folded tensors
    >>> m_in, m_out = block.split([2, 3])
    >>> torch.equal(fw, w * m_in * m_out[:, None]), torch.equal(fb, b * m_out)
    (True, True)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import nn
from torch.autograd.function import once_differentiable

__all__ = ["ENABLED", "CHUNKS", "MIN_CHUNK_BYTES", "Multiply", "FoldPlan", "FoldAll", "ForwardFolds",
           "outside_checkpoint", "saving_hooks_active"]

# the batch is split into this many nodes (by the layers' order, each about as many weight bytes):
# a node's backward runs once the last of its layers' gradients arrived, so one node for the whole
# model would hold every folded weight's incoming gradient until the end of the backward and hand
# DDP every weight gradient at once; in quarters, a quarter at most, and DDP overlaps the rest.
# A chunk holds at least DDP's default bucket (25 MiB): below that DDP itself waits as long, and
# each node costs about twenty operators (a small CNN is one node)
CHUNKS = 4
MIN_CHUNK_BYTES = 25 * 2**20

# False: every layer folds on its own (the per-layer hooks, as before the batch), from the next
# forward on; the same values, the gradients up to the order of float additions. For measuring
# what the batch gains and for debugging, as torch.backends' flags are
ENABLED = True


@dataclass(frozen=True)
class Multiply:
    """One fold of one tensor: ``t * m`` with m a segment of the block (``source="c"``, the
    segment's index, viewed as (C,) + (1,) * ``trailing``) or a () depth mask (``"d"``, its flat
    block index); ``dims``: the tensor's dims that m's gradient sums over; ``group``: the
    multiplies of one group (a batch norm's weight and bias times one depth mask, which its own
    hook multiplies as one (2, C) stack) have m's gradient summed as one reduction, in their
    order, as the stack's is (the same bits); -1: none."""

    tensor: int
    source: str
    index: int
    trailing: int
    dims: tuple[int, ...]
    group: int = -1


@dataclass
class FoldPlan:
    """The folds of a forward: ``sizes`` of the block's segments, per pass the multiplies
    (pass j holds every tensor's j-th fold; a tensor's first fold is in pass 0), and the
    segments handed out as copies, (C,) each, after the folded tensors (``copies``: the masks of
    the layers that multiply their activation this forward, one node for them all too)."""

    sizes: list[int]
    passes: list[list[Multiply]] = field(default_factory=list)
    copies: list[int] = field(default_factory=list)


def _views(plan: FoldPlan, block: torch.Tensor, depth: torch.Tensor,
           current: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Per pass, the mask view of each multiply in its tensor's dtype: one cast per dtype, one
    view and one split of the block per (dtype, view shape), one unbind of the depth masks."""
    made: dict[tuple[str, torch.dtype, int], Any] = {}
    out = []
    for p in plan.passes:
        views = []
        for m in p:
            dtype = current[m.tensor].dtype
            key = (m.source, dtype, m.trailing)
            pieces = made.get(key)
            if pieces is None:
                src = block if m.source == "c" else depth
                src = src if src.dtype == dtype else src.to(dtype)
                if m.source == "d":
                    pieces = src.unbind(0)
                else:  # (C,) + (1,) * trailing per segment
                    pieces = (src.view((-1,) + (1,) * m.trailing) if m.trailing else src).split(plan.sizes)
                made[key] = pieces
            views.append(pieces[m.index])
        out.append(views)
    return out


class FoldAll(torch.autograd.Function):
    """``FoldAll.apply(plan, block, depth, *tensors)``: every tensor times its masks, in the
    order of ``plan``'s passes; returns the folded tensors (one autograd node). ``block``: the
    channel masks, (sum of the segments' C,); ``depth``: the depth masks, (n_blocks,)."""

    @staticmethod
    def forward(ctx: Any, plan: FoldPlan, block: torch.Tensor, depth: torch.Tensor,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        current = list(tensors)
        views = _views(plan, block, depth, current)
        inputs = []
        for p, v in zip(plan.passes, views):
            ins = [current[m.tensor] for m in p]
            for m, out in zip(p, torch._foreach_mul(ins, v)):
                current[m.tensor] = out
            inputs.append(ins)
        copies: list[torch.Tensor] = []
        if plan.copies:
            pieces = block.split(plan.sizes)
            clone = getattr(torch, "_foreach_clone", None)  # (one call; a loop where a torch lacks it)
            wanted = [pieces[i] for i in plan.copies]
            copies = list(clone(wanted)) if clone is not None else [p.clone() for p in wanted]
        ctx.plan, ctx.counts, ctx.n = plan, [len(p) for p in plan.passes], len(tensors)
        ctx.shapes = (block.shape, block.dtype, depth.shape, depth.dtype)
        ctx.save_for_backward(*[t for ins in inputs for t in ins], *[t for v in views for t in v])
        ctx.set_materialize_grads(False)
        return (*current, *copies)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        plan, saved = ctx.plan, list(ctx.saved_tensors)
        n = sum(ctx.counts)
        inputs, views, start = [], [], 0
        for c in ctx.counts:
            inputs.append(saved[start:start + c])
            views.append(saved[n + start:n + start + c])
            start += c
        want_c, want_d = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        g = list(grads[:ctx.n])
        reduced: list[tuple[Multiply, torch.Tensor]] = [
            (Multiply(-1, "c", i, 0, ()), gc) for i, gc in zip(plan.copies, grads[ctx.n:]) if gc is not None and want_c]
        grouped: dict[int, list[tuple[Multiply, torch.Tensor]]] = {}
        for p, ins, v in zip(reversed(plan.passes), reversed(inputs), reversed(views)):
            live = [i for i, m in enumerate(p) if g[m.tensor] is not None]
            if not live:
                continue
            gs = [g[p[i].tensor] for i in live]
            if (want_c and any(p[i].source == "c" for i in live)) or (want_d and any(p[i].source == "d" for i in live)):
                for i, prod in zip(live, torch._foreach_mul(gs, [ins[i] for i in live])):
                    m = p[i]
                    if m.group >= 0:
                        grouped.setdefault(m.group, []).append((m, prod))
                    elif want_c if m.source == "c" else want_d:
                        reduced.append((m, prod.sum(m.dims) if m.dims else prod))
            for i, gi in zip(live, torch._foreach_mul(gs, [v[i] for i in live])):
                g[p[i].tensor] = gi
        for members in grouped.values():  # in plan order, one reduction of them all
            members.sort(key=lambda mp: mp[0].tensor)
            m = members[0][0]
            if want_c if m.source == "c" else want_d:
                parts = [p for _, p in members]
                same = all(p.shape == parts[0].shape for p in parts)  # (a norm's pair: the stack its hook made)
                reduced.append((m, (torch.stack(parts) if same else torch.cat([p.reshape(-1) for p in parts])).sum()))
        block_shape, block_dtype, depth_shape, depth_dtype = ctx.shapes
        grad_block = _accumulate([r for r in reduced if r[0].source == "c"], block_shape, block_dtype,
                                 lambda t: t.split(plan.sizes)) if want_c else None
        grad_depth = _accumulate([r for r in reduced if r[0].source == "d"], depth_shape, depth_dtype,
                                 lambda t: t.unbind(0)) if want_d else None
        tensor_grads = [gi if ctx.needs_input_grad[3 + i] else None for i, gi in enumerate(g)]
        return (None, grad_block, grad_depth, *tensor_grads)


def _accumulate(reduced: list[tuple[Multiply, torch.Tensor]], shape: torch.Size, dtype: torch.dtype,
                pieces: Any) -> torch.Tensor | None:
    """The gradient of the block (or the depth masks): zeros, and each fold's reduced gradient
    added into its piece, one ``_foreach_add_`` per round (a piece read twice: a second round)."""
    if not reduced:
        return None
    device = reduced[0][1].device
    total = torch.zeros(shape, dtype=dtype, device=device)
    views = pieces(total)
    while reduced:
        seen: set[int] = set()
        now, later = [], []
        for m, r in reduced:
            (later if m.index in seen else now).append((m, r))
            seen.add(m.index)
        torch._foreach_add_([views[m.index] for m, _ in now], [r for _, r in now])
        reduced = later
    return total


@contextlib.contextmanager
def outside_checkpoint() -> Iterator[None]:
    """Save what :class:`FoldAll` saves as it is, also where a chunk is computed inside a block
    under non-reentrant activation checkpointing (a layer there that multiplies its activation
    reads its mask from the chunk): the chunk is computed once per forward and its masks are read
    again by the block's recomputation, so checkpointing must neither pack nor expect it."""
    try:
        hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        hooks.__enter__()
    except RuntimeError:  # saved-tensor hooks disabled here: nothing packs them either
        yield
        return
    try:
        yield
    finally:
        hooks.__exit__(None, None, None)


def saving_hooks_active() -> bool:
    """Whether saved-tensor hooks are active here (an activation checkpoint's, an offloader's):
    the layer then folds on its own (its recomputation in the backward folds again, as without
    the batch); otherwise the layer's call is the only reader of its folded weight and the batch
    lets go of it (:meth:`~dmscale.core.forward_masks.ForwardMasks.batched_params`)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return True if top is None else top(False) is not None


@dataclass
class _Chunk:
    """One node of a forward's batch: its layers (module, unfold, position of the weight and of
    the bias among its tensors or None), its plan, and the keys whose masks it hands out."""

    rows: list[tuple[nn.Module, Any, int, int | None]] = field(default_factory=list)
    plan: FoldPlan | None = None
    copied: list[str] = field(default_factory=list)
    groups: int = 0  # the plan's groups of multiplies so far (Multiply.group ids 1 .. groups)


def _foldable(module: nn.Module, device: torch.device) -> bool:
    """Whether the layer's weight and bias are plain parameters on the masks' device (not FSDP's
    sharded DTensors, gathered only in the layer's own pre-forward hook; not a parametrisation)."""
    w, b = module._parameters.get("weight"), module._parameters.get("bias")
    return type(w) is nn.Parameter and w.device == device and (
        b is None or (type(b) is nn.Parameter and b.device == device))


def _chunks(layers: list[tuple[nn.Module, Any]], keys: dict[str, int], sizes: list[int], masks: Any,
            device: torch.device) -> tuple[list[_Chunk], dict[Any, int]]:
    """The chunks of the layers that the batch holds now, in the layers' order, and where each
    layer (by ``id(unfold)``) and each handed-out mask key lies."""
    found = []
    for module, unfold in layers:
        if unfold.__dict__.get("_skip"):  # it multiplies its activation: the batch hands out its masks
            found.append((module, unfold, None, 0))
        elif _foldable(module, device):
            w, b = module._parameters["weight"], module._parameters.get("bias")
            multiplies = unfold.multiplies(w.dim(), None if b is None else b.dim(), keys, masks)
            if multiplies is not None:
                size = w.numel() * w.element_size() + (0 if b is None else b.numel() * b.element_size())
                found.append((module, unfold, multiplies, size))
    cap = max(sum(size for *_, size in found) / CHUNKS, MIN_CHUNK_BYTES)
    chunks, where, filled = [_Chunk(plan=FoldPlan(list(sizes)))], {}, 0
    for module, unfold, multiplies, size in found:
        if filled and filled + size > cap:
            chunks.append(_Chunk(plan=FoldPlan(list(sizes))))
            filled = 0
        filled += size
        chunk = chunks[-1]
        if multiplies is None:
            for k in unfold.mask_keys():
                if k in keys and k not in where:
                    where[k] = len(chunks) - 1
                    chunk.copied.append(k)
                    chunk.plan.copies.append(keys[k])
            continue
        where[id(unfold)] = len(chunks) - 1
        _add_layer(chunk, module, unfold, multiplies)
    return chunks, where


def _add_layer(chunk: _Chunk, module: nn.Module, unfold: Any, multiplies: list[list[tuple]]) -> None:
    """The layer's folds into the chunk's plan: the weight's (and the bias's) j-th multiply in pass j."""
    n = sum(1 + (ib is not None) for *_, ib in chunk.rows)
    uses_bias = any(t == 1 for fold in multiplies for t, *_ in fold)
    index = (n, n + 1 if uses_bias else None)
    chunk.rows.append((module, unfold, *index))
    passes, count = chunk.plan.passes, {0: 0, 1: 0}  # per tensor of the layer, its multiplies so far
    for fold in multiplies:
        chunk.groups += any(g >= 0 for *_, g in fold)
        for t, source, i, trailing, dims, g in fold:
            while len(passes) <= count[t]:
                passes.append([])
            passes[count[t]].append(Multiply(index[t], source, i, trailing, dims, chunk.groups if g >= 0 else -1))
            count[t] += 1


class ForwardFolds:
    """One forward's batch: the foldable layers in :data:`CHUNKS` nodes, each a :class:`FoldAll`
    computed when one of its layers is first read (so the folded copies live from about their
    layers' turn, not from the forward's start), under the grad mode the masks were computed in.

    Args:
        layers: (module, unfold) of every folded layer, in the model's order.
        keys / sizes: the block's mask keys (key -> segment index) and segment sizes.
        block / depth: this forward's channel masks of the block and depth masks.
        grad_mode: whether the masks were computed with gradients.
        masks: the forward's mask store (:class:`~dmscale.core.forward_masks.ForwardMasks`), which
            holds the depth reads' flat indices.
        cache: kept across forwards: the chunks, made again when a layer's state changed.
    """

    def __init__(self, layers: list[tuple[nn.Module, Any]], keys: dict[str, int], sizes: list[int],
                 block: torch.Tensor, depth: torch.Tensor, grad_mode: bool, masks: Any, cache: dict) -> None:
        device = depth.device
        state = tuple((id(u), bool(u.__dict__.get("_skip")), _foldable(m, device)) for m, u in layers)
        if cache.get("state") != state:
            cache.update(state=state, made=_chunks(layers, keys, sizes, masks, device))
        self.chunks, self.where = cache["made"]
        self.block, self.depth, self.grad_mode = block, depth, grad_mode
        self.found: dict[Any, Any] = {}
        self.done: set[int] = set()

    def get(self, which: Any, pop: bool = False) -> Any:
        """The folded (weight, bias or None) of a layer (``id(unfold)``), or the (C,) mask of a
        handed-out key; None where the batch holds neither. ``pop``: let go of it."""
        c = self.where.get(which)
        if c is None:
            return None
        if c not in self.done:
            self._compute(c)
        return self.found.pop(which, None) if pop else self.found.get(which)

    def _compute(self, c: int) -> None:
        self.done.add(c)
        chunk = self.chunks[c]
        tensors = []
        for module, _, _, ib in chunk.rows:
            tensors.append(module._parameters["weight"])
            if ib is not None:
                tensors.append(module._parameters["bias"])
        with torch.set_grad_enabled(self.grad_mode), outside_checkpoint():
            outs = FoldAll.apply(chunk.plan, self.block, self.depth, *tensors)
        for _, unfold, iw, ib in chunk.rows:
            self.found[id(unfold)] = (outs[iw], None if ib is None else outs[ib])
        self.found.update(zip(chunk.copied, outs[len(tensors):]))
