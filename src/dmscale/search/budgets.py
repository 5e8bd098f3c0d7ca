"""Several budgets of one search (``SearchConfig(targets={...})``): every budget's costs and
targets, whether the hard structure meets and fills them, and the budget solver with several
constraints. The primary (first) budget's ``target_cost``, ``supernet_cost`` and
``settle_state`` keep their single-budget meaning.

:class:`BudgetsMixin` expects the Searcher's ``config``, ``gates``, ``target_costs``,
``supernet_costs``, ``settle_states``, ``soft_costs()``, ``_exact_costs(kind)`` and
``structure_parameters()``; the Searcher provides them.

Example:
    >>> import torch, dmscale as dms
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> s = dms.prepare(net, torch.randn(2, 4), dms.SearchConfig(targets={"params": 0.6, "macs": 0.5}))
    >>> s.within_budgets(), sorted(s.meet_target()["budgets"]), s.within_budgets()
    (False, ['macs', 'params'], True)
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Iterator

import torch

from dmscale.core.ratios import ratio_key
from dmscale.search.settle import SettleState
from dmscale.search.solver import solve_budget

__all__ = ["BudgetsMixin", "distinct_gates"]


def distinct_gates(topks: list[Any]) -> list[Any]:
    """One gate per distinct ``a`` (layer-uniform dims share theirs)."""
    seen: set[Hashable] = set()
    out = []
    for t in topks:
        key = ratio_key(t)
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


class BudgetsMixin:
    """Every budget's costs, the within / fills tests and the several-budget solver; mixed into
    :class:`~dmscale.search.searcher.Searcher`."""

    config: Any
    gates: Any
    target_costs: dict[str, float]
    supernet_costs: dict[str, float]
    settle_states: dict[str, SettleState]
    soft_costs: Callable[[], dict[str, torch.Tensor]]
    _exact_costs: Callable[..., tuple[float, ...]]
    structure_parameters: Callable[[], Iterator[torch.nn.Parameter]]

    # the primary (first) budget's, as before several budgets existed
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

    def resources(self) -> dict[str, Any]:
        """Soft and hard cost now, the final target and the supernet's cost of the primary
        budget (``config.resource``); with several budgets (``SearchConfig(targets=...)``) also
        ``"budgets"``: the same four numbers per resource.

            >>> import torch, dmscale as dms
            >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
            >>> s = dms.prepare(net, torch.randn(2, 4), dms.SearchConfig(targets={"params": 0.6, "macs": 0.5}))
            >>> res = s.resources()
            >>> res["resource"], sorted(res["budgets"]), res["budgets"]["macs"]["target"]
            ('params', ['macs', 'params'], 48.0)
        """
        with torch.no_grad():
            soft = {r: float(c) for r, c in self.soft_costs().items()}
        hard = dict(zip(self.config.budgets, self._exact_costs("hard")))
        per = {r: {"soft": soft[r], "hard": hard[r], "target": self.target_costs[r],
                   "supernet": self.supernet_costs[r]} for r in self.config.budgets}
        out = {"resource": self.config.resource, **per[self.config.resource]}
        if len(per) > 1:
            out["budgets"] = per
        return out

    def within_budgets(self) -> bool:
        """Whether the hard structure's exact cost is at or under every budget's target."""
        costs = self._exact_costs("hard")
        return all(c <= self.target_costs[r] * (1 + 1e-9) for r, c in zip(self.config.budgets, costs))

    def fills_budgets(self) -> bool:
        """Whether the exact cost of the hard structure reaches ``budget_band[0]`` x target in
        every budget (a budget left unused is capacity the found model could have had)."""
        low = self.config.budget_band[0]
        costs = self._exact_costs("hard")
        return all(c >= low * self.target_costs[r] for r, c in zip(self.config.budgets, costs))

    def _meet_targets(self, widths: list[Any], depth: list[Any], iterations: int) -> None:
        """The budget solver with several budgets. One solve moves every gate from the learned
        ratios; when it leaves a budget under ``budget_band[0]`` x its target and depth is
        searched, it also tries depth fixed at its current hard value and depth all kept (a
        common offset cannot trade heads for layers: a KV-cache budget met by dropping a layer
        can leave the parameter budget out of reach), and keeps the structure whose least-filled
        budget is fullest."""
        targets = tuple(self.target_costs[r] for r in self.config.budgets)
        costs = lambda cache=None: self._exact_costs("hard", cache=cache)  # noqa: E731
        leaves = list(self.structure_parameters())
        start = [p.detach().clone() for p in leaves]

        def attempt(open_depth: bool, with_depth: bool) -> tuple[float, float, list[torch.Tensor]]:
            with torch.no_grad():
                for p, v in zip(leaves, start):
                    p.copy_(v)
            if open_depth:
                for t in depth:
                    t.set_count(t.n_units)
            gates = distinct_gates(widths + depth) if with_depth else widths
            solve_budget(gates, costs, targets, iterations,
                         refill=widths if with_depth and depth and widths else None)
            shares = [c / t for c, t in zip(costs(), targets)]
            fits = all(c <= t * (1 + 1e-9) for c, t in zip(costs(), targets))
            return (float(fits) + min(shares), sum(shares), [p.detach().clone() for p in leaves])

        tried = [attempt(False, True)]
        if depth and widths and not self.fills_budgets():
            tried += [attempt(False, False), attempt(True, False)]
        best = max(tried, key=lambda x: (x[0], x[1]))
        with torch.no_grad():
            for p, v in zip(leaves, best[2]):
                p.copy_(v)

