"""What discovery finds, as plain data: the searchable widths and depths of a model and, per
handled layer, where its channels live in the mask.

:class:`SearchSpace` is the result of :func:`dmscale.trace.discover.discover` (which also
re-exports these classes); the search, the cost models and the exporters read it.

Example:
    >>> import numpy as np
    >>> space = SearchSpace(width=[WidthDim("fc1", 4, ["fc1"])],
    ...                     depth=[DepthDim("blocks", [Block("blocks.0", ["blocks.0.mlp"])], 1)],
    ...                     layers={"fc1": LayerSlots("fc1", "linear", None, np.arange(4))},
    ...                     pinned_reasons={}, total_macs=0, module_macs={})
    >>> space.n_slots, space.block_of("blocks.0.mlp.fc2")
    (4, (0, 0))
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["WidthDim", "Block", "DepthDim", "LayerSlots", "SearchSpace"]


@dataclass
class WidthDim:
    """One searchable width: ``size`` channel slots, owned by the layers in ``producers``."""

    name: str
    size: int
    producers: list[str]
    kind: str = "width"  # "width" or "heads" (heads use the depth temperature, A.1.1)
    # slot groups (local indices) of which at least one must stay: one per layer that
    # writes only part of this width (a branch of a concat added to a residual stream)
    required: list[list[int]] = field(default_factory=list)


@dataclass
class Block:
    """A residual block ``y = post(x + f(x))``; a transformer block chains two branches,
    ``x1 = x + attn(x); y = x1 + mlp(x1)``, and both share the block's depth mask.

    With sublayer depth (:func:`dmscale.trace.blocks.split_branches`) each branch of such a
    block is a unit of its own: ``branch_modules`` the one branch, ``members`` the modules
    that compute it, ``layer`` the whole block (removed whole once all its branches are)."""

    name: str
    branch_modules: list[str]  # modules whose outputs are the residual branches f_j(x)
    post_module: str | None = None  # activation module applied after the add, if any
    post_function: str | None = None  # or activation function name
    output: Any = None  # None: returns the tensor; else its output_template (a tuple, ...)
    n_inputs: int = 1  # arguments the block is called with (x alone, or x and masks, ...)
    # its input or output tensor is modified in place after the call starts (``out += ...``):
    # a replacement that returns its input itself would then alias the two
    mutated: bool = True
    # branch module -> the layer whose output the branch returns, through nothing but dropout
    # (called once, its output read once): f(x) * m is that layer with weight and bias times m
    fold_layers: dict[str, str] = field(default_factory=dict)
    layer: Block | None = None  # sublayer depth: the block whose branch this unit is
    # sublayer depth: the modules that compute the branch (name -> output template), which
    # a removed branch replaces with zeros; {}: the block module ``name`` itself
    members: dict[str, Any] = field(default_factory=dict)
    # a split block whose branches ``pinned`` (names) are no depth units (``keep_depth``): it
    # stays whatever its other branches' masks are
    pinned: list[str] = field(default_factory=list)

    def contains(self, name: str) -> bool:
        """Whether module/param ``name`` belongs to this block (or branch unit)."""
        return any(name == m or name.startswith(m + ".") for m in (self.members or [self.name]))


@dataclass
class DepthDim:
    """The removable residual blocks of one stage (children of one parent module)."""

    name: str
    blocks: list[Block]
    min_keep: int


@dataclass
class LayerSlots:
    """Per channel of a handled layer: its global slot (index into the concatenated mask of
    all width dims) or ``-1`` when the channel is fixed."""

    name: str
    handler: str
    in_slots: np.ndarray | None
    out_slots: np.ndarray | None
    macs: int = 0
    macs_sides: tuple[str, ...] = ()
    virtual: bool = False
    masked_norm: bool = False
    mask_output: bool = False


@dataclass
class SearchSpace:
    """Everything discovery found: dims, layers and where their channels live."""

    width: list[WidthDim]
    depth: list[DepthDim]
    layers: dict[str, LayerSlots]
    pinned_reasons: dict[str, str]
    total_macs: int
    module_macs: dict[str, int]
    params: dict[str, tuple[int, np.ndarray]] = field(default_factory=dict)  # raw parameters
    # derived slots after the base ones: mask = mask[a] * mask[b] (-1: 1), e.g. (head, head dim)
    derived: list[tuple[int, int]] = field(default_factory=list)
    # the model's output on the example inputs during the trace (eval mode, no grad)
    example_output: Any = field(default=None, repr=False, compare=False)
    n_slots: int = field(init=False)  # base + derived; the fixed-channel entry has this index

    def __post_init__(self) -> None:
        self.n_slots = sum(d.size for d in self.width) + len(self.derived)

    def block_of(self, name: str) -> tuple[int, int] | None:
        """(depth dim, block) whose block module contains module/param ``name``."""
        for j, dd in enumerate(self.depth):
            for i, b in enumerate(dd.blocks):
                if b.contains(name):
                    return j, i
        return None

    def split_layers(self) -> dict[str, list[tuple[int, int]]]:
        """Sublayer depth: each block split into branch units, by name, with its units
        ``(depth dim, unit)`` in order ({} with block depth); a block with a pinned branch
        (:func:`~dmscale.trace.blocks.pin_units`) is not one: it is never removed whole."""
        out: dict[str, list[tuple[int, int]]] = {}
        for j, dd in enumerate(self.depth):
            for i, b in enumerate(dd.blocks):
                if b.layer is not None and not b.layer.pinned:  # a block with a pinned branch always stays
                    out.setdefault(b.layer.name, []).append((j, i))
        return out

    def split_layer_of(self, name: str) -> str | None:
        """The split block that contains module/param ``name`` outside all of its branch
        units (a norm before a branch): it lives as long as one of its branches does."""
        if self.block_of(name) is not None:
            return None
        return next((layer for layer in self.split_layers()
                     if name == layer or name.startswith(layer + ".")), None)
