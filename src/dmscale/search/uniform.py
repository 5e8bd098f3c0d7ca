"""Layer-uniform search: one kept count per kind of dimension across repeated layers.

With ``SearchConfig(layer_uniform=True)`` the width dimensions that play the same role in
repeated layers (``model.layers.0.mlp.gate_proj``, ``model.layers.1.mlp.gate_proj``, ...)
share **one** learnable pruning ratio ``a``: every layer keeps the same number of
elements, k = round((1 - a) N), so the result has a standard config (one
``intermediate_size``, one ``num_key_value_heads``) that the model's own library loads.
Importance stays per layer: each layer still keeps *its own* most important elements.
The shared ``a`` receives the sum of the members' gradients, so the resource loss and the
soft masks of Eq. 3 are unchanged in form; only the number of free structural parameters
shrinks.

Two dims are "the same kind" when their names are equal once the index of every repeated
container (a numeric path component followed by more path) is replaced by ``*``, and their
kind, size, step, min width and temperature agree. A dimension owned by a container element
itself (``0`` in an ``nn.Sequential`` of Linears) keeps its own ratio.

Example:
    >>> layer_pattern("model.layers.12.mlp.gate_proj")
    'model.layers.*.mlp.gate_proj'
    >>> layer_pattern("0")
    '0'
    >>> uniform_groups(["model.layers.0.mlp.up", "model.layers.1.mlp.up", "model.embed"],
    ...                [("width", 64), ("width", 64), ("width", 32)])
    [[0, 1]]
"""

from __future__ import annotations

from typing import Any, Hashable, Sequence

from dmscale.core.errors import StructureError
from dmscale.core.ratios import share_ratio

__all__ = ["layer_pattern", "uniform_groups", "tie_ratios"]


def layer_pattern(name: str) -> str:
    """``name`` with every repeated-container index (a numeric component followed by more
    path) replaced by ``*``."""
    parts = name.split(".")
    return ".".join("*" if p.isdigit() and i < len(parts) - 1 else p for i, p in enumerate(parts))


def uniform_groups(names: Sequence[str], keys: Sequence[Hashable]) -> list[list[int]]:
    """Indices of the dims that share one ratio: same :func:`layer_pattern` and same ``key``
    (kind, size, step, ...); only groups of two or more are returned, in order of first member."""
    groups: dict[tuple[str, Hashable], list[int]] = {}
    for i, (name, key) in enumerate(zip(names, keys)):
        pattern = layer_pattern(name)
        if pattern == name:
            continue
        groups.setdefault((pattern, key), []).append(i)
    return [g for g in groups.values() if len(g) > 1]


def tie_ratios(gates: Sequence[Any], groups: list[list[int]]) -> None:
    """Make the members of each group share their first member's ``a`` (one nn.Parameter, or
    one entry of the stacked ratios: :func:`~dmscale.core.ratios.share_ratio`)."""
    for group in groups:
        first = gates[group[0]]
        for i in group[1:]:
            member = gates[i]
            if member.n_units != first.n_units or member.min_units != first.min_units:
                raise StructureError(f"cannot tie dims with different units: {member} vs {first}")
            share_ratio(member, first)
