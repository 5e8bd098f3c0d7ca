"""The Searcher: costs, hard masks, budget solver and export
(the config is :mod:`dmscale.search.config`, the discovery and gates :mod:`dmscale.search.setup`,
the resource loss and its schedule :mod:`dmscale.search.resource_loss`,
importance and its all-reduce :mod:`dmscale.search.importance_sync`,
``state_dict`` and resuming :mod:`dmscale.search.state`,
the self-checks :mod:`dmscale.export.selfcheck`, the structure dict :func:`dmscale.export.shrink.structure_of`).

Example:
    >>> import torch
    >>> from torch import nn
    >>> import dmscale as dms
    >>> net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    >>> x = torch.randn(2, 16)
    >>> searcher = dms.prepare(net, x, dms.SearchConfig(resource="params", target=0.5))
    >>> loss = net(x).pow(2).mean() + searcher.resource_loss(progress=1.0)
    >>> loss.backward()
    >>> small = searcher.export()
    >>> searcher.resources()["hard"] == dms.count(small, x)["params"]
    True
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator

import torch
from torch import nn

from dmscale.export.hf_sizes import check_uniform_depth
from dmscale.trace.discover import SearchSpace
from dmscale.core.errors import ConfigError
from dmscale.export.shrink import export_model, structure_of
from dmscale.core.masks import GATES_NAME, Gates
from dmscale.core.ratios import distinct_leaves
from dmscale.cost.resources import CostModel
from dmscale.search.config import COST_FORWARD, SearchConfig, resolve_align
from dmscale.search.importance_sync import ImportanceMixin
from dmscale.search.optimizer import STRUCTURE_LR, SearchOptimizer
from dmscale.search.resource_loss import ResourceLossMixin
from dmscale.search.settle import SettleState
from dmscale.search.setup import attach_gates, discover_space, model_device, unaligned_dims
from dmscale.export.selfcheck import run_example, verify_export, verify_open
from dmscale.search.solver import solve_budget
from dmscale.search.state import SearcherStateMixin
from dmscale.search.budgets import BudgetsMixin, distinct_gates

__all__ = ["SearchConfig", "Searcher", "prepare", "COST_FORWARD"]


def _cached_hard_mask(t: Any, cache: dict[int, list[Any]]) -> torch.Tensor:
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


class Searcher(BudgetsMixin, ResourceLossMixin, SearcherStateMixin, ImportanceMixin):
    """A DMS search attached to a model. Create it with :func:`prepare`.

    ``align`` is the width multiple the search keeps (``SearchConfig.align``, resolved on the
    model's device when None) and ``unaligned`` the channel dims it could not align (their
    size is not a multiple of it; they are searched without alignment).

    Every budget's costs and the solver with several budgets come from
    :class:`~dmscale.search.budgets.BudgetsMixin`, the resource loss and its schedule from
    :class:`~dmscale.search.resource_loss.ResourceLossMixin`, ``state_dict`` and
    ``load_state_dict`` from :class:`~dmscale.search.state.SearcherStateMixin`, importance from
    :class:`~dmscale.search.importance_sync.ImportanceMixin`.

    Non-finite losses: a backward through a NaN or infinite loss never changes importance
    (the update is skipped on the device), but it leaves NaN gradients on the weights and on
    the structural parameters, which an optimiser step would write into them for good. Skip
    such a step in your loop, as ``dmscale search`` does:

        >>> import torch
        >>> from torch import nn
        >>> import dmscale as dms
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> x, y = torch.randn(16, 4), torch.randint(0, 2, (16,))
        >>> searcher = dms.prepare(net, x, dms.SearchConfig(resource="params", target=0.5))
        >>> opt = torch.optim.SGD([{"params": searcher.model_parameters(), "lr": 0.1},
        ...                        {"params": searcher.structure_parameters(), "lr": 5e-3}])
        >>> for step in range(3):
        ...     loss = nn.functional.cross_entropy(net(x), y) + searcher.resource_loss(step / 3)
        ...     if not torch.isfinite(loss):
        ...         continue  # no backward, no step: weights, importance and structure untouched
        ...     opt.zero_grad(); loss.backward(); opt.step()
        >>> all(bool(torch.isfinite(p).all()) for p in searcher.structure_parameters())
        True
    """

    def __init__(self, model: nn.Module, example_inputs: Any, config: SearchConfig) -> None:
        self.model = model
        self.config = config
        self.example_inputs = example_inputs
        check_uniform_depth(model, config.layer_uniform, config.depth_unit)
        space = discover_space(model, example_inputs, config)
        self.space = space
        # the resolved width multiple (config.align, or the device's for "auto")
        self.align: int = resolve_align(config.align, model_device(model))
        # channel dims whose size is not a multiple of align: searched without it
        self.unaligned: list[str] = unaligned_dims(space, self.align)
        self.gates = self._attach(space)
        if config.verify and model_device(model).type != "meta":  # meta: no values to compare
            self._verify_open(space.example_output)
        self._costs: dict[str, Any] = {}
        budgets = config.budgets  # {resource: target}; the first is config.resource's
        # per budget: the supernet's cost, the final target, the settle phase's state
        self.supernet_costs: dict[str, float] = {r: float(self._exact_cost(None, r)) for r in budgets}
        self.target_costs: dict[str, float] = {r: self._resolve_target(r) for r in budgets}
        self.settle_states: dict[str, SettleState] = {
            r: SettleState(weight=float(config.resource_weight)) for r in budgets}
        if self.unaligned:
            warnings.warn(f"align={self.align}: {len(self.unaligned)} width dim(s) have a size that is "
                          f"not a multiple of {self.align} and are searched without alignment: "
                          f"{', '.join(self.unaligned[:5])}{' ...' if len(self.unaligned) > 5 else ''} "
                          "(Searcher.unaligned lists them)", stacklevel=3)

    # ------------------------------------------------------------------ setup
    def _attach(self, space: SearchSpace) -> Gates:
        gates, self.uniform_groups = attach_gates(self.model, space, self.config, align=self.align)
        return gates

    def _cost_model(self, resource: str | None = None) -> Any:
        resource = resource or self.config.resource
        if resource not in self._costs:
            if resource == "latency":
                from dmscale.cost.latency import LatencyCostModel

                self._costs[resource] = LatencyCostModel(self.model, self.space, self.example_inputs,
                                                         **self.config.latency_options)
            else:
                self._costs[resource] = CostModel(self.model, self.space, resource)
        return self._costs[resource]

    def _resolve_target(self, resource: str) -> float:
        t = float(self.config.budgets[resource])
        target = t * self.supernet_costs[resource] if t <= 1 else t
        bounds = self.profile(resource)
        low, high = bounds["min"], bounds["max"]
        if not low - 1e-9 <= target <= high + 1e-9:
            raise ConfigError(
                f"target {resource} = {target:,.0f} is outside what this search "
                f"space can reach: [{low:,.0f} (smallest), {high:,.0f} (supernet)]; pass a target "
                f"between {low / high:.3g} and 1 (a fraction of the supernet) or between "
                f"{low:,.0f} and {high:,.0f}" + self._align_hint()
            )
        return target

    def _align_hint(self) -> str:
        if self.align <= 1:
            return ""
        how = "align=None (auto) is 8 on CUDA" if self.config.align is None else f"align={self.align}"
        return (f" (every searched width is kept at a multiple of {self.align}, which bounds the "
                f"smallest model from below: {how}; align=1, --align 1, searches every width)")

    # ------------------------------------------------------------------ masks
    def _masks(self, kind: str, cache: dict[int, list[Any]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
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

    def _exact_cost(self, hard: str | None, resource: str | None = None,
                    cache: dict[int, list[Any]] | None = None) -> float:
        return float(self._exact_cost_tensor(hard, resource, cache))

    def _exact_costs(self, hard: str | None, cache: dict[int, list[Any]] | None = None) -> tuple[float, ...]:
        """:meth:`_exact_cost` of every budget, in ``config.budgets`` order (one set of masks)."""
        with torch.no_grad():
            w, d = self._masks("open" if hard is None else hard, cache)
            return tuple(float(self._cost_model(r)(w, d)) for r in self.config.budgets)

    def _exact_cost_tensor(self, hard: str | None, resource: str | None = None,
                           cache: dict[int, list[Any]] | None = None) -> torch.Tensor:
        """The cost of the masks of kind ``hard`` (None: all open) as a () float64 tensor on
        the gates' device (no host synchronisation for hard masks without ``cache``)."""
        kind = "open" if hard is None else hard
        with torch.no_grad():
            w, d = self._masks(kind, cache)
            return self._cost_model(resource)(w, d)

    # ------------------------------------------------------------------ public API
    def model_parameters(self) -> Iterator[nn.Parameter]:
        """The model's own parameters (everything but the structural ones)."""
        for name, p in self.model.named_parameters():
            if not name.startswith(GATES_NAME + "."):
                yield p

    def structure_parameters(self) -> Iterator[nn.Parameter]:
        """The learnable pruning ratios: the width dims' ``a`` stacked in one (W,) Parameter
        (:mod:`dmscale.core.ratios`), then each depth dim's own ``a`` (and the own ``a`` of a
        gate that is not stacked)."""
        return iter(distinct_leaves(list(self.gates.width) + list(self.gates.depth)))

    def optimizer(self, weights: torch.optim.Optimizer, total_steps: int,
                  structure_lr: float = STRUCTURE_LR) -> SearchOptimizer:
        """``weights`` (an optimizer over :meth:`model_parameters`) and Adam over the structure,
        stepped together, with the settle phase's learning-rate scale and the search's progress
        (``opt.progress`` for :meth:`resource_loss`); see :mod:`dmscale.search.optimizer`."""
        return SearchOptimizer(self, weights, total_steps, structure_lr=structure_lr)

    def soft_cost(self, resource: str | None = None) -> torch.Tensor:
        """r_c of ``resource`` (default: the primary budget's) from the current soft masks
        (differentiable in every ``a``)."""
        w, d = self._masks("soft")
        return self._cost_model(resource)(w, d)

    def soft_costs(self) -> dict[str, torch.Tensor]:
        """r_c of every budget from one set of soft masks (:attr:`SearchConfig.budgets` order)."""
        w, d = self._masks("soft")
        return {r: self._cost_model(r)(w, d) for r in self.config.budgets}

    def latency_fit(self) -> dict[str, Any]:
        """The latency model's fit report (per-layer and pooled relative RMSE, calibration,
        how the parts add up to the timed model); see ``LatencyCostModel.fit_report``."""
        if self.config.resource != "latency":
            raise ConfigError(f"latency_fit() needs resource='latency', this search uses {self.config.resource!r}")
        return self._cost_model("latency").fit_report()

    def profile(self, resource: str | None = None) -> dict[str, float]:
        """Smallest and largest cost of ``resource`` (default: the primary budget's) this
        search space can reach."""
        return {"min": self._exact_cost("min", resource), "max": self._exact_cost(None, resource)}

    def meet_target(self, iterations: int = 40) -> dict[str, float]:
        """Budget solver: bring the hard structure to the largest cost not above the target.

        The search ends near, not exactly at, r_t. First one common offset is added to every
        ``a`` (binary search; the hard cost is non-increasing in it), then, when depth is
        searched, a second one to the widths alone (depth fixed: fills the budget a dropped
        block left free in the learned width ratios), then single units are given back
        greedily, in the order a falling common offset would add them, while the hard cost
        stays under the target. With several budgets every one is a constraint: the offsets
        stop at the first budget they would exceed, the gates that do not add to that budget
        then fill the others (:func:`~dmscale.search.solver.solve_budget`), and a unit is given
        back only while every budget stays at or under its target. Returns :meth:`resources`
        afterwards.
        """
        self._require_synced("meet_target()")
        depth = [] if self.gates.depth_frozen else list(self.gates.depth)
        widths = distinct_gates(list(self.gates.width))
        refill = widths if depth and widths else None
        if len(self.config.budgets) == 1:
            solve_budget(distinct_gates(widths + depth),
                         lambda cache=None: self._exact_cost("hard", cache=cache), self.target_cost,
                         iterations, refill=refill)
        else:
            self._meet_targets(widths, depth, iterations)
        return self.resources()

    @contextlib.contextmanager
    def hardened(self) -> Iterator[nn.Module]:
        """Run the model with 0/1 masks: exactly the function :meth:`export` computes."""
        self._require_synced("hardened()")
        with self.gates.use("hard"):
            yield self.model

    def structure(self) -> dict[str, Any]:
        """The found structure as a JSON-able dict (input of :func:`dmscale.apply_structure`).

        ``structure["align"]`` records the width multiple of the search (:attr:`align`) and
        the dims left unaligned (:attr:`unaligned`).

        Raises :class:`~dmscale.core.errors.NoImportanceError` before any importance exists
        (see :meth:`has_importance`).
        """
        self._require_synced("structure()")
        self._require_importance("structure()")
        with torch.no_grad():
            width_mask, depth_mask = self._masks("hard")
        structure = structure_of(self.model, self.space, width_mask.cpu().numpy() > 0.5,
                                 depth_mask.cpu().numpy() > 0.5, self.resources())
        # what the widths were aligned to (informative: apply_structure does not read it)
        structure["align"] = {"multiple": self.align, "unaligned": list(self.unaligned)}
        return structure

    def export(self, verify: bool | None = None) -> nn.Module:
        """A new, physically smaller model computing what :meth:`hardened` computes.

        With ``verify`` (default: ``config.verify``) the export is run on the example inputs
        against the hardened supernet (eval mode) and a :class:`VerificationError` naming
        the first diverging layer is raised when they differ; ``self.model`` is untouched.

        Raises :class:`~dmscale.core.errors.NoImportanceError` (and changes nothing) when no
        importance exists yet: train at least one step with the task loss first, or search
        with ``SearchConfig(importance="index")`` to keep elements by position on purpose.
        """
        self._require_synced("export()")
        self._require_importance("export()")
        small = export_model(self.model, self.structure())
        if self.config.verify if verify is None else verify:
            self._verify_export(small)
        return small

    # ------------------------------------------------------------------ self-checks
    def _run_example(self, model: nn.Module) -> Any:
        return run_example(model, self.example_inputs)

    def _verify_open(self, reference: Any) -> None:
        verify_open(self, reference)

    def _verify_export(self, small: nn.Module) -> None:
        verify_export(self, small)



def prepare(model: nn.Module, example_inputs: Any, config: SearchConfig | None = None) -> Searcher:
    """Attach a DMS search to ``model`` in place (hooks + a ``dms_gates`` submodule).

    On any error the model is left as it was.
    """
    config = config or SearchConfig()
    try:
        return Searcher(model, example_inputs, config)
    except BaseException:
        from dmscale.core.masks import detach

        if GATES_NAME in model._modules:
            detach(model)
        raise
