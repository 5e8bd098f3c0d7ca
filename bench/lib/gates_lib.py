"""The paper's gradient-based alternatives to DMS's top-k, as baseline gates (issue 10, table 1).

Paper Table 2 compares DMS_p- with three other ways of making a structure differentiable;
each is implemented here behind dmscale's :class:`~dmscale.core.topk.StructuralGate` protocol and
plugged into a search with ``dms.SearchConfig(gate_factory=...)``, so the masks act where
DMS's act, and the cost model, the budget solver, the export and the export check are the
same for every gate. Every gate keeps the units it ranks highest with
:func:`dmscale.core.topk.top_units` (at least ``min_units``, one per required group).

* :class:`MESGate` -- multiple element selection (Herrmann et al., 2020): one learnable logit
  per unit. During the search the forward multiplies a Gumbel-sigmoid sample, hard in the
  forward and soft in the backward (straight-through); the cost r_c is the *expected* cost,
  from the keep probabilities sigmoid(theta). Export: the units with theta > 0.
* :class:`SNSGate` -- single number selection (Wan et al., 2020, FBNetV2's channel masking):
  logits over candidate widths, p = softmax(beta); mask_i = sum_j p_j * [unit i is among the
  c_j most important], importance = DMS's Taylor moving average. Export: argmax_j c_j. One
  logit per candidate width, every width 1..N by default (the paper's count of learnable
  parameters for SNS equals MES's), ``candidates=8`` gives the {1/8, ..., 8/8} grid.
* :class:`GETGate` -- gradient-estimate top-k (Yao et al., 2021): DMS's scalar ratio ``a``
  and Taylor importance, but the forward uses the *hard* top-k mask and the backward a
  straight-through estimate, d m_i / d a = -1 for every unit (the mask of a random subset of
  (1 - a) N units has mean 1 - a). The cost r_c is then the export's exact cost.
* :func:`no_normalization` -- DMS without importance normalisation (paper Table 12,
  ``c'_i = c_i``): :class:`~dmscale.core.topk.DifferentiableTopK` with ``normalize=False``.

Example:
    >>> import torch
    >>> from torch import nn
    >>> import dmscale as dms
    >>> net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    >>> s = dms.prepare(net, torch.randn(2, 8), dms.SearchConfig(target=0.5, gate_factory=MESGate))
    >>> type(s.gates.width[0]).__name__, s.gates.width[0].a.shape
    ('MESGate', torch.Size([32]))
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from dmscale.core.ratios import ratio_key
from dmscale.core.topk import DifferentiableTopK, GateFactory, integer_rank, top_units

__all__ = ["MESGate", "SNSGate", "GETGate", "no_normalization", "GATES", "gate_factory", "n_structure_params"]


class _LogitGate(DifferentiableTopK):
    """Shared parts of the gates with one logit per unit or per candidate (``a`` is a vector).

    Unit bookkeeping (``step``, ``min_units``, ``required_groups``, ``expand``) and the Taylor
    importance buffer come from :class:`DifferentiableTopK`; ``a`` is replaced.
    """

    def __init__(self, size: int, n_logits: int, init: float | torch.Tensor, **kw: Any) -> None:
        kw.pop("normalize", None)
        super().__init__(size, **kw)
        value = torch.full((n_logits,), float(init)) if not isinstance(init, torch.Tensor) else init.float()
        self.a = nn.Parameter(value)

    @property
    def max_ratio(self) -> float:
        return 1.0 - self.min_units / self.n_units

    def clamp_(self) -> None:
        """Logits are unconstrained."""

    def soft_mask(self) -> torch.Tensor:
        """Element masks the cost r_c is computed from."""
        return self.expand(self.unit_cost_mask())

    def unit_cost_mask(self) -> torch.Tensor:
        raise NotImplementedError

    def unit_hard_mask(self) -> torch.Tensor:
        keep = top_units(self.rank(), self.hard_count(), self.required_groups)
        return keep.to(self.a.dtype)

    def rank(self) -> torch.Tensor:
        """Integer rank of every unit, 0 = least important."""
        return integer_rank(self.importance)


class MESGate(_LogitGate):
    """Multiple element selection: a Gumbel-sigmoid gate per unit (Herrmann et al., 2020).

    Args:
        size, step, min_keep, temperature, importance: as :class:`DifferentiableTopK`
            (temperature is unused; importance is not used to rank: theta is).
        init: initial logit of every unit (3.0: kept with probability 0.95).
        tau: temperature of the Gumbel-sigmoid relaxation of the backward pass.
    """

    ranks_by_importance = False  # theta ranks the units; export needs no importance

    def __init__(self, size: int, init: float = 3.0, tau: float = 0.5, **kw: Any) -> None:
        step = int(kw.get("step", 1))
        n_units = -(-size // step)
        super().__init__(size, n_units, init, **kw)
        if tau <= 0:
            raise ValueError(f"MESGate needs tau > 0, got {tau}")
        self.tau = float(tau)

    def unit_soft_mask(self) -> torch.Tensor:
        """Training: a hard Gumbel-sigmoid sample with the relaxed sample's gradient;
        evaluation: the keep probabilities."""
        theta = self.a
        if not self.training:
            return torch.sigmoid(theta)
        u = torch.rand_like(theta).clamp(1e-6, 1 - 1e-6)
        noise = torch.log(u) - torch.log1p(-u)  # logistic = difference of two Gumbels
        soft = torch.sigmoid((theta + noise) / self.tau)
        hard = (theta + noise > 0).to(soft.dtype)
        return hard + (soft - soft.detach())

    def unit_cost_mask(self) -> torch.Tensor:
        """Keep probabilities: r_c is the expected cost."""
        return torch.sigmoid(self.a)

    def rank(self) -> torch.Tensor:
        return integer_rank(self.a.detach())

    def hard_count(self) -> int:
        k = int((self.a.detach() > 0).sum().item())
        return max(self.min_units, min(self.n_units, k))

    def set_count(self, k: int) -> None:
        """Shift every logit so that exactly the ``k`` largest are positive."""
        k = max(self.min_units, min(self.n_units, int(k)))
        with torch.no_grad():
            theta = torch.sort(self.a.detach(), descending=True).values
            hi = float(theta[k - 1]) if k > 0 else float(theta[0]) + 1.0
            lo = float(theta[k]) if k < self.n_units else hi - 1.0
            if hi == lo:  # ties: spread them by rank, keeping the order
                self.a.add_(1e-3 * integer_rank(self.a.detach()).to(self.a.dtype))
                return self.set_count(k)
            self.a.sub_((hi + lo) / 2)

    def update_importance(self, unit_mask: torch.Tensor, grad: torch.Tensor) -> None:
        """MES ranks by its logits; the Taylor importance is not used."""


class SNSGate(_LogitGate):
    """Single number selection: a softmax over candidate widths (Wan et al., 2020).

    Args:
        candidates: "all" (every count of units from ``min_units`` to N: one logit per
            unit, as in the paper's Table 2) or an int J (counts ceil(j N / J), j = 1..J).
        init: initial logits (0: every candidate equally likely, FBNetV2's start).
    """

    def __init__(self, size: int, candidates: int | str = "all", init: float = 0.0, **kw: Any) -> None:
        step = int(kw.get("step", 1))
        n_units = -(-size // step)
        probe = DifferentiableTopK(size, **{k: v for k, v in kw.items() if k != "normalize"})
        low = max(1, probe.min_units)
        if candidates == "all":
            counts = list(range(low, n_units + 1))
        elif isinstance(candidates, int) and candidates >= 1:
            counts = sorted({max(low, -(-j * n_units // candidates)) for j in range(1, candidates + 1)})
        else:
            raise ValueError(f"SNSGate candidates must be 'all' or an int >= 1, got {candidates!r}")
        super().__init__(size, len(counts), init, **kw)
        self.register_buffer("counts", torch.tensor(counts, dtype=torch.long), persistent=False)

    def _prefix(self) -> torch.Tensor:
        """(J, n_units) 0/1: row j keeps the counts[j] most important units."""
        rank = self.rank()  # 0 = least important
        return (rank.unsqueeze(0) >= self.n_units - self.counts.unsqueeze(1)).to(self.a.dtype)

    def unit_soft_mask(self) -> torch.Tensor:
        """sum_j softmax(beta)_j * prefix_j (deterministic; also the cost's mask)."""
        return torch.softmax(self.a, 0) @ self._prefix()

    def unit_cost_mask(self) -> torch.Tensor:
        return self.unit_soft_mask()

    def hard_count(self) -> int:
        return int(self.counts[int(torch.argmax(self.a.detach()))])

    def set_count(self, k: int) -> None:
        """Make the largest candidate count <= k (else the smallest) the argmax."""
        fits = (self.counts <= int(k)).nonzero().flatten()
        j = int(fits[-1]) if len(fits) else 0
        with torch.no_grad():
            top = float(self.a.detach().max())
            self.a[j] = top + 1.0


class GETGate(DifferentiableTopK):
    """Gradient-estimate top-k: DMS's ratio ``a`` and importance, a hard forward mask and a
    straight-through gradient d m_i / d a = -1 (Yao et al., 2021)."""

    def __init__(self, size: int, **kw: Any) -> None:
        kw["normalize"] = True
        super().__init__(size, **kw)

    def unit_soft_mask(self) -> torch.Tensor:
        self.clamp_()
        hard = self.unit_hard_mask()
        keep = (1.0 - self.a).expand(self.n_units)
        return hard + (keep - keep.detach())


def no_normalization(size: int, **kw: Any) -> DifferentiableTopK:
    """DMS's gate with ``c'_i = c_i`` (paper Table 12)."""
    kw["normalize"] = False
    return DifferentiableTopK(size, **kw)


GATES: dict[str, GateFactory | None] = {
    "dms": None,  # DifferentiableTopK, the library's default
    "mes": MESGate,
    "sns": SNSGate,
    "get": GETGate,
    "dms_nonorm": no_normalization,
}


def gate_factory(name: str, **options: Any) -> GateFactory | None:
    """The factory of a gate by its name in :data:`GATES` (options bound with functools.partial)."""
    if name not in GATES:
        raise ValueError(f"unknown gate {name!r}: expected one of {sorted(GATES)}")
    factory = GATES[name]
    if options:
        if factory is None:
            raise ValueError("the DMS gate takes its options from SearchConfig, not here")
        factory = functools.wraps(factory)(functools.partial(factory, **options))  # keeps the name
    return factory


def n_structure_params(gates: Any) -> int:
    """Learnable structural parameters of a search (the paper's "N" column)."""
    seen: set[Any] = set()
    total = 0
    for g in list(gates.width) + list(gates.depth):
        if ratio_key(g) not in seen:  # (tied dims share one ratio)
            seen.add(ratio_key(g))
            total += g.a.numel()
    return total
