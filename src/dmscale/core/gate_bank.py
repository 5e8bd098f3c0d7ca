"""Every gate of a search in one tensor: the masks of all dimensions in a few operations.

A search has one :class:`~dmscale.core.topk.DifferentiableTopK` per structural dimension (a
ViT-B has about 40, a ResNet-50 about 50). Computed gate by gate, Eq. 2-4 launch a dozen tiny
kernels per gate per forward and as many again per backward, which on a GPU costs more than
the model's own step. :class:`GateBank` holds the importances of G gates as one padded
matrix ``C`` (G, N_max) whose rows are the gates' own ``importance`` buffers (each gate's
buffer is a view of its row, so the gate, its ``state_dict`` and the bank always agree), and
computes per forward:

* the ranks of every dimension at once (Eq. 2): one ``argsort`` over the rows, padding
  sorted last (+inf), ties broken by index as :func:`~dmscale.core.topk.integer_rank` does;
* the soft masks of every dimension (Eq. 3): ``sigmoid(lam_g * (c'_gi - a_g))``, (G, N_max);
* the hard masks on the device (k = round((1 - a) N), no host synchronisation);
* the importance update of every dimension from one gradient (Eq. 4), on the device.

Gates with anything the batched formulas do not cover (another gate class, required groups
for hard masks, the unnormalised ablation) stay on the per-gate path of
:class:`~dmscale.core.masks.Gates`; the results are the same either way (tests compare them).

Example:
    >>> import torch
    >>> from dmscale.core.topk import DifferentiableTopK
    >>> gates = [DifferentiableTopK(4), DifferentiableTopK(2, temperature=4.0)]
    >>> bank = GateBank(gates)
    >>> soft = bank.unit_soft_masks()          # (2, 4): one row per gate, padding at 0
    >>> torch.allclose(soft[0], gates[0].unit_soft_mask()), torch.allclose(soft[1, :2], gates[1].unit_soft_mask())
    (True, True)
    >>> bank.update_importance(soft.detach(), torch.ones(2, 4))
    >>> gates[1].importance.tolist() == bank.matrix[1, :2].tolist()
    True
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from dmscale.core.errors import ConfigError
from dmscale.core.importance import IMPORTANCE_METRICS
from dmscale.core.ratios import distinct_leaves
from dmscale.core.topk import DifferentiableTopK

__all__ = ["GateBank", "BankRows", "batchable"]


def batchable(gate: Any) -> bool:
    """Whether ``gate`` follows exactly the formulas :class:`GateBank` batches: the paper's
    :class:`~dmscale.core.topk.DifferentiableTopK` (not a subclass, which may change them) with
    rank-normalised importance."""
    return type(gate) is DifferentiableTopK and gate.normalize


class GateBank:
    """Batched Eq. 2-4 over gates that share a metric, a decay and centring.

    Args:
        gates: :class:`~dmscale.core.topk.DifferentiableTopK` gates with ``normalize=True`` and
            the same ``metric``, ``decay`` and ``centered`` (see :func:`batchable`).
    """

    def __init__(self, gates: Sequence[DifferentiableTopK]) -> None:
        if not gates:
            raise ConfigError("GateBank needs at least one gate, got none")
        first = gates[0]
        for g in gates:
            if not batchable(g):
                raise ConfigError(f"GateBank batches DifferentiableTopK gates with normalize=True, got {g!r}")
            if (g.metric, g.decay, g.centered) != (first.metric, first.decay, first.centered):
                raise ConfigError(
                    "GateBank gates must share metric, decay and centring: expected "
                    f"{(first.metric, first.decay, first.centered)}, got {(g.metric, g.decay, g.centered)}")
        self.gates = list(gates)
        self.metric, self.decay, self.centered = first.metric, first.decay, first.centered
        device = first.ratio_leaf()[0].device
        n = [g.n_units for g in self.gates]
        self.n_max = max(n)
        units = torch.tensor(n, dtype=torch.float32, device=device)
        self.n_units = units[:, None]  # (G, 1)
        self.lam = torch.tensor([g.lam for g in self.gates], device=device)[:, None]  # (G, 1)
        self.max_ratio = [g.max_ratio for g in self.gates]
        self.min_units = torch.tensor([g.min_units for g in self.gates], device=device)[:, None]
        steps = torch.arange(self.n_max, device=device)
        self.pad = steps[None, :] >= units[:, None]  # (G, N_max)
        # (G, N_max): N_max - 1 .. 0 per row, float32 as the ranks (exact below 2^24 units)
        self._rank_of_place = steps.flip(0).to(torch.float32).expand(len(self.gates), self.n_max)
        # 1/(2N) rounded from double, as the per-gate path adds the Python float 0.5 / N
        shift = [0.5 / k if self.centered else 0.0 for k in n]
        self.shift = torch.tensor(shift, dtype=torch.float64, device=device).float()[:, None]
        # element e of gate g reads unit unit_of_element[e] of row g: flat (g * N_max + unit)
        self.element_index = [g.unit_of_element.to(device) + i * self.n_max for i, g in enumerate(self.gates)]
        self._index_cache: dict[tuple[int, ...], torch.Tensor] = {}
        self.matrix = torch.zeros(len(self.gates), self.n_max, dtype=torch.float32, device=device)
        for i, g in enumerate(self.gates):  # each gate's importance becomes a view of its row
            self.matrix[i, :g.n_units].copy_(g.importance.detach().to(torch.float32))
            g.importance = self.matrix[i, :g.n_units]
        # where each gate's ratio lives (core.ratios): an entry of the stacked ratios, or its own Parameter
        self._sources = [(g.__dict__.get("_ratio_slot"), g._parameters.get("a")) for g in self.gates]
        self._store = self._whole_store()
        self._store_at = None if self._store is None else self._sources[0][0][:2]  # (owner, attribute name)
        self._leaves = distinct_leaves(self.gates)  # the Parameters the ratios are read from
        k = 0 if self._store is None else self._store.numel()
        # the plan: the stacked ratios as they are (the bank's first k gates, in order), then the
        # others' own Parameters; None: a view per gate (tied entries, a part of the stacked ratios)
        self._own = [a for _, a in self._sources[k:]] if all(a is not None for _, a in self._sources[k:]) else None
        # the projection into [0, max_ratio] of every Parameter the ratios are read from, in one
        # _foreach clamp each way (the stacked ratios' bounds per entry)
        if self._own is not None:
            self._clamped = ([self._store] if self._store is not None else []) + self._own
            self._upper = ([torch.tensor(self.max_ratio[:k], dtype=torch.float32, device=device)] if k else []) \
                + [torch.tensor(m, dtype=torch.float32, device=device) for m in self.max_ratio[k:]]

    def _whole_store(self) -> torch.Tensor | None:
        """The stacked ratios when the bank's first gates are all of their entries, in order."""
        first = self._sources[0][0]
        store = None if first is None else first[0]._parameters.get(first[1])
        if store is None or store.dim() != 1 or store.numel() > len(self._sources):
            return None
        slots = [s for s, _ in self._sources[:store.numel()]]
        return store if all(s is not None and s[0] is first[0] and s[2] == i for i, s in enumerate(slots)) else None

    # ------------------------------------------------------------------ bookkeeping
    def valid_for(self, gates: Sequence[Any]) -> bool:
        """Whether the bank still describes ``gates``: the same gate objects and ``a``
        parameters, every importance buffer still a view of the bank's matrix (a
        ``model.to(device)``, ``load_state_dict(assign=True)`` or an assignment replaces it),
        and the settings the bank batches unchanged."""
        # (the modules' own dicts: nn.Module.__getattr__ on every gate twice per step is host time)
        setting = (self.metric, self.decay, self.centered, True)
        return (len(gates) == len(self.gates)
                and (self._store is None or self._store_at[0]._parameters.get(self._store_at[1]) is self._store)
                and all(g is h and g.__dict__.get("_ratio_slot") is slot and g._parameters.get("a") is a
                        and g._buffers.get("importance")._base is self.matrix
                        and (g.metric, g.decay, g.centered, g.normalize) == setting
                        for g, h, (slot, a) in zip(gates, self.gates, self._sources)))

    # ------------------------------------------------------------------ Eq. 2 and 3
    def ratios(self, fresh: bool = False) -> torch.Tensor:
        """The pruning ratios (G, 1), each first projected into [0, 1 - n_min/N] in place
        (what :meth:`~dmscale.core.topk.DifferentiableTopK.clamp_` does, for all gates at once).

        The stacked tensor is shared by later calls (unless ``fresh``) while no ratio changed
        (their version counters: an optimiser step, ``fill_``, ``load_state_dict``) or started or
        stopped requiring a gradient (frozen depth), and the grad mode is the same: the forward's
        masks and the resource loss's then hang off one (G, 1) node and each ``a`` gets one
        gradient per backward, not one per evaluation (one addition per gate fewer per step).
        The stack saves no tensor for its backward, so a task and a resource loss may still be
        backpropagated one after the other. The width dims' ratios are one Parameter
        (:mod:`dmscale.core.ratios`): when the bank's first gates are its entries in order, it is
        read as it is (then a cat with the depth dims' own), one clamp for all of them."""
        mode = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
        leaves = self._leaves
        shared = self.__dict__.get("_stacked")
        if not fresh and shared is not None and shared[0] == mode \
                and all(a._version == v and a.requires_grad is r for a, (v, r) in zip(leaves, shared[1])):
            return shared[2]
        store, own = self._store, self._own
        with torch.no_grad():
            if own is None:  # a view per gate
                for g in self.gates:
                    g.clamp_()
            else:
                torch._foreach_clamp_min_(self._clamped, 0.0)
                torch._foreach_clamp_max_(self._clamped, self._upper)
        if own is None:
            stacked = torch.stack([g.a for g in self.gates])
        elif store is None:
            stacked = torch.stack(own)
        else:
            stacked = torch.cat([store, torch.stack(own)]) if own else store
        stacked = stacked[:, None]
        self._stacked = (mode, [(a._version, a.requires_grad) for a in leaves], stacked)
        return stacked

    def integer_ranks(self) -> torch.Tensor:
        """``#{j : c_gi > c_gj}`` per row (G, N_max), whole numbers in float32 (exact below 2^24
        units; the positions divide them), ties broken by index (lower index ranks higher),
        padding ranked above every unit (it never counts). Computed again only when an
        importance changed (the matrix's version counter; every gate's buffer is a view of it,
        so an update through either counts)."""
        return self._per_importance("_ranks", self._integer_ranks)

    def _per_importance(self, name: str, compute: Any) -> torch.Tensor:
        """``compute()``, kept under ``name`` until the importance matrix changes (its version
        counter) or inference mode is switched."""
        key = (self.matrix._version, torch.is_inference_mode_enabled())
        shared = self.__dict__.get(name)
        if shared is None or shared[0] != key:
            shared = self.__dict__[name] = (key, compute())
        return shared[1]

    def _integer_ranks(self) -> torch.Tensor:
        c = self.matrix.detach().masked_fill(self.pad, float("inf"))
        # most important first; stable: among ties the lower index first, so it ranks higher
        order = torch.argsort(c, dim=1, descending=True, stable=True)
        rank = torch.empty(order.shape, dtype=torch.float32, device=order.device)
        return rank.scatter_(1, order, self._rank_of_place)  # the unit at place q has rank N_max - 1 - q

    def unit_soft_masks(self, fresh: bool = False) -> torch.Tensor:
        """Eq. 3 for every gate, (G, N_max): ``sigmoid(lam (c' - a))``, c' = rank / N
        (+ 1/(2N) centred); padding columns hold values that no element reads. ``fresh``: the
        ratios stacked anew (see :meth:`ratios`)."""
        return torch.sigmoid(self.lam * (self.unit_positions() - self.ratios(fresh)))

    def unit_positions(self) -> torch.Tensor:
        """c' = rank / N (+ 1/(2N) centred) of every unit (G, N_max), computed again only when
        an importance changed (as :meth:`integer_ranks`)."""
        return self._per_importance(
            "_positions", lambda: self.integer_ranks() / self.n_units + self.shift)

    def unit_hard_masks(self) -> torch.Tensor:
        """0/1 per unit (G, N_max): the k = round((1 - a) N) highest-ranked units, k clamped
        to [n_min, N], computed on the device (required groups are not applied here: gates
        that have them use their own :meth:`~dmscale.core.topk.DifferentiableTopK.hard_mask`)."""
        with torch.no_grad():
            a = self.ratios()
            k = torch.round((1.0 - a) * self.n_units)
            k = torch.minimum(torch.maximum(k, self.min_units.to(k.dtype)), self.n_units)
            return (self.integer_ranks() >= self.n_units - k).to(torch.float32)

    def elements(self, units: torch.Tensor, which: Sequence[int]) -> torch.Tensor:
        """The element masks of gates ``which`` concatenated, from a (G, N_max) unit mask."""
        key = tuple(which)
        index = self._index_cache.get(key)
        if index is None:  # built once per set of gates (the same every forward), a normal tensor
            parts = [self.element_index[i] for i in which]
            with torch.inference_mode(False):
                index = torch.cat(parts) if len(parts) != 1 else parts[0]
            self._index_cache[key] = index
        return units.reshape(-1)[index]

    def rows(self, active: tuple[bool, ...]) -> "BankRows":
        """The bank's importance update restricted to the rows ``active`` (one flag per gate;
        the (G,) tensor is copied to the device once per value)."""
        cache = self.__dict__.setdefault("_rows_cache", {})
        if active not in cache:
            with torch.inference_mode(False):
                cache[active] = torch.tensor(active, device=self.matrix.device)
        return BankRows(self, cache[active])

    # ------------------------------------------------------------------ Eq. 4
    @torch.no_grad()
    def update_importance(self, unit_mask: torch.Tensor, grad: torch.Tensor,
                          rows: torch.Tensor | None = None) -> None:
        """Eq. 4 for every gate from the gradient of the (G, N_max) unit mask: each row is
        updated as :func:`~dmscale.core.importance.update_importance` updates one gate (a row
        with a non-finite score is left unchanged), on the device. ``rows`` ((G,) bool):
        only these rows are updated (the others' masks were not used this step)."""
        score_fn = IMPORTANCE_METRICS[self.metric]
        if score_fn is None:
            return
        score = score_fn(unit_mask.detach().float(), grad.detach().float()).masked_fill(self.pad, 0.0)
        ok = torch.isfinite(score).all(dim=1, keepdim=True)  # (G, 1)
        if rows is not None:
            ok = ok & rows[:, None]
        updated = self.matrix * self.decay + score * (1.0 - self.decay)
        self.matrix.copy_(torch.where(ok, updated, self.matrix))


class BankRows:
    """A :class:`GateBank` update restricted to the rows of the gates whose mask a forward used
    with a gradient (``active``, (G,) bool): what the pending all-reduce and the gradient hook
    call as ``update_importance``."""

    def __init__(self, bank: GateBank, active: torch.Tensor) -> None:
        self.bank, self.active = bank, active

    def update_importance(self, unit_mask: torch.Tensor, grad: torch.Tensor) -> None:
        self.bank.update_importance(unit_mask, grad, rows=self.active)
