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

from typing import Any

import torch

from dmscale.core.channel_layout import ChannelLayout
from dmscale.core import fold_batch
from dmscale.core.fold_batch import ForwardFolds, saving_hooks_active
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
            return self._depth[self.depth_flat(j, block)]
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
        """The folded (weight, bias or None) of the layer of ``unfold`` for this forward from
        the forward's batch (:class:`~dmscale.core.fold_batch.ForwardFolds`), let go of once
        read; None where the batch does not hold the layer, under saved-tensor hooks (an
        activation checkpoint computes the layer again in the backward: it folds on its own), or
        with the batch switched off (:data:`~dmscale.core.fold_batch.ENABLED`)."""
        if not fold_batch.ENABLED or saving_hooks_active():
            return None
        return self._folds().get(id(unfold), pop=True)

    def _batched_mask(self, key: str) -> torch.Tensor | None:
        """The (C,) mask of block key ``key`` from the batch, for a layer that multiplies its
        activation this forward (and did the last: the batch hands it out), else None."""
        return self._folds().get(key) if fold_batch.ENABLED else None

    def _folds(self) -> ForwardFolds:
        self._computed()
        folds = self.__dict__.get("_folded")
        if folds is None:
            n = self._layout.n_block
            block = self._block if self._block is not None else self._depth[:0]
            folds = self.__dict__["_folded"] = ForwardFolds(
                self.__dict__.get("_fold_layers") or [], {k: i for i, k in enumerate(self._layout.keys[:n])},
                self._layout.sizes[:n], block, self._depth, self.__dict__.get("_grad_mode", True), self,
                self.__dict__.setdefault("_fold_cache", {}))
        return folds
