"""The differentiable top-k operator of DMS (paper Sec. 3.1, Eq. 1-3, App. A.1.1).

One :class:`DifferentiableTopK` models one structural hyperparameter k (a width, a number of
heads, a number of blocks) out of N elements with a single learnable pruning ratio ``a``:

* importance normalisation (Eq. 2): ``c'_i = #{j : c_i > c_j} / N``, ties broken by index
  (the lower index counts as more important), so c' is evenly spread on [0, 1);
* soft mask (Eq. 3): ``m_i = sigmoid(lambda * (c'_i - a))`` with lambda = N for widths and
  4N for depths and heads; ``dm_i/da = -lambda * m_i * (1 - m_i)``;
* centring (on by default, ``centered=False`` is Eq. 3 verbatim): c' is taken at the middle
  of its rank bin, ``c'_i + 1/(2N)``. Eq. 2 puts c' on {0, ..., (N-1)/N} while k = round((1-a)N),
  so verbatim the soft masks sum to k - 1/2 and a layer at its minimum width (k = 1) is
  costed at half its size; centred, the soft count equals k and m_i > 0.5 exactly on the
  kept elements;
* hard count ``k = round((1 - a) * N)``; the hard mask keeps the k highest-ranked elements;
* a coarse search space (App. A.1.1): ``step`` contiguous elements form one unit that shares
  one importance and one mask, and ``a`` is clamped to ``[0, 1 - n_min / N]`` (in units).

Example:
    >>> import torch
    >>> from dmscale.core.topk import DifferentiableTopK
    >>> topk = DifferentiableTopK(8)
    >>> with torch.no_grad():
    ...     _ = topk.a.fill_(0.5)
    >>> topk.hard_count(), topk.hard_mask().tolist()
    (4, [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
"""

from __future__ import annotations

import math
from typing import Callable, Protocol, runtime_checkable

import torch
from torch import nn

from dmscale.core.errors import ConfigError
from dmscale.core.importance import IMPORTANCE_METRICS, update_importance

__all__ = ["DifferentiableTopK", "StructuralGate", "GateFactory", "normalized_rank", "integer_rank",
           "top_units"]


@runtime_checkable
class StructuralGate(Protocol):
    """What the rest of dmscale needs from a width/depth gate.

    :class:`DifferentiableTopK` is the paper's gate; a baseline (Gumbel gates, straight-through
    top-k, ...) can be dropped in beside it by implementing these members and passing its
    constructor as ``SearchConfig(gate_factory=...)`` (see :data:`GateFactory`).

    ``unit_soft_mask`` is what the forward pass multiplies in during the search (it may be
    stochastic); ``soft_mask`` is what the differentiable cost r_c is computed from (for
    :class:`DifferentiableTopK` both are Eq. 3). ``hard_mask`` must keep exactly
    ``hard_count()`` units, at least ``min_units`` and one of each ``required_groups`` (use
    :func:`top_units`); ``set_count(k)`` moves the parameters so that ``hard_count() == k``
    (the budget solver). ``a`` may be a scalar (a pruning ratio) or a vector (per-element or
    per-candidate logits). A gate that ranks its units by its own parameters rather than by
    ``importance`` (e.g. per-element logits) sets the class attribute
    ``ranks_by_importance = False``, so an untrained ``importance`` buffer does not block
    :meth:`Searcher.export`.
    """

    a: nn.Parameter  # the learnable structural parameter(s)
    size: int  # elements N
    n_units: int  # units (elements grouped by step)
    step: int
    min_units: int
    importance: torch.Tensor

    @property
    def max_ratio(self) -> float: ...

    def clamp_(self) -> None: ...

    def unit_soft_mask(self) -> torch.Tensor: ...

    def expand(self, unit_mask: torch.Tensor) -> torch.Tensor: ...

    def soft_mask(self) -> torch.Tensor: ...

    def hard_mask(self) -> torch.Tensor: ...

    def hard_count(self) -> int: ...

    def set_count(self, k: int) -> None: ...

    def update_importance(self, unit_mask: torch.Tensor, grad: torch.Tensor) -> None: ...


def integer_rank(c: torch.Tensor) -> torch.Tensor:
    """``#{j : c_i > c_j}`` as integers (0 = least important), ties broken by index.

    Example:
        >>> integer_rank(torch.tensor([0.3, 0.1, 0.3, 0.9])).tolist()
        [2, 0, 1, 3]
    """
    n = c.numel()
    # ascending sort of the flipped vector, stable: among ties the higher index comes first
    order = torch.argsort(c.detach().flip(0), stable=True)
    rank = torch.empty(n, dtype=torch.long, device=c.device)
    rank[(n - 1) - order] = torch.arange(n, device=c.device)
    return rank


GateFactory = Callable[..., StructuralGate]
"""Builds one gate: called as ``factory(size, step=..., min_keep=..., temperature=...,
importance=..., normalize=...)`` (the signature of :class:`DifferentiableTopK`, which is the
default factory) for every width and depth dimension of a search."""


def top_units(rank: torch.Tensor, k: int, required_groups: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Bool mask of the ``k`` highest-ranked units (``rank``: 0 = least important, all distinct).

    When ``required_groups`` are given and a group has no kept unit, its best unit takes the
    place of the lowest-ranked kept unit that no group needs (k is unchanged): every layer
    that writes part of a shared width keeps at least one of its channels.

    Example:
        >>> top_units(torch.tensor([2, 0, 1, 3]), 2).tolist()
        [True, False, False, True]
        >>> top_units(torch.tensor([2, 0, 1, 3]), 2, [torch.tensor([1, 2])]).tolist()
        [False, False, True, True]
    """
    n = rank.numel()
    keep = rank >= n - k
    groups = [g.to(keep.device) for g in (required_groups or [])]
    for group in groups:
        if keep[group].any() or k == 0:
            continue
        needed = torch.zeros_like(keep)
        for g in groups:
            kept = g[keep[g]]
            if len(kept) == 1:
                needed[kept] = True
        spare = keep & ~needed
        if not spare.any():
            continue
        drop = torch.nonzero(spare).flatten()[rank[spare].argmin()]
        keep[drop] = False
        keep[group[rank[group].argmax()]] = True
    return keep


def normalized_rank(c: torch.Tensor) -> torch.Tensor:
    """Eq. 2: ``c'_i = (1/N) #{j : c_i > c_j}`` with ties broken deterministically.

    Among equal importances the element with the lower index ranks higher, so an all-zero
    importance (the start of a search) keeps the first elements.

    Example:
        >>> normalized_rank(torch.tensor([0.3, 0.1, 0.3, 0.9])).tolist()
        [0.5, 0.0, 0.25, 0.75]
    """
    return integer_rank(c).to(c.dtype) / c.numel()


class DifferentiableTopK(nn.Module):
    """A learnable top-k over ``size`` elements (grouped in units of ``step``).

    Args:
        size: number of elements N (channels, heads, blocks).
        step: elements per unit; units share importance and mask (coarse search space).
        min_keep: smallest number of elements the search may keep (x_min); rounded up to units.
        temperature: lambda multiplier, lambda = temperature * n_units (1 for width, 4 for
            depth and heads, paper A.1.1).
        importance: "taylor" (default), "snip", "fisher" or "index".
        normalize: rank-normalise importance (Eq. 2); False is the paper's ablation c' = c.
        centered: shift normalised importance by half a rank bin (see the module docs).
        decay: moving-average decay of the importance (0.99, Eq. 4).
    """

    def __init__(
        self,
        size: int,
        step: int = 1,
        min_keep: int = 1,
        temperature: float = 1.0,
        importance: str = "taylor",
        normalize: bool = True,
        decay: float = 0.99,
        centered: bool = True,
    ) -> None:
        super().__init__()
        if size < 1:
            raise ConfigError(f"DifferentiableTopK needs size >= 1, got {size}")
        if step < 1:
            raise ConfigError(f"step must be >= 1, got {step}")
        if not 0 <= min_keep <= size:
            raise ConfigError(f"min_keep must be in [0, {size}], got {min_keep}")
        if not temperature > 0:
            raise ConfigError(f"temperature must be > 0, got {temperature}")
        if not 0.0 <= decay < 1.0:
            raise ConfigError(f"decay must be in [0, 1), got {decay}")
        if importance not in IMPORTANCE_METRICS:
            raise ConfigError(
                f"importance must be one of {sorted(IMPORTANCE_METRICS)}, got {importance!r}"
            )
        self.size = int(size)
        self.step = int(step)
        self.n_units = math.ceil(size / step)
        # fewest units whose smallest choice (the short last unit among them) has min_keep
        last = size - (self.n_units - 1) * step
        self.min_units = 0 if min_keep == 0 else (
            1 if min_keep <= last else 1 + math.ceil((min_keep - last) / step))
        self.temperature = float(temperature)
        self.metric = importance
        self.normalize = bool(normalize)
        self.centered = bool(centered) and bool(normalize)
        self.decay = float(decay)
        self.a = nn.Parameter(torch.zeros(()))
        init = torch.zeros(self.n_units)
        if importance == "index":  # static: earlier units are more important
            init = torch.arange(self.n_units, 0, -1, dtype=torch.float32)
        self.register_buffer("importance", init)
        # unit -> element expansion; the last unit may be shorter than `step`
        unit_of = torch.arange(size) // step
        self.register_buffer("unit_of_element", unit_of, persistent=False)
        # groups of units of which the hard mask keeps at least one (set by the searcher:
        # the channels one layer writes into a shared width, so no layer loses them all)
        self.required_groups: list[torch.Tensor] = []

    @property
    def a(self) -> torch.Tensor:
        """The pruning ratio a, (): the gate's own Parameter, or once a search holds its width
        gates' ratios in one Parameter (:mod:`dmscale.core.ratios`) a view of its entry (read,
        and written under ``torch.no_grad()``, as the Parameter was; its gradient:
        :attr:`ratio_grad`)."""
        leaf, i = self.ratio_leaf()
        return leaf if i is None else leaf[i]

    def ratio_leaf(self) -> tuple[nn.Parameter, int | None]:
        """The Parameter that holds ``a`` and a's index in it (None: ``a`` is that Parameter),
        without making a view (what per-step code reads the device and grad flag from)."""
        slot = self.__dict__.get("_ratio_slot")
        if slot is not None:
            owner, name, i = slot
            return owner._parameters[name], i
        param = self._parameters.get("a")
        if param is None:  # (an AttributeError: hasattr and nn.Module's registration rely on it)
            raise AttributeError(f"{type(self).__name__} has no ratio 'a'")
        return param, None

    @property
    def ratio_grad(self) -> torch.Tensor | None:
        """The gradient accumulated for ``a`` (a.grad of the gate's own Parameter, or its entry
        of the stacked ratios' gradient), None before any."""
        leaf, i = self.ratio_leaf()
        grad = leaf.grad
        return grad if grad is None or i is None else grad[i]

    @property
    def lam(self) -> float:
        """lambda of Eq. 3: temperature * N (N counted in units)."""
        return self.temperature * self.n_units

    @property
    def max_ratio(self) -> float:
        """Upper bound of ``a``: 1 - n_min / N (in units)."""
        return 1.0 - self.min_units / self.n_units

    def clamp_(self) -> None:
        """Project ``a`` into [0, 1 - n_min/N] in place (called before every mask)."""
        with torch.no_grad():
            self.a.clamp_(0.0, self.max_ratio)

    def normalized_importance(self) -> torch.Tensor:
        """c' per unit (Eq. 2, + 1/(2N) when centred), or the raw importance (ablation)."""
        c = self.importance
        if not self.normalize:
            return c
        return normalized_rank(c) + (0.5 / self.n_units if self.centered else 0.0)

    def unit_soft_mask(self) -> torch.Tensor:
        """Eq. 3 per unit: sigmoid(lambda * (c' - a)); differentiable in ``a``."""
        self.clamp_()
        c = self.normalized_importance().to(self.a.dtype)
        return torch.sigmoid(self.lam * (c - self.a))

    def hard_count(self) -> int:
        """Units kept: k = round((1 - a) * N), at least n_min (Sec. 3.1.1).

        Without normalisation (ablation) the count is #{c_i > a}, at least n_min.
        """
        self.clamp_()
        if self.normalize:
            k = int(torch.round((1.0 - self.a.detach()) * self.n_units).item())
        else:
            k = int((self.importance > self.a.detach()).sum().item())
        return max(self.min_units, min(self.n_units, k))

    def set_count(self, k: int) -> None:
        """Set ``a`` so that the hard mask keeps ``k`` units (clamped to [n_min, N])."""
        k = max(self.min_units, min(self.n_units, int(k)))
        with torch.no_grad():
            if self.normalize:
                self.a.fill_(1.0 - (k + 0.25) / self.n_units)  # round((1-a)N) = k, clear of .5
            else:  # between the k-th and (k+1)-th largest raw importance
                c = torch.sort(self.importance, descending=True).values
                hi = float(c[k - 1]) if k > 0 else float(c[0]) + 1.0
                lo = float(c[k]) if k < self.n_units else hi - 1.0
                self.a.fill_((hi + lo) / 2)
            self.clamp_()

    def unit_hard_mask(self) -> torch.Tensor:
        """0/1 per unit: the k highest-ranked units (k from :meth:`hard_count`).

        When ``required_groups`` are set and a group has no kept unit, its best unit takes
        the place of the lowest-ranked kept unit that no group needs (k is unchanged).
        """
        keep = top_units(integer_rank(self.importance), self.hard_count(), self.required_groups)
        return keep.to(self.a.dtype)

    def expand(self, unit_mask: torch.Tensor) -> torch.Tensor:
        """Unit mask (n_units,) -> element mask (size,)."""
        if self.step == 1:
            return unit_mask
        return unit_mask[self.unit_of_element]

    def soft_mask(self) -> torch.Tensor:
        """Element soft mask (size,)."""
        return self.expand(self.unit_soft_mask())

    def hard_mask(self) -> torch.Tensor:
        """Element hard mask (size,) with exactly the kept elements at 1."""
        return self.expand(self.unit_hard_mask())

    def kept_elements(self) -> list[int]:
        """Indices of the elements the hard mask keeps."""
        return torch.nonzero(self.hard_mask() > 0.5).flatten().tolist()

    def update_importance(self, unit_mask: torch.Tensor, grad: torch.Tensor) -> None:
        """Moving-average importance update from the task-loss gradient (Eq. 4)."""
        update_importance(self.importance, unit_mask, grad, self.metric, self.decay)

    def extra_repr(self) -> str:
        return (
            f"size={self.size}, step={self.step}, min_units={self.min_units}, "
            f"lam={self.lam:g}, importance={self.metric}"
        )
