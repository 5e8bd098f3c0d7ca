"""Where the hooks read a forward's masks: one gathered tensor of channels, one of depth.

:meth:`~dmscale.core.masks.Gates.compute` evaluates every mask once per forward into two
tensors (:meth:`ForwardMasks._store`): the channel masks of every hooked layer in one gather,
(sum of C,) in :class:`~dmscale.core.channel_layout.ChannelLayout` order, and every depth dim's
block masks concatenated, (n_blocks,). The hooks read their pieces (:meth:`channel_mask`,
:meth:`norm_weights`, :meth:`depth_unit`, :meth:`depth_value`):

* eagerly, from one split of the channels (the norms' weights in one batched division per
  channel count) and one unbind of the depth masks, made when the masks are computed (under the
  forward's grad mode, and outside any block's activation checkpoint, whose recomputation must
  save what its first forward saved): one autograd node each, not one per layer;
* while dynamo traces the layers (``torch.compile(model)``), as slices and elements of the two
  tensors inside the graph: the backward of the split and the unbind (a zero-filled tensor per
  piece without a gradient, then a ``cat``: 44 eager operators per step on ViT-B) never runs,
  as no piece of theirs reaches the loss, and the graph takes two mask inputs.

Both give the same values and gradients (tests compare the compiled and the eager search).

Example:
    >>> import torch
    >>> from dmscale.core.channel_layout import ChannelLayout
    >>> class Masks(ForwardMasks):
    ...     def compute(self): self._store(torch.tensor([1.0, 0.5, 0.0]), torch.tensor([1.0, 0.25]))
    >>> m = Masks()
    >>> m._layout = ChannelLayout(["fc", "proj"], [2, 1])
    >>> m._reads = [1]
    >>> m.channel_mask("fc").tolist(), m.channel_mask("proj").tolist(), float(m.depth_value(0))
    ([1.0, 0.5], [0.0], 0.25)
"""

from __future__ import annotations

import torch

from typing import Any

from torch import nn

from dmscale.core.channel_layout import ChannelLayout
from dmscale.core.fold_batch import FoldAll, FoldPlan, Multiply, outside_checkpoint, saving_hooks_active
from dmscale.core.masked_norm import mask_weights

__all__ = ["ForwardMasks"]


class ForwardMasks:
    """The per-forward mask store of :class:`~dmscale.core.masks.Gates` (a mixin: the gates
    provide ``compute()``, ``_layout``, ``_reads`` and, where a block is read more than once,
    the ``read_index`` buffer)."""

    _layout: ChannelLayout
    _reads: list[int]  # per depth read (a hook's multiply), its flat block index

    def compute(self) -> None:  # pragma: no cover - the gates' own
        raise NotImplementedError

    def _store(self, gathered: torch.Tensor, depth: torch.Tensor, sizes: list[int] | None = None) -> None:
        """This forward's masks: every hooked layer's channels (sum of C,) and every depth
        dim's blocks (n_blocks,), ``sizes`` blocks per depth dim (default: one dim)."""
        if "_offsets" not in self.__dict__:  # read by the traced reads (a constant of the graph)
            self._offsets = self._layout.offsets()
        self.__dict__.update(_gathered=gathered, _depth=depth, _grad_mode=torch.is_grad_enabled(), _folded=None,
                             _depth_sizes=sizes if sizes is not None else [depth.numel()])
        self._split()

    def _clear(self) -> None:
        """Forget this forward's masks: the next read computes them again."""
        self.__dict__.update(_gathered=None, _depth=None, _channels=None, _weights={}, _depth_units=None,
                             _values=None, _block=None, _folded=None)

    def _computed(self) -> None:
        if self.__dict__.get("_gathered") is None:
            self.compute()

    # ------------------------------------------------------------------ eager pieces
    def _split(self) -> None:
        """The eager pieces of this forward's masks (views, and the norms' weights)."""
        self._channels, self._weights, self._block = self._layout.split(self._gathered)
        units, sizes = self._depth.unbind(0), self._depth_sizes
        starts = [sum(sizes[:j]) for j in range(len(sizes) + 1)]
        self._depth_units = [units[starts[j]:starts[j + 1]] for j in range(len(sizes))]
        repeated = len(set(self._reads)) < len(self._reads)  # one gather: its backward sums the reads
        self._values = self._depth[self.read_index].unbind(0) if repeated else [units[b] for b in self._reads]

    @staticmethod
    def _tracing() -> bool:
        """Whether dynamo traces the read: the pieces are then taken inside the graph."""
        return torch.compiler.is_compiling()

    # ------------------------------------------------------------------ the hooks' reads
    def channel_mask(self, key: str) -> torch.Tensor:
        """The mask of the channels of hooked layer ``key``, (C,): every key's channels are
        gathered at once when the masks are computed (one index operation and one index
        backward per forward, not one per layer)."""
        self._computed()
        if self._tracing():
            start, size = self._offsets[key]
            return self._gathered[start:start + size]
        found = self._channels.get(key)
        if found is None and self._block is not None:  # a key of the block, read by a fold on its own
            found = self._batched_mask(key)
            if found is None:
                with torch.set_grad_enabled(self.__dict__.get("_grad_mode", True)):
                    self._channels.update(self._layout.split_block(self._block))
                found = self._channels[key]
        return found if found is not None else self._channels[key]

    def norm_weights(self, key: str) -> torch.Tensor:
        """The weights ``p = m / sum(m)`` (C,) of masked norm ``key``'s statistics, computed
        with the channel masks, one batched division for all the norms of a channel count
        (:class:`~dmscale.core.channel_layout.ChannelLayout`); inside a traced graph, per norm
        (fused there into the norm's kernels)."""
        self._computed()
        found = None if self._tracing() else self._weights.get(key)  # (a norm outside the groups: on its own)
        return found if found is not None else mask_weights(self.channel_mask(key)[None])[0]

    def depth_unit(self, j: int, block: int) -> torch.Tensor:
        """Block ``block``'s mask of depth dim ``j``, a () scalar (one unbind per forward)."""
        self._computed()
        if self._tracing():
            return self._depth[sum(self._depth_sizes[:j]) + block]
        return self._depth_units[j][block]

    def depth_value(self, read: int) -> torch.Tensor:
        """The () depth mask of read ``read`` (:meth:`~dmscale.core.masks.Gates.depth_read`)
        for this forward."""
        self._computed()
        if self._tracing():
            return self._depth[self._reads[read]]
        return self._values[read]

    # ------------------------------------------------------------------ the folds' batch
    def depth_flat(self, j: int, block: int) -> int:
        """The flat index of block ``block`` of depth dim ``j`` in this forward's depth masks."""
        return sum(self._depth_sizes[:j]) + block

    def batched_params(self, unfold: Any) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The folded (weight, bias or None) of the layer of ``unfold`` for this forward, from
        one :class:`~dmscale.core.fold_batch.FoldAll` of every batchable layer, computed at the
        first call (eager mode); None where the layer is not in it."""
        folded = self._batch()
        if saving_hooks_active():  # an activation checkpoint may compute the layer again in the backward
            return folded.get(id(unfold))
        return folded.pop(id(unfold), None)  # held by the layer's call only (a second call folds on its own)

    def _batched_mask(self, key: str) -> torch.Tensor | None:
        """The (C,) mask of block key ``key`` from the batch, for a layer that multiplies its
        activation this forward (and did the last: the batch hands it out), else None."""
        return self._batch().get(key)

    def _batch(self) -> dict[Any, Any]:
        self._computed()
        folded = self.__dict__.get("_folded")
        if folded is None:
            folded = self.__dict__["_folded"] = self._fold_all()
        return folded

    def _fold_all(self) -> dict[int, tuple[torch.Tensor, torch.Tensor | None]]:
        """{id(unfold): (weight, bias or None)} of every layer the batch can hold now: its folds
        all batchable, its weight and bias plain parameters on the masks' device, and its last
        eager call folded into the weight (a call that took the activation leaves it out)."""
        layers = self.__dict__.get("_fold_layers") or ()
        device, tensors, rows, key, copied = self._depth.device, [], [], [], []
        for module, unfold in layers:
            if unfold.__dict__.get("_skip"):  # its activation is multiplied: the batch copies its masks
                copied.extend(k for f in unfold.folds for k in (getattr(f, "key", None), getattr(f, "bias_key", None))
                              if k is not None)
                continue
            w, b = module._parameters.get("weight"), module._parameters.get("bias")
            if type(w) is not nn.Parameter or w.device != device or \
                    (b is not None and (type(b) is not nn.Parameter or b.device != device)):
                continue
            rows.append((unfold, w, b))
            key.append((id(unfold), w.dim(), None if b is None else b.dim()))
        plan, slots = self._plan_for(rows, tuple(key), copied)
        if plan is None:
            return {}
        for (unfold, w, b), (iw, ib) in zip(rows, slots):
            if iw is not None:
                tensors.append(w)
                if ib is not None:
                    tensors.append(b)
        block = self._block if self._block is not None else self._depth[:0]
        with torch.set_grad_enabled(self.__dict__.get("_grad_mode", True)), outside_checkpoint():
            outs = FoldAll.apply(plan, block, self._depth, *tensors)
        found: dict[Any, Any] = {id(unfold): (outs[iw], None if ib is None else outs[ib])
                                 for (unfold, _, _), (iw, ib) in zip(rows, slots) if iw is not None}
        found.update(zip(self.__dict__["_fold_plan"][3], outs[len(tensors):]))
        return found

    def _plan_for(self, rows: list[tuple[Any, torch.Tensor, torch.Tensor | None]], key: tuple, copied: list[str]
                  ) -> tuple[FoldPlan | None, list[tuple[int | None, int | None]]]:
        """The batch's plan for ``rows`` and the block keys ``copied`` (kept while they are the
        same) and per row the positions of its weight and bias among the batch's tensors (None:
        not in the batch)."""
        cached, raw = self.__dict__.get("_fold_plan"), (key, tuple(copied))
        if cached is not None and cached[0] == raw:
            return cached[1], cached[2]
        n_block = self._layout.n_block
        keys = {k: i for i, k in enumerate(self._layout.keys[:n_block])}
        copied = [k for k in dict.fromkeys(copied) if k in keys]
        plan, slots, n, groups = FoldPlan(list(self._layout.sizes[:n_block]), copies=[keys[k] for k in copied]), [], 0, 0
        for unfold, w, b in rows:
            found = unfold.multiplies(w.dim(), None if b is None else b.dim(), keys, self)
            if found is None:
                slots.append((None, None))
                continue
            uses_bias = any(t == 1 for fold in found for t, *_ in fold)
            index = (n, n + 1 if uses_bias else None)
            slots.append(index)
            n += 1 + uses_bias
            depth = {0: 0, 1: 0}  # per tensor of the layer, its multiplies so far: the pass
            for fold in found:
                groups += any(g >= 0 for *_, g in fold)
                for t, source, i, trailing, dims, g in fold:
                    p = depth[t]
                    depth[t] += 1
                    while len(plan.passes) <= p:
                        plan.passes.append([])
                    plan.passes[p].append(Multiply(index[t], source, i, trailing, dims, groups if g >= 0 else -1))
        result = (plan if n or copied else None), slots
        self.__dict__["_fold_plan"] = (raw, *result, copied)
        return result
