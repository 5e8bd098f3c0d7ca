"""The budget of a search: its targets, the resource loss that pulls the structure to them, the
target schedule and the settle phase.

:class:`Budget` holds, per budget (``SearchConfig.budgets``, ``{resource: target}``; the first
is ``config.resource``'s, the primary): the supernet's cost, the final target and the settle
phase's state (:class:`~dmscale.search.settle.SettleState`). From them and the costs of the
current masks (a :class:`~dmscale.search.costs.SearchCosts`, given) it computes r_t (paper
Eq. 10), the resource loss (Eq. 6, or the settle phase's band loss), the structural
learning-rate scale and whether the hard structure meets and fills its budgets. Each budget
has its own term (its own r_t, its own settle weight); the loss is their sum.

The :class:`~dmscale.search.searcher.Searcher` holds one as ``searcher.budget`` and applies
what it decides to the gates (depth frozen or not: :meth:`Budget.advance`).

Example:
    >>> import torch, dmscale as dms
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> s = dms.prepare(net, torch.randn(2, 4), dms.SearchConfig("params", 0.5, settle=0.2))
    >>> b = s.budget
    >>> b.target_at(0.0) == b.supernet_cost, b.settling(0.5), b.settling(0.9)
    (True, False, True)
"""

from __future__ import annotations

from typing import Any

import torch

from dmscale.core.errors import ConfigError
from dmscale.search.config import SearchConfig
from dmscale.search.costs import SearchCosts
from dmscale.search.settle import SettleState, cosine_anneal, inside_band

__all__ = ["Budget"]


class Budget:
    """Targets, resource loss, target schedule and settle phase of a search.

    Args:
        config: the search's config (``budgets``, ``schedule``, ``settle``, ``budget_band``,
            ``resource_weight``, ``cost_forward``, ``width_only_from``, ``settle_hold``).
        costs: the costs of the gates' masks (soft, hard, open, smallest).
        hint: appended to the error of a target out of reach (why the smallest structure is
            as large as it is, e.g. the width alignment); empty for none.

    Raises:
        ConfigError: a target outside what the search space can reach.
    """

    def __init__(self, config: SearchConfig, costs: SearchCosts, hint: str = "") -> None:
        self.config, self.costs = config, costs
        # the search's budgets, held (Budgets: {resource: target} and the band); the first is
        # config.resource's
        self.budgets = budgets = config.budgets
        # per budget: the supernet's cost, the final target, the settle phase's state
        self.supernet_costs: dict[str, float] = {r: float(costs.exact(None, r)) for r in budgets}
        self.target_costs: dict[str, float] = {r: self._resolve_target(r, hint) for r in budgets}
        self.settle_states: dict[str, SettleState] = {
            r: SettleState(weight=float(config.resource_weight)) for r in budgets}

    def _resolve_target(self, resource: str, hint: str) -> float:
        """The target of ``resource`` as a cost: a fraction (<= 1) of the supernet's, or absolute."""
        t = float(self.budgets[resource])
        target = t * self.supernet_costs[resource] if t <= 1 else t
        bounds = self.costs.profile(resource)
        low, high = bounds["min"], bounds["max"]
        if not low - 1e-9 <= target <= high + 1e-9:
            raise ConfigError(
                f"target {resource} = {target:,.0f} is outside what this search "
                f"space can reach: [{low:,.0f} (smallest), {high:,.0f} (supernet)]; pass a target "
                f"between {low / high:.3g} and 1 (a fraction of the supernet) or between "
                f"{low:,.0f} and {high:,.0f}" + hint
            )
        return target

    # ------------------------------------------------------------------ the primary budget's
    @property
    def target_cost(self) -> float:
        """The final target of the primary budget (``config.resource``); every budget's:
        :attr:`target_costs`."""
        return self.target_costs[self.config.resource]

    @target_cost.setter
    def target_cost(self, value: float) -> None:
        self.target_costs[self.config.resource] = float(value)

    @property
    def supernet_cost(self) -> float:
        """The supernet's cost in the primary budget's resource (every budget's: :attr:`supernet_costs`)."""
        return self.supernet_costs[self.config.resource]

    @supernet_cost.setter
    def supernet_cost(self, value: float) -> None:
        self.supernet_costs[self.config.resource] = float(value)

    @property
    def settle_state(self) -> SettleState:
        """The primary budget's settle state; its ``settled_at`` is the search's (the progress
        at which every budget's exact cost first reached its target)."""
        return self.settle_states[self.config.resource]

    @settle_state.setter
    def settle_state(self, value: SettleState) -> None:
        self.settle_states[self.config.resource] = value

    @property
    def settled_at(self) -> float | None:
        """Progress at which the settle phase's exact cost first reached the target, or None.
        With several budgets: at which every budget's exact cost was first inside its
        ``budget_band`` (under its target is not enough: depth freezes there, and a budget
        left far under might then be out of reach, e.g. a KV-cache budget met by dropping a
        layer leaves that layer's parameters unusable)."""
        return self.settle_state.settled_at

    # ------------------------------------------------------------------ schedule and phases
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
        return (target / supernet)**p * supernet  # Eq. 10: r_t = (r_target / r_supernet)^(e/e_max) r_supernet

    def settling(self, progress: float) -> bool:
        """Whether ``progress`` lies in the settle phase (the last ``config.settle`` of the
        search, where the loss lands the structure on the budget)."""
        return self.config.settle > 0 and float(progress) >= 1.0 - self.config.settle

    def advance(self, progress: float) -> bool:
        """Note whether the settle phase has landed at ``progress`` (the exact cost at or under
        the target; with several budgets every one inside its band) and return whether depth is
        frozen at this step: from ``width_only_from`` on, and in the settle phase once landed
        (:meth:`dmscale.Searcher.advance` applies it to the gates).

            >>> import torch, dmscale as dms
            >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
            >>> s = dms.prepare(net, torch.randn(2, 4), dms.SearchConfig(target=0.9, width_only_from=0.8))
            >>> s.budget.advance(0.5), s.budget.advance(0.8)  # before and in the width-only phase
            (False, True)
        """
        settling, wo = self.settling(progress), self.config.width_only_from
        if settling and self.settled_at is None:  # once landed, the exact cost is not needed here
            if len(self.budgets) == 1:
                self.settle_state.reach(progress, self.costs.exact_all("hard")[0], self.target_cost)
            elif self.in_band():  # several budgets: landed once every one is inside its band
                self.settle_state.settled_at = float(progress)
        return (settling and self.settled_at is not None) or (wo is not None and progress >= wo)

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
        integrations do, through :meth:`dmscale.Searcher.structure_lr_scale`).

            >>> import torch, dmscale as dms
            >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
            >>> s = dms.prepare(net, torch.randn(2, 4), dms.SearchConfig(target=0.9, settle=0.5))
            >>> _ = s.resource_loss(0.5)  # all open: over the target, full lr
            >>> s.budget.settled_at, s.budget.structure_lr_scale(0.75)
            (None, 1.0)
            >>> with torch.no_grad():
            ...     _ = [p.fill_(0.5) for p in s.structure_parameters()]  # half of every width
            >>> _ = s.resource_loss(0.5)  # at or under the target: landed, depth frozen
            >>> s.budget.settled_at, [round(s.budget.structure_lr_scale(p), 2) for p in (0.5, 0.75, 1.0)]
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
        costs = self.costs.exact_all("hard")
        return all(inside_band(c, self.target_costs[r], self.budgets.band)
                   for r, c in zip(self.budgets, costs))

    # ------------------------------------------------------------------ losses
    def loss(self, progress: float) -> torch.Tensor:
        """The resource loss at ``progress``, at the phase :meth:`advance` set (call it first:
        a frozen depth changes the soft cost): the sum over budgets of Eq. 6, or in the settle
        phase of the band loss (:func:`dmscale.search.settle.band_loss`). In the settle phase a
        step whose cost is over the band raises the band loss's weight (``settle_state.weight``,
        kept in :meth:`state_dict`) once per distinct ``progress``, so micro-batches of one
        accumulated step count once."""
        cfg, settling = self.config, self.settling(progress)
        if len(self.budgets) == 1:
            return self._term(cfg.resource, self.costs.soft(), progress, settling)
        return sum(self._term(r, r_c, progress, settling) for r, r_c in self.costs.soft_all().items())

    def _term(self, resource: str, r_c: torch.Tensor, progress: float, settling: bool) -> torch.Tensor:
        """One budget's term of :meth:`loss` from its soft cost ``r_c``."""
        cfg = self.config
        if cfg.cost_forward == "exact" or settling:  # forward: the export's cost; backward: soft
            r_c = r_c + (self.costs.exact_tensor("hard", resource) - r_c.detach())
        if settling:  # zero inside budget_band x target, log of the distance outside
            return self.settle_states[resource].loss(r_c, progress, self.target_costs[resource],
                                                     self.budgets.band)
        r_t = self.target_at(progress, resource)
        # Eq. 6 as max(log(r_c / r_t), 0): zero at or under the target, on the device (no
        # host synchronisation to compare r_c with r_t)
        return (cfg.resource_weight * torch.relu(torch.log(r_c / r_t))).float()

    def calibrated_loss(self, weight: float) -> torch.Tensor:
        """Eq. 6 against the final target, with the soft cost scaled by the current hard/soft
        ratio (detached).

        With few channels per dimension the soft cost r_c can sit well below the exact cost of
        the hard masks (a dimension kept whole still has soft masks of 0.5 - 0.9 on its least
        important channels), so a search can meet its target in soft terms and export a model
        over it. The finish phase pushes on the calibrated cost until the hard cost is under.
        """
        res = self.resources()
        per = res.get("budgets", {res["resource"]: res})
        losses = []
        for r, soft in self.costs.soft_all().items():
            ratio = per[r]["hard"] / max(per[r]["soft"], 1e-12)
            calibrated = soft * ratio
            if float(calibrated.detach()) > per[r]["target"]:  # one term per budget over its target
                losses.append((max(weight, 1.0) * torch.log(calibrated / per[r]["target"])).float())
        return sum(losses) if losses else torch.zeros((), device=self.costs.device())

    # ------------------------------------------------------------------ where the structure is
    def resources(self) -> dict[str, Any]:
        """Soft and hard cost now, the final target and the supernet's cost of the primary
        budget (``config.resource``); with several budgets (``SearchConfig(targets=...)``) also
        ``"budgets"``: the same four numbers per resource.

            >>> import torch, dmscale as dms
            >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
            >>> s = dms.prepare(net, torch.randn(2, 4), dms.SearchConfig(targets={"params": 0.6, "macs": 0.5}))
            >>> res = s.budget.resources()
            >>> res["resource"], sorted(res["budgets"]), res["budgets"]["macs"]["target"]
            ('params', ['macs', 'params'], 48.0)
            >>> s.budget.within(), sorted(s.meet_target()["budgets"]), s.budget.within()
            (False, ['macs', 'params'], True)
        """
        with torch.no_grad():
            soft = {r: float(c) for r, c in self.costs.soft_all().items()}
        hard = dict(zip(self.budgets, self.costs.exact_all("hard")))
        per = {r: {"soft": soft[r], "hard": hard[r], "target": self.target_costs[r],
                   "supernet": self.supernet_costs[r]} for r in self.budgets}
        out = {"resource": self.config.resource, **per[self.config.resource]}
        if len(per) > 1:
            out["budgets"] = per
        return out

    def within(self) -> bool:
        """Whether the hard structure's exact cost is at or under every budget's target."""
        costs = self.costs.exact_all("hard")
        return all(c <= self.target_costs[r] * (1 + 1e-9) for r, c in zip(self.budgets, costs))

    def fills(self) -> bool:
        """Whether the exact cost of the hard structure reaches ``budget_band[0]`` x target in
        every budget (a budget left unused is capacity the found model could have had)."""
        low = self.budgets.band[0]
        costs = self.costs.exact_all("hard")
        return all(c >= low * self.target_costs[r] for r, c in zip(self.budgets, costs))

    # ------------------------------------------------------------------ resuming
    def state_dict(self) -> dict[str, Any]:
        """The budget's part of the searcher's ``state_dict``: the primary budget's target,
        supernet cost and settle state at the top level (as before several budgets existed),
        with several budgets also ``"budgets"``: every one's."""
        state: dict[str, Any] = {"target_cost": self.target_cost, "supernet_cost": self.supernet_cost,
                                 "settled_at": self.settled_at, "settle_weight": self.settle_state.weight}
        if len(self.budgets) > 1:  # every budget's (the primary's also in the keys above)
            state["budgets"] = {r: {"target_cost": self.target_costs[r], "supernet_cost": self.supernet_costs[r],
                                    "settle_weight": self.settle_states[r].weight,
                                    "grown_at": self.settle_states[r].grown_at}
                                for r in self.budgets}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the keys of :meth:`state_dict` from a searcher's state (older states without
        ``settle_weight`` or ``settled_at`` load with the configured weight, not landed)."""
        for r, saved in state.get("budgets", {}).items():  # several budgets: every one's
            self.target_costs[r] = float(saved["target_cost"])
            self.supernet_costs[r] = float(saved["supernet_cost"])
            self.settle_states[r] = SettleState(weight=float(saved["settle_weight"]), grown_at=saved.get("grown_at"))
        self.target_cost = float(state["target_cost"])
        self.supernet_cost = float(state["supernet_cost"])
        self.settle_state = SettleState(weight=float(state.get("settle_weight", self.config.resource_weight)),
                                        settled_at=state.get("settled_at"),
                                        grown_at=self.settle_state.grown_at if "budgets" in state else None)
