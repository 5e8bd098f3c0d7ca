"""The global width mask (:func:`assemble_width_mask`), where every hooked layer's channel
mask lies in the forward's one gather of it, and the masked norms' weights computed once per
channel count (:class:`ChannelLayout`).

:class:`~dmscale.core.masks.Gates` gathers the channel masks of all hooked layers from the
global width mask in one index operation per forward, ``width[index]`` (sum of C,), and hands
each layer its slice. A masked norm needs the weights ``p = m / sum(m)`` of its mask
(:func:`~dmscale.core.masked_norm.mask_weights`); the norms over one width (every norm of a
ViT's or an LLM's residual stream) are laid out next to each other, so their masks are one
(n, C) block of the gather and their weights one batched division, not three operations per
norm forward and four backward.

Example:
    >>> import torch
    >>> keyed = {"norm_a": torch.tensor([0, 1]), "idx_fc": torch.tensor([2, 0, 1]), "norm_b": torch.tensor([0, 2])}
    >>> layout, index = ChannelLayout.arrange(keyed, norm_keys={"norm_a", "norm_b"})
    >>> index.tolist(), layout.pieces
    ([2, 0, 1, 0, 1, 0, 2], [3, 4])
    >>> channels, weights, _ = layout.split(torch.tensor([1.0, 3.0, 0.0])[index])
    >>> channels["idx_fc"].tolist(), weights["norm_a"].tolist(), weights["norm_b"].tolist()
    ([0.0, 1.0, 3.0], [0.25, 0.75], [1.0, 0.0])
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dmscale.core.masked_norm import mask_weights

__all__ = ["ChannelLayout", "assemble_width_mask", "resolve_derived"]


@dataclass
class ChannelLayout:
    """The order of the hooked layers' channels in the gather: the keys of the block (the
    masks folded into weights all at once, :mod:`dmscale.core.fold_batch`) first, then the other
    layers' keys, then the norms' keys grouped by channel count.

    Attributes:
        keys: the keys of the layers that are not masked norms, in gather order.
        sizes: their channel counts.
        norm_groups: (keys, C) per channel count of the masked norms, in gather order.
        n_block: the first ``n_block`` keys are one piece of the split, the block.
    """

    keys: list[str] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    norm_groups: list[tuple[list[str], int]] = field(default_factory=list)
    n_block: int = 0

    @classmethod
    def arrange(cls, keyed: dict[str, torch.Tensor], norm_keys: set[str],
                block_keys: set[str] = frozenset()) -> tuple["ChannelLayout", torch.Tensor]:
        """The layout of ``keyed`` (key -> global slot of each channel, (C,)) and the gather's
        index in its order, (sum of C,) long; ``norm_keys``: the keys of masked norms;
        ``block_keys``: the keys laid out first, as one piece (the block)."""
        layout, parts, groups = cls(), [], {}
        ordered = [k for k in keyed if k in block_keys] + [k for k in keyed if k not in block_keys]
        layout.n_block = sum(k in block_keys for k in keyed)
        for key in ordered:
            slots = keyed[key]
            if key in norm_keys:
                groups.setdefault(slots.numel(), []).append((key, slots))
            else:
                layout.keys.append(key)
                layout.sizes.append(slots.numel())
                parts.append(slots)
        for c, members in groups.items():
            layout.norm_groups.append(([k for k, _ in members], c))
            parts.extend(s for _, s in members)
        index = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
        return layout, index

    @property
    def pieces(self) -> list[int]:
        """The split of the gathered channels: the block (one piece, if any), each other
        layer's, then each norm group's block."""
        block = [sum(self.sizes[:self.n_block])] if self.n_block else []
        return block + self.sizes[self.n_block:] + [len(keys) * c for keys, c in self.norm_groups]

    def offsets(self) -> dict[str, tuple[int, int]]:
        """key -> (start, C): where each key's channels lie in the gather (a masked norm's in its
        group's (n, C) block)."""
        found, start = {}, 0
        for key, size in zip(self.keys, self.sizes):
            found[key], start = (start, size), start + size
        for keys, c in self.norm_groups:
            for key in keys:
                found[key], start = (start, c), start + c
        return found

    def split(self, gathered: torch.Tensor
              ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor | None]:
        """(key -> channel mask (C,) of every key outside the block, norm key -> weights p (C,),
        the block (sum of its C,) or None) from the gathered channels (sum of C,): one split; per
        norm group one (n, C) view, its weights in one :func:`~dmscale.core.masked_norm.mask_weights`
        and one unbind. The block's keys are split apart only where read (:meth:`split_block`)."""
        pieces = list(gathered.split(self.pieces))
        block = pieces.pop(0) if self.n_block else None
        channels = dict(zip(self.keys[self.n_block:], pieces))
        weights: dict[str, torch.Tensor] = {}
        for (keys, c), block_n in zip(self.norm_groups, pieces[len(self.keys) - self.n_block:]):
            rows = block_n.view(len(keys), c)
            channels.update(zip(keys, rows.unbind(0)))  # views; no backward unless a caller reads one
            weights.update(zip(keys, mask_weights(rows).unbind(0)))
        return channels, weights, block

    def split_block(self, block: torch.Tensor) -> dict[str, torch.Tensor]:
        """key -> channel mask (C,) of the block's keys, from the block (one split)."""
        return dict(zip(self.keys[:self.n_block], block.split(self.sizes[:self.n_block])))


def assemble_width_mask(parts: list[torch.Tensor], derived_a: torch.Tensor, derived_b: torch.Tensor,
                        like: torch.Tensor | None = None, one: torch.Tensor | None = None,
                        resolved: bool = False) -> torch.Tensor:
    """The global width mask: every dim's element mask, then the derived (product) slots
    ``m[a] * m[b]`` (a or b = -1: factor 1), then a trailing 1 for fixed channels (``one``, a
    (1,) tensor of 1 on the parts' device and dtype, or made here). ``resolved``: the derived
    indices hold n (the number of elements of ``parts``) instead of -1 already
    (:meth:`~dmscale.core.masks.Gates.derived_index`, made once instead of twice per forward)."""
    ref = parts[0] if parts else like
    if one is None or ref is None or (one.device, one.dtype) != (ref.device, ref.dtype):
        one = torch.ones(1, device=ref.device if ref is not None else None,
                         dtype=ref.dtype if ref is not None else torch.float32)
    base = torch.cat(parts) if parts else one[:0]
    if len(derived_a):
        ext = torch.cat([base, one])  # (n + 1,): index n reads the factor 1
        a, b = (derived_a, derived_b) if resolved else resolve_derived(derived_a, derived_b, base.numel())
        return torch.cat([base, ext[a] * ext[b], one])
    return torch.cat([base, one])


def resolve_derived(derived_a: torch.Tensor, derived_b: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The derived slots' factor indices with -1 (factor 1) replaced by n."""
    return torch.where(derived_a < 0, n, derived_a), torch.where(derived_b < 0, n, derived_b)
