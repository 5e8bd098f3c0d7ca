"""Saving and resuming a :class:`~dmscale.search.searcher.Searcher`: its ``state_dict`` (gates,
config with the resolved ``align``, target and supernet cost, depth freezing, the settle
phase's state, a measured latency profile) and ``load_state_dict`` with its config check.

:class:`SearcherStateMixin` expects the Searcher's ``model``, ``space``, ``example_inputs``,
``config``, ``align``, ``gates``, ``_costs``, ``target_cost``, ``supernet_cost``,
``settle_state``, ``settled_at`` and ``freeze_depth``; the Searcher provides them.

Example:
    >>> import torch, dmscale as dms
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> s = dms.prepare(net, torch.randn(2, 4), dms.SearchConfig("params", 0.5))
    >>> state = s.state_dict()
    >>> sorted(state)[:4]
    ['config', 'depth_frozen', 'gates', 'settle_weight']
    >>> s.load_state_dict(state); s.target_cost == state["target_cost"]
    True
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from torch import nn

from dmscale.core.errors import ConfigError
from dmscale.search.config import SearchConfig
from dmscale.search.config_state import config_differences, config_state
from dmscale.search.settle import SettleState
from dmscale.trace.discover import SearchSpace

__all__ = ["SearcherStateMixin"]


class SearcherStateMixin:
    """``state_dict`` and ``load_state_dict``; mixed into :class:`~dmscale.search.searcher.Searcher`."""

    model: nn.Module
    space: SearchSpace
    example_inputs: Any
    config: SearchConfig
    align: int
    gates: Any
    _costs: dict[str, Any]
    target_cost: float
    supernet_cost: float
    target_costs: dict[str, float]
    supernet_costs: dict[str, float]
    settle_state: SettleState
    settle_states: dict[str, SettleState]
    settled_at: float | None
    freeze_depth: Callable[[bool], None]
    _require_synced: Callable[[str], None]

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: structural parameters, importance, config, target
        (with several budgets also ``"budgets"``: every one's target, supernet cost and settle
        weight; a single budget's state is as before ``targets`` existed)."""
        self._require_synced("state_dict()")
        state = {"gates": {k: v.detach().clone() for k, v in self.gates.state_dict().items()},
                 "config": self._config_state(), "target_cost": self.target_cost,
                 "supernet_cost": self.supernet_cost, "depth_frozen": self.gates.depth_frozen,
                 "settled_at": self.settled_at, "settle_weight": self.settle_state.weight}
        if "latency" in self._costs:  # a resumed search keeps the measured cost scale
            state["latency_profile"] = self._costs["latency"].state_dict()
        if len(self.config.budgets) > 1:  # every budget's (the primary's also in the keys above)
            state["budgets"] = {r: {"target_cost": self.target_costs[r], "supernet_cost": self.supernet_costs[r],
                                    "settle_weight": self.settle_states[r].weight,
                                    "grown_at": self.settle_states[r].grown_at}
                                for r in self.config.budgets}
        return state

    def _config_state(self) -> dict[str, Any]:
        """:func:`config_state` with the resolved ``align`` (an auto align on another device
        would search another space: a resume compares the value searched with)."""
        return {**config_state(self.config), "align": self.align}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (same model architecture and config)."""
        diff = config_differences(state["config"], replace(self.config, align=self.align))
        if diff:
            raise ConfigError(f"searcher config differs from the saved one ({diff}); build the "
                              "searcher with the saved config to load this state")
        self.gates.load_state_dict(state["gates"])
        if "latency_profile" in state:
            from dmscale.cost.latency import LatencyCostModel

            options = {**self.config.latency_options, "profile": state["latency_profile"]}
            self._costs["latency"] = LatencyCostModel(self.model, self.space, self.example_inputs, **options)
        for r, saved in state.get("budgets", {}).items():  # several budgets: every one's
            self.target_costs[r] = float(saved["target_cost"])
            self.supernet_costs[r] = float(saved["supernet_cost"])
            self.settle_states[r] = SettleState(weight=float(saved["settle_weight"]), grown_at=saved.get("grown_at"))
        self.target_cost = float(state["target_cost"])
        self.supernet_cost = float(state["supernet_cost"])
        self.freeze_depth(bool(state.get("depth_frozen", False)))
        self.settle_state = SettleState(weight=float(state.get("settle_weight", self.config.resource_weight)),
                                        settled_at=state.get("settled_at"),
                                        grown_at=self.settle_state.grown_at if "budgets" in state else None)
