"""What a structure costs: the masks of the gates and the cost model of each resource.

:class:`SearchCosts` owns a search's cost models (built on first use: the latency model times
the model) and turns the gates' masks into costs: the soft cost r_c (differentiable in every
``a``), the exact cost of the hard masks (what the export counts), of all masks open (the
supernet) and of the smallest structure. The :class:`~dmscale.search.searcher.Searcher` holds
one as ``searcher.costs``; its :class:`~dmscale.search.budget.Budget` reads costs through it.

Example:
    >>> import torch, dmscale as dms
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> s = dms.prepare(net, torch.randn(2, 4), dms.SearchConfig("params", 0.5))
    >>> s.costs.exact(None), s.costs.profile()  # all open: 4*8+8 + 8*2+2; one hidden unit: 4+1 + 2+2
    (58.0, {'min': 9.0, 'max': 58.0})
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dmscale.core.errors import ConfigError
from dmscale.core.masks import Gates
from dmscale.cost.registry import RunNote, resource_named, resources
from dmscale.search.config import SearchConfig
from dmscale.trace.discover import SearchSpace

__all__ = ["SearchCosts", "HardMaskCache"]

# each dim's last two hard masks by the value of its ``a`` (see :meth:`SearchCosts.masks`)
HardMaskCache = dict[int, list[Any]]


def _cached_hard_mask(t: Any, cache: HardMaskCache) -> torch.Tensor:
    """``t.hard_mask()``, reused while ``t.a`` has a value seen in its last two calls."""
    a = t.a.detach()
    key = float(a) if a.numel() == 1 else a.cpu().numpy().tobytes()
    seen = cache.setdefault(id(t), [])
    for k, mask in seen:
        if k == key:
            return mask
    mask = t.hard_mask()
    seen.append((key, mask))
    del seen[:-2]
    return mask


class SearchCosts:
    """The cost of the gates' masks in every resource of a search.

    Args:
        model: the searched model (the latency model times it).
        space: its search space (each cost model's layers and dims).
        example_inputs: inputs the latency model runs the model on.
        config: the search's config (``resource``, ``budgets``, ``latency_options``).
        gates: the attached gates whose masks are costed.
    """

    def __init__(self, model: nn.Module, space: SearchSpace, example_inputs: Any,
                 config: SearchConfig, gates: Gates) -> None:
        self.model, self.space, self.example_inputs = model, space, example_inputs
        self.config, self.gates = config, gates
        self.models: dict[str, Any] = {}  # resource -> cost model, built on first use

    def device(self) -> torch.device:
        """Where the gates, and so the costs, live."""
        return self.gates._device()

    def model_of(self, resource: str | None = None) -> Any:
        """The cost model of ``resource`` (default: the primary budget's), built on first use
        by the registered resource (:meth:`Resource.cost_model
        <dmscale.cost.registry.Resource.cost_model>`)."""
        resource = resource or self.config.resource
        if resource not in self.models:
            self.models[resource] = resource_named(resource).cost_model(
                self.model, self.space, self.example_inputs, self.config.latency_options)
        return self.models[resource]

    def state_dict(self) -> dict[str, Any]:
        """The costs' part of the searcher's ``state_dict``: what a built cost model keeps
        (its resource's ``state_key``, e.g. ``"latency_profile"``: a resumed search keeps the
        measured cost scale), else nothing."""
        out = {}
        for name, model in self.models.items():
            key = resource_named(name).state_key
            if key is not None:
                out[key] = model.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Rebuild the cost models whose saved state ``state`` holds (no timing for latency)."""
        for res in resources():
            if res.state_key is not None and res.state_key in state:
                self.models[res.name] = res.cost_model(self.model, self.space, self.example_inputs,
                                                       self.config.latency_options, saved=state[res.state_key])

    def run_notes(self) -> list[RunNote]:
        """What a run records about every budget's cost model after the search
        (:meth:`Resource.run_note <dmscale.cost.registry.Resource.run_note>`: latency's fit)."""
        notes = (resource_named(r).run_note(self.model_of(r)) for r in self.config.budgets)
        return [n for n in notes if n is not None]

    # ------------------------------------------------------------------ masks
    def masks(self, kind: str, cache: HardMaskCache | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(width mask with trailing 1, flat depth mask) of kind "soft", "hard", "open", "min".

        ``cache`` (hard masks only): each dim's last two hard masks by the value of its ``a``,
        for the budget solver, which changes one dim at a time (the importances stay fixed).
        """
        g = self.gates

        def flat(parts: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat(parts) if parts else torch.zeros(0, device=g._device())

        if kind == "soft" or (kind == "hard" and cache is None):  # batched (no importance hook)
            return g.masks(kind)

        def pick(t: Any) -> torch.Tensor:
            if kind == "hard":
                return t.hard_mask() if cache is None else _cached_hard_mask(t, cache)
            if kind == "min":  # the smallest units: the short last one and the first full ones
                unit = torch.zeros(t.n_units, dtype=torch.float32, device=t.a.device)
                if t.min_units > 0:
                    unit[t.n_units - 1] = 1.0
                    unit[:t.min_units - 1] = 1.0
                return t.expand(unit)
            return torch.ones(t.size, dtype=torch.float32, device=t.a.device)

        width = g.assemble_width([pick(t) for t in g.width])
        return width, flat([pick(t) for t in g.depth])

    # ------------------------------------------------------------------ costs
    def exact(self, hard: str | None, resource: str | None = None,
              cache: HardMaskCache | None = None) -> float:
        """The cost of the masks of kind ``hard`` (None: all open) in ``resource``."""
        return float(self.exact_tensor(hard, resource, cache))

    def exact_all(self, hard: str | None, cache: HardMaskCache | None = None) -> tuple[float, ...]:
        """:meth:`exact` of every budget, in ``config.budgets`` order (one set of masks)."""
        with torch.no_grad():
            w, d = self.masks("open" if hard is None else hard, cache)
            return tuple(float(self.model_of(r)(w, d)) for r in self.config.budgets)

    def exact_tensor(self, hard: str | None, resource: str | None = None,
                     cache: HardMaskCache | None = None) -> torch.Tensor:
        """The cost of the masks of kind ``hard`` (None: all open) as a () float64 tensor on
        the gates' device (no host synchronisation for hard masks without ``cache``)."""
        kind = "open" if hard is None else hard
        with torch.no_grad():
            w, d = self.masks(kind, cache)
            return self.model_of(resource)(w, d)

    def soft(self, resource: str | None = None) -> torch.Tensor:
        """r_c of ``resource`` (default: the primary budget's) from the current soft masks
        (differentiable in every ``a``)."""
        w, d = self.masks("soft")
        return self.model_of(resource)(w, d)

    def soft_all(self) -> dict[str, torch.Tensor]:
        """r_c of every budget from one set of soft masks (``config.budgets`` order)."""
        w, d = self.masks("soft")
        return {r: self.model_of(r)(w, d) for r in self.config.budgets}

    def profile(self, resource: str | None = None) -> dict[str, float]:
        """Smallest and largest cost of ``resource`` (default: the primary budget's) this
        search space can reach."""
        return {"min": self.exact("min", resource), "max": self.exact(None, resource)}

    def latency_fit(self) -> dict[str, Any]:
        """The latency model's fit report; see ``LatencyCostModel.fit_report``."""
        if self.config.resource != "latency":
            raise ConfigError(f"latency_fit() needs resource='latency', this search uses {self.config.resource!r}")
        return self.model_of("latency").fit_report()
