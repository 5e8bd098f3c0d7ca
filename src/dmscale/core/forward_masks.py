"""Where the hooks read a forward's masks: one gathered tensor of channels, one of depth.

:class:`ForwardMasks` is the per-forward mask store the gates own
(``gates.forward_masks``). :meth:`~dmscale.core.masks.Gates.compute` evaluates every mask once
per forward and hands the store two tensors (:meth:`ForwardMasks.store`): the channel masks of
every hooked layer in one gather, (sum of C,) in
:class:`~dmscale.core.channel_layout.ChannelLayout` order, and every depth dim's block masks
concatenated, (n_blocks,). The hooks read their pieces (:meth:`~ForwardMasks.channel_mask`,
:meth:`~ForwardMasks.norm_weights`, :meth:`~ForwardMasks.depth_unit`,
:meth:`~ForwardMasks.depth_value`, through the gates):

* eagerly, from one split of the channels (the norms' weights in one batched division per
  channel count) and one unbind of the depth masks, made when the masks are computed (under the
  forward's grad mode, and outside any block's activation checkpoint, whose recomputation must
  save what its first forward saved): one autograd node each, not one per layer;
* while dynamo traces the layers (``torch.compile(model)``), as slices and elements of the two
  tensors inside the graph: the backward of the split and the unbind (a zero-filled tensor per
  piece without a gradient, then a ``cat``) never runs, as no piece of theirs reaches the loss,
  and the graph takes two mask inputs.

Both give the same values and gradients (tests compare the compiled and the eager search).

Example:
    >>> import torch
    >>> from dmscale.core.channel_layout import ChannelLayout
    >>> masks = ForwardMasks(ChannelLayout(["fc", "proj"], [2, 1]), reads=[1],
    ...                      compute=lambda: masks.store(torch.tensor([1.0, 0.5, 0.0]), torch.tensor([1.0, 0.25])))
    >>> masks.channel_mask("fc").tolist(), masks.channel_mask("proj").tolist(), float(masks.depth_value(0))
    ([1.0, 0.5], [0.0], 0.25)
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from dmscale.core.channel_layout import ChannelLayout
from dmscale.core import fold_batch
from dmscale.core.fold_batch import ForwardFolds, saving_hooks_active
from dmscale.core.masked_norm import mask_weights

__all__ = ["ForwardMasks"]


class ForwardMasks:
    """The per-forward mask store of :class:`~dmscale.core.masks.Gates`: this forward's masks
    and their pieces as the hooks read them, computed on the first read of a forward that has
    none (:meth:`clear` forgets them).

    Args:
        layout: where each hooked layer's channels lie in the gather.
        reads: per depth read (a hook's multiply, :meth:`~dmscale.core.masks.Gates.depth_read`),
            its flat block index; appended to while the hooks are attached.
        compute: computes this forward's masks and hands them to :meth:`store` (the gates'
            :meth:`~dmscale.core.masks.Gates.compute`).

    Attributes:
        offsets: key -> (start, C) in the gather (a constant of a traced graph).
        fold_layers: (module, unfold) of the model's folded layers, set by the model's forward
            pre-hook (:class:`~dmscale.core.mask_hooks.ComputeMasks`) before it computes the masks.
        fold_cache: the forward batch's chunks, kept across forwards
            (:class:`~dmscale.core.fold_batch.ForwardFolds`).
    """

    def __init__(self, layout: ChannelLayout, reads: list[int], compute: Callable[[], None]) -> None:
        self.layout = layout
        self.reads = reads
        self.compute = compute
        self.offsets = layout.offsets()
        self.fold_layers: list[tuple[nn.Module, Any]] = []
        self.fold_cache: dict[str, Any] = {}
        self.clear()

    def __getstate__(self) -> dict[str, Any]:
        """Copies (deepcopy, pickle) keep the layout, the reads and ``compute`` only: the
        forward's masks are non-leaf tensors, the folded layers and their chunks the original's."""
        return {"layout": self.layout, "reads": self.reads, "compute": self.compute}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["layout"], state["reads"], state["compute"])

    def store(self, gathered: torch.Tensor, depth: torch.Tensor, sizes: list[int] | None = None,
              read_index: torch.Tensor | None = None) -> None:
        """This forward's masks: every hooked layer's channels (sum of C,) and every depth
        dim's blocks (n_blocks,), ``sizes`` blocks per depth dim (default: one dim);
        ``read_index``: :attr:`reads` as a tensor on the masks' device (where a block is read
        more than once, its reads are one gather)."""
        self._gathered, self._depth, self._grad_mode, self._folded = gathered, depth, torch.is_grad_enabled(), None
        self._depth_sizes = sizes if sizes is not None else [depth.numel()]
        self._split(read_index)

    def clear(self) -> None:
        """Forget this forward's masks: the next read computes them again."""
        self._gathered: torch.Tensor | None = None
        self._depth: torch.Tensor | None = None
        self._depth_sizes: list[int] = []
        self._grad_mode = True
        self._channels: dict[str, torch.Tensor] = {}
        self._weights: dict[str, torch.Tensor] = {}
        self._block: torch.Tensor | None = None
        self._depth_units: list[Any] = []
        self._values: Any = []
        self._folded: ForwardFolds | None = None

    def _computed(self) -> None:
        if self._gathered is None:
            self.compute()

    # ------------------------------------------------------------------ eager pieces
    def _split(self, read_index: torch.Tensor | None) -> None:
        """The eager pieces of this forward's masks (views, and the norms' weights)."""
        self._channels, self._weights, self._block = self.layout.split(self._gathered)
        units, sizes = self._depth.unbind(0), self._depth_sizes
        starts = [sum(sizes[:j]) for j in range(len(sizes) + 1)]
        self._depth_units = [units[starts[j]:starts[j + 1]] for j in range(len(sizes))]
        repeated = len(set(self.reads)) < len(self.reads)  # one gather: its backward sums the reads
        if repeated and read_index is None:
            read_index = torch.tensor(self.reads, dtype=torch.long, device=self._depth.device)
        self._values = self._depth[read_index].unbind(0) if repeated else [units[b] for b in self.reads]

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
            start, size = self.offsets[key]
            return self._gathered[start:start + size]
        found = self._channels.get(key)
        if found is None and self._block is not None:  # a key of the block, read by a fold on its own
            found = self._batched_mask(key)
            if found is None:
                with torch.set_grad_enabled(self._grad_mode):
                    self._channels.update(self.layout.split_block(self._block))
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
            return self._depth[self.reads[read]]
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
        """This forward's batch, made on its first read."""
        self._computed()
        folds = self._folded
        if folds is None:
            n = self.layout.n_block
            block = self._block if self._block is not None else self._depth[:0]
            folds = self._folded = ForwardFolds(
                self.fold_layers, {k: i for i, k in enumerate(self.layout.keys[:n])}, self.layout.sizes[:n],
                block, self._depth, self._grad_mode, self, self.fold_cache)
        return folds
