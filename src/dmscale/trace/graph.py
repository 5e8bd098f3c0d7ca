"""Channel labels, the union-find that couples them, and the records a trace leaves.

Every channel (feature, element) a layer produces gets a fresh integer id. Operations that
tie channels together index-wise (a residual add, a multiply by an SE gate, a per-channel
norm) union the ids; concat/split/flatten rearrange them. Id 0 is ``PIN``: a channel in the
same set as ``PIN`` is never searched (model inputs and outputs, and whatever an operation
the tracer does not understand touches).

Example:
    >>> uf = UnionFind()
    >>> a, b = uf.new(3), uf.new(3)
    >>> uf.union_arrays(a, b)
    >>> bool(uf.find(int(a[1])) == uf.find(int(b[1])))
    True
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dmscale.core.errors import StructureError

__all__ = ["PIN", "UnionFind", "Label", "Event", "ModuleCall", "LayerRecord"]

PIN = 0


class UnionFind:
    """Union-find over integer element ids; id 0 (``PIN``) always stays its set's root."""

    def __init__(self) -> None:
        self.parent: list[int] = [PIN]

    def new(self, n: int) -> np.ndarray:
        """Allocate ``n`` fresh ids."""
        start = len(self.parent)
        self.parent.extend(range(start, start + n))
        return np.arange(start, start + n, dtype=np.int64)

    def find(self, x: int) -> int:
        root = x
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[x] != root:  # path compression
            self.parent[x], x = root, self.parent[x]
        return root

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(int(a)), self.find(int(b))
        if ra == rb:
            return
        if ra == PIN:
            self.parent[rb] = PIN
        else:
            self.parent[ra] = rb

    def union_arrays(self, a: np.ndarray, b: np.ndarray) -> None:
        if a.shape != b.shape:
            raise StructureError(f"cannot tie {a.shape[0]} channels to {b.shape[0]} channels")
        for x, y in zip(a.tolist(), b.tolist()):
            self.union(x, y)

    def pin(self, ids: np.ndarray) -> None:
        for x in ids.tolist():
            self.union(x, PIN)

    def pinned(self, x: int) -> bool:
        return self.find(int(x)) == PIN


@dataclass
class Label:
    """The channel ids carried along one dimension ``dim`` of a tensor."""

    dim: int
    ids: np.ndarray


@dataclass
class Event:
    """One recorded operation: a torch function or an opaque (handled) module call."""

    name: str
    inputs: list[int]
    outputs: list[int]
    module: str | None = None


@dataclass
class ModuleCall:
    """One call of a module: the node of its first tensor input and of its outputs."""

    name: str
    order: int
    input_node: int | None
    output_nodes: list[int] = field(default_factory=list)
    done: bool = False
    # how the output is packed: None for a bare tensor, else an output template
    # (dmscale.trace.discover.output_template); "opaque" when it cannot be rebuilt without the call
    output_template: Any = None
    start: int = 0  # the tracer's clock when the call began
    end: int = 0  # and when it returned
    n_inputs: int = 1  # positional plus keyword arguments the module was called with
    storages: tuple[int | None, ...] = ()  # storage address of its first input and of its output
    shapes: tuple[tuple[int, ...], ...] = ()  # shape of its first tensor input, then of its one output


@dataclass
class LayerRecord:
    """A handled layer: which channel ids its input and output channels carry.

    ``in_ids``/``out_ids`` are None when that side is not sliced (fixed width).
    """

    name: str
    handler: str
    in_ids: np.ndarray | None
    out_ids: np.ndarray | None
    calls: int = 1
    macs_sides: tuple[str, ...] | None = None  # None: ask the handler
    virtual: bool = False  # a cost term with no module of its own (attention core)
    masked_norm: bool = False  # a norm whose statistics must use the kept channels only
    macs_override: int | None = None  # MACs to cost instead of the module's flop count
    mask_output: bool = False  # multiply the layer's output by its channels' masks (q/k/v)
