"""The resource loss of :class:`~dmscale.search.searcher.Searcher` and its schedule: the
target r_t at a progress (Eq. 10), the settle phase and its band loss, the structure learning
rate's factor, and freezing depth (width-only phase).

:class:`ResourceLossMixin` expects ``self.config``, ``self.gates``, ``self.target_cost``,
``self.supernet_cost``, ``self.settle_state``, ``self.soft_cost()`` and
``self._exact_cost(kind)``, and for several budgets (``SearchConfig(targets=...)``)
``self.target_costs``, ``self.supernet_costs``, ``self.settle_states``, ``self.soft_costs()``
and ``self._exact_costs(kind)`` (per resource); the Searcher provides them. Each budget has
its own term (its own r_t, its own settle weight); the loss is their sum.

Example:
    >>> import torch, dmscale as dms
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> s = dms.prepare(net, torch.randn(2, 4), dms.SearchConfig("params", 0.5, settle=0.2))
    >>> s.target_at(0.0) == s.supernet_cost, s.settling(0.5), s.settling(0.9)
    (True, False, True)
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from dmscale.search.settle import SettleState, cosine_anneal, inside_band

__all__ = ["ResourceLossMixin"]


class ResourceLossMixin:
    """Resource loss, target schedule and settle phase; mixed into
    :class:`~dmscale.search.searcher.Searcher`."""

    config: Any
    gates: Any
    target_cost: float
    supernet_cost: float
    settle_state: SettleState
    target_costs: dict[str, float]
    supernet_costs: dict[str, float]
    settle_states: dict[str, SettleState]
    soft_cost: Callable[[], torch.Tensor]
    soft_costs: Callable[[], dict[str, torch.Tensor]]
    _exact_cost: Callable[..., float]
    _exact_costs: Callable[..., tuple[float, ...]]

    def target_at(self, progress: float, resource: str | None = None) -> float:
        """r_t of ``resource`` (default: the primary budget's) at ``progress`` in [0, 1]:
        Eq. 10 with e / e_max = progress / d, held at the final target once that reaches 1,
        where d = ``schedule_end``, or ``1 - settle`` when that is smaller (the settle phase
        runs at the final target); or constant."""
        resource = resource or self.config.resource
        target, supernet = self.target_costs[resource], self.supernet_costs[resource]
        if self.config.schedule == "constant":
            return target
        decay = min(self.config.schedule_end, 1.0 - self.config.settle)
        p = min(max(float(progress) / decay, 0.0), 1.0)
        return (target / supernet)**p * supernet

    @property
    def settled_at(self) -> float | None:
        """Progress at which the settle phase's exact cost first reached the target, or None.
        With several budgets: at which every budget's exact cost was first inside its
        ``budget_band`` (under its target is not enough: depth freezes there, and a budget
        left far under might then be out of reach, e.g. a KV-cache budget met by dropping a
        layer leaves that layer's parameters unusable)."""
        return self.settle_state.settled_at

    def settling(self, progress: float) -> bool:
        """Whether ``progress`` lies in the settle phase (the last ``config.settle`` of the
        search, where the loss lands the structure on the budget)."""
        return self.config.settle > 0 and float(progress) >= 1.0 - self.config.settle

    def structure_lr_scale(self, progress: float) -> float:
        """Factor for the structural parameters' learning rate at ``progress``: 1 until the
        settle phase has brought the exact cost to the target (:attr:`settled_at`), then a
        cosine from 1 to 0 over the rest of the search, so the ratios stop moving where the
        band loss put them; with ``config.settle_hold`` (default) 0 while the exact cost is
        inside the band, so a structure that entered it stays (the cost follows the kept
        counts, which the ratios set and which do not move at lr 0; with uneven units, a
        ``width_step`` whose last unit is short, it can still change with which units are kept,
        and the factor is decided again every step). A search too short to reach its target keeps
        its full lr (the finish phase and budget solver then land it). Multiply the structure
        group's base ``lr`` by it before each step (``dmscale search`` and the trainer
        integrations do).

            >>> import torch, dmscale as dms
            >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
            >>> s = dms.prepare(net, torch.randn(2, 4), dms.SearchConfig(target=0.9, settle=0.5))
            >>> _ = s.resource_loss(0.5)  # all open: over the target, full lr
            >>> s.settled_at, s.structure_lr_scale(0.75)
            (None, 1.0)
            >>> with torch.no_grad():
            ...     _ = [p.fill_(0.5) for p in s.structure_parameters()]  # half of every width
            >>> _ = s.resource_loss(0.5)  # at or under the target: landed, depth frozen
            >>> s.settled_at, [round(s.structure_lr_scale(p), 2) for p in (0.5, 0.75, 1.0)]
            (0.5, [1.0, 0.5, 0.0])
        """
        if not self.settling(progress):
            return 1.0
        if self.config.settle_hold and self.settled_at is not None and self.in_band():
            return 0.0  # landed and inside the band: hold the ratios where they are
        return cosine_anneal(progress, self.settled_at)

    def in_band(self) -> bool:
        """Whether the exact (export's) cost is inside ``config.budget_band`` x target: where
        the settle phase's band loss is zero (the same comparisons, so the hold and the band
        loss's weight growth never act on the same step)."""
        costs = self._exact_costs("hard")
        return all(inside_band(c, self.target_costs[r], self.config.budget_band)
                   for r, c in zip(self.config.budgets, costs))

    def resource_loss(self, progress: float = 1.0) -> torch.Tensor:
        """``resource_weight * log(r_c / r_t)`` when r_c > r_t, else 0 (Eq. 6); in the settle
        phase (:meth:`settling`) the band loss of :func:`dmscale.search.settle.band_loss` instead.

        From ``width_only_from`` on, and in the settle phase once the exact cost has reached
        the target (:attr:`settled_at`), depth masks are frozen at their hard values. In the
        settle phase a step whose cost is over the band raises the band loss's weight
        (``settle_state.weight``, kept in :meth:`state_dict`) once per distinct ``progress``, so
        micro-batches of one accumulated step count once.
        """
        cfg, settling = self.config, self.settling(progress)
        self.advance(progress)
        if len(cfg.budgets) == 1:
            return self._budget_loss(cfg.resource, self.soft_cost(), progress, settling)
        return sum(self._budget_loss(r, r_c, progress, settling)
                   for r, r_c in self.soft_costs().items())

    def _budget_loss(self, resource: str, r_c: torch.Tensor, progress: float, settling: bool) -> torch.Tensor:
        """One budget's term of :meth:`resource_loss` from its soft cost ``r_c``."""
        cfg = self.config
        if cfg.cost_forward == "exact" or settling:  # forward: the export's cost; backward: soft
            r_c = r_c + (self._exact_cost_tensor("hard", resource) - r_c.detach())
        if settling:  # zero inside budget_band x target, log of the distance outside
            return self.settle_states[resource].loss(r_c, progress, self.target_costs[resource],
                                                     cfg.budget_band)
        r_t = self.target_at(progress, resource)
        # Eq. 6 as max(log(r_c / r_t), 0): zero at or under the target, on the device (no
        # host synchronisation to compare r_c with r_t)
        return (cfg.resource_weight * torch.relu(torch.log(r_c / r_t))).float()

    def advance(self, progress: float) -> None:
        """The step at ``progress``'s phase: whether the settle phase has landed (the exact
        cost at or under the target) and so whether depth is frozen. :meth:`resource_loss` calls
        it; a loop that must know before the forward (DDP leaves frozen depth out) calls it first.

            >>> import torch, dmscale as dms
            >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
            >>> s = dms.prepare(net, torch.randn(2, 4), dms.SearchConfig(target=0.9, width_only_from=0.8))
            >>> s.advance(0.5); s.gates.depth_frozen  # before the width-only phase
            False
            >>> s.advance(0.8); s.gates.depth_frozen
            True
        """
        settling, wo = self.settling(progress), self.config.width_only_from
        if settling and self.settled_at is None:  # once landed, the exact cost is not needed here
            if len(self.config.budgets) == 1:
                self.settle_state.reach(progress, self._exact_cost("hard"), self.target_cost)
            elif self.in_band():  # several budgets: landed once every one is inside its band
                self.settle_state.settled_at = float(progress)
        self.freeze_depth((settling and self.settled_at is not None) or (wo is not None and progress >= wo))

    def freeze_depth(self, frozen: bool = True) -> None:
        """Fix depth at its hard value (width-only phase): hard depth masks, no gradient."""
        self.gates.depth_frozen = frozen
        for t in self.gates.depth:
            t.a.requires_grad_(not frozen)

    def calibrated_resource_loss(self, weight: float) -> torch.Tensor:
        """The resource loss against the final target, with the soft cost scaled by the current
        hard/soft ratio (detached).

        With few channels per dimension the soft cost r_c can sit well below the exact cost of
        the hard masks (a dimension kept whole still has soft masks of 0.5 - 0.9 on its least
        important channels), so a search can meet its target in soft terms and export a model
        over it. The finish phase pushes on the calibrated cost until the hard cost is under.
        """
        res = self.resources()
        per = res.get("budgets", {res["resource"]: res})
        losses = []
        for r, soft in self.soft_costs().items():
            ratio = per[r]["hard"] / max(per[r]["soft"], 1e-12)
            calibrated = soft * ratio
            if float(calibrated.detach()) > per[r]["target"]:  # one term per budget over its target
                losses.append((max(weight, 1.0) * torch.log(calibrated / per[r]["target"])).float())
        return sum(losses) if losses else torch.zeros((), device=self.gates._device())
