"""The settle phase's two pieces: the band loss and the structural learning-rate anneal.

In the last ``SearchConfig.settle`` of a search (see :meth:`dmscale.Searcher.resource_loss`)
the resource loss stops following the paper's one-sided Eq. 6 on a decaying r_t and instead
holds the exact cost r_c (the export's, with the soft cost's gradient) inside a band of the
final target, with a weight that grows while the cost stays over the band (a dual ascent:
:data:`WEIGHT_GROWTH` per step); once the cost has reached the target, the structural
learning rate anneals to 0 so the ratios stop where the band loss put them, and (with
``SearchConfig.settle_hold``) is 0 while the cost is inside the band
(:meth:`dmscale.Searcher.structure_lr_scale`).

    >>> import torch
    >>> r_c = torch.tensor(110.0, requires_grad=True)
    >>> round(float(band_loss(r_c, 100.0, (0.98, 1.0), weight=1.0)), 4)  # log(110 / 100)
    0.0953
    >>> float(band_loss(torch.tensor(99.0), 100.0, (0.98, 1.0), weight=1.0))  # inside: 0
    0.0
    >>> [round(cosine_anneal(p, start=0.6), 2) for p in (0.5, 0.6, 0.8, 1.0)]
    [1.0, 1.0, 0.5, 0.0]
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["band_loss", "inside_band", "cosine_anneal", "SettleState", "WEIGHT_GROWTH"]

# Per step over the band, the settle phase's resource weight is multiplied by this (a dual
# ascent on the constraint): the task loss's pull on the ratios can hold the cost over the
# target at any fixed weight, a growing weight cannot. x1.1 is x117 after 50 steps over.
WEIGHT_GROWTH = 1.1


def inside_band(cost: float, target: float, band: tuple[float, float]) -> bool:
    """Whether ``cost`` lies in ``band`` x ``target`` (edges included): where :func:`band_loss`
    is zero and the settle phase's hold keeps the structure.

        >>> inside_band(99.0, 100.0, (0.98, 1.0)), inside_band(100.5, 100.0, (0.98, 1.0))
        (True, False)
    """
    return band[0] * target <= cost <= band[1] * target


def band_loss(r_c: torch.Tensor, target: float, band: tuple[float, float], weight: float,
              cost: float | None = None) -> torch.Tensor:
    """``weight * log(r_c / (high * target))`` over the band, ``weight * log(low * target /
    r_c)`` under it, 0 inside: Eq. 6's hinge on the top edge, plus a pull back up for a
    structure the previous steps pushed under the band (its budget would go unused)."""
    cost = float(r_c.detach()) if cost is None else cost  # (``cost``: r_c's value, read already)
    if inside_band(cost, target, band):
        return r_c.new_zeros(()).float()
    low, high = band[0] * target, band[1] * target
    if cost > high:
        return (weight * torch.log(r_c / high)).float()
    return (weight * torch.log(low / r_c)).float()


def cosine_anneal(progress: float, start: float | None) -> float:
    """1 before ``start`` (or when ``start`` is None), then a cosine from 1 at ``start`` to 0
    at progress 1."""
    if start is None or progress <= start:
        return 1.0
    q = (float(progress) - start) / max(1.0 - start, 1e-12)
    return 0.5 * (1.0 + math.cos(math.pi * min(q, 1.0)))


@dataclass
class SettleState:
    """What the settle phase carries from step to step (in the searcher's ``state_dict``).

    ``weight``: the band loss's weight, grown by :data:`WEIGHT_GROWTH` once per step (per
    distinct progress, so micro-batches of one accumulated step count once) while the cost is
    over the band; ``settled_at``: the progress at which the exact cost first reached the
    target (None: not yet).

        >>> st = SettleState(weight=1.0)
        >>> _ = st.loss(torch.tensor(120.0), 0.7, 100.0, (0.98, 1.0)); st.weight
        1.1
        >>> st.reach(0.8, exact=99.0, target=100.0); st.settled_at
        0.8
    """

    weight: float
    settled_at: float | None = None
    grown_at: float | None = None

    def reach(self, progress: float, exact: float, target: float) -> None:
        """Note the first progress at which the exact cost is at or under the target."""
        if self.settled_at is None and exact <= target * (1 + 1e-9):
            self.settled_at = float(progress)

    def loss(self, r_c: torch.Tensor, progress: float, target: float, band: tuple[float, float]) -> torch.Tensor:
        """:func:`band_loss` at the current weight, then the weight's growth when over."""
        cost = float(r_c.detach())  # the step's one decision on the host
        loss = band_loss(r_c, target, band, self.weight, cost)
        if cost > band[1] * target and self.grown_at != float(progress):
            self.weight *= WEIGHT_GROWTH
            self.grown_at = float(progress)
        return loss
