"""The width gates' pruning ratios of a search in one Parameter.

Every width dimension has one learnable ratio ``a`` (Eq. 3). Held as W () Parameters (a
ResNet-50 has 37 width dims), every training step stacks them for the batched masks
(:class:`~dmscale.core.gate_bank.GateBank`) and its backward pass splits the stack's
gradient again: one view and one gradient accumulation per ratio, 2W operators per step that
launch nothing, and the optimiser steps W tensors. Held as one (W,) Parameter,
``dms_gates.width_ratios``, the bank reads it as it is and the optimiser steps one tensor.
Adam, SGD and gradient clipping work element by element, so one (W,) Parameter is the W
scalar ones, value for value.

Each gate's ``a`` is then a view of its entry (:attr:`~dmscale.core.topk.DifferentiableTopK.a`):
read it, or write it under ``torch.no_grad()``, as before; its gradient is
:attr:`~dmscale.core.topk.DifferentiableTopK.ratio_grad`. Gates that share a ratio (layer-
uniform dims) share an entry. A checkpoint with the per-gate keys (``dms_gates.width.0.a``,
...) loads into the stacked ratios (:func:`upgrade_state_dict`).

Depth gates keep their own Parameters: the settle phase and ``width_only_from`` freeze them
(``requires_grad=False``), which one entry of a shared Parameter cannot be (the optimiser's
moments would still move it). So do gates that are not :class:`~dmscale.core.topk.DifferentiableTopK`
(a baseline's), whose ``a`` is not a scalar, or whose ratio is frozen.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from dmscale.core.topk import DifferentiableTopK
    >>> owner = nn.Module(); owner.width = nn.ModuleList([DifferentiableTopK(4), DifferentiableTopK(8)])
    >>> with torch.no_grad():
    ...     _ = owner.width[1].a.fill_(0.25)
    >>> stack_ratios(owner, list(owner.width))
    >>> [name for name, _ in owner.named_parameters()], owner.width_ratios.tolist()
    (['width_ratios'], [0.0, 0.25])
    >>> owner.width[1].a.backward(); owner.width[1].ratio_grad
    tensor(1.)
"""

from __future__ import annotations

from typing import Any, Hashable, Sequence

import torch
from torch import nn

from dmscale.core.topk import DifferentiableTopK

__all__ = ["STORE", "stackable", "stack_ratios", "ratio_leaf", "ratio_key", "distinct_leaves", "share_ratio",
           "upgrade_state_dict"]

STORE = "width_ratios"


def stackable(gate: Any) -> bool:
    """Whether ``gate``'s ratio can be an entry of the stacked ratios: a
    :class:`~dmscale.core.topk.DifferentiableTopK` (its ``a`` reads the entry) with a scalar
    ratio that is trained (``requires_grad``)."""
    if not isinstance(gate, DifferentiableTopK):
        return False
    leaf, i = gate.ratio_leaf()
    return leaf.requires_grad and (i is not None or leaf.dim() == 0)


def ratio_leaf(gate: Any) -> tuple[nn.Parameter, int | None]:
    """The Parameter that holds ``gate``'s ratio and the ratio's index in it (None: the whole
    Parameter), for any gate (a baseline's ``a`` is its own Parameter), without making a view."""
    return gate.ratio_leaf() if isinstance(gate, DifferentiableTopK) else (gate.a, None)


def ratio_key(gate: Any) -> Hashable:
    """Equal for gates that share one ratio (the same Parameter, or the same entry of it)."""
    leaf, i = ratio_leaf(gate)
    return id(leaf), i


def distinct_leaves(gates: Sequence[Any]) -> list[nn.Parameter]:
    """The Parameters that hold the ratios of ``gates``, each once, in the order of first use."""
    leaves: dict[int, nn.Parameter] = {}
    for g in gates:
        leaf = ratio_leaf(g)[0]
        leaves.setdefault(id(leaf), leaf)
    return list(leaves.values())


def stack_ratios(owner: nn.Module, gates: Sequence[Any]) -> None:
    """Hold the ratios of the :func:`stackable` ``gates`` in one Parameter ``owner.width_ratios``
    (W,) on their device, one entry per distinct ratio in the order of first use, and make each
    gate's ``a`` a view of its entry. Called again (after ratios were tied), it builds the
    Parameter anew from the current values (no gradient carried over)."""
    members = [g for g in gates if stackable(g)]
    entry: dict[Hashable, int] = {}
    values = []
    for g in members:
        key = ratio_key(g)
        if key not in entry:
            entry[key] = len(values)
            values.append(g.a.detach())
    slots = [entry[ratio_key(g)] for g in members]
    if not members:
        return
    with torch.no_grad():
        store = nn.Parameter(torch.stack(values).to(torch.float32).clone())
    owner.register_parameter(STORE, store)
    for g, i in zip(members, slots):
        g._parameters.pop("a", None)
        g.__dict__["_ratio_slot"] = (owner, STORE, i)


def share_ratio(member: Any, first: Any) -> None:
    """Make ``member`` use ``first``'s ratio (its Parameter, or its entry of the stacked ones)."""
    slot = first.__dict__.get("_ratio_slot")
    member.__dict__.pop("_ratio_slot", None)
    if slot is None:
        member.a = first.a if isinstance(first.a, nn.Parameter) else nn.Parameter(first.a)
    else:
        member._parameters.pop("a", None)
        member.__dict__["_ratio_slot"] = slot


def upgrade_state_dict(owner: nn.Module, gates: Sequence[Any], state_dict: dict[str, Any], prefix: str) -> None:
    """Rewrite a state dict saved with one ``a`` per width gate (``{prefix}width.{j}.a``) to the
    stacked ratios' key ``{prefix}width_ratios``, in place; nothing when it has that key or
    lacks an entry's value (``load_state_dict`` then names the missing key)."""
    store = owner._parameters.get(STORE)
    if store is None or prefix + STORE in state_dict:
        return
    found: dict[int, Any] = {}
    keys = []
    for j, g in enumerate(gates):
        slot, key = g.__dict__.get("_ratio_slot"), f"{prefix}width.{j}.a"
        if slot is not None and key in state_dict:
            found.setdefault(slot[2], state_dict[key])
            keys.append(key)
    if len(found) != store.numel():
        return
    for key in keys:
        del state_dict[key]
    state_dict[prefix + STORE] = torch.stack([torch.as_tensor(found[i]).reshape(()) for i in range(store.numel())])
