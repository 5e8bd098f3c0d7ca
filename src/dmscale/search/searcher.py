"""The Searcher: a search attached to a model, and the objects it owns
(the config is :mod:`dmscale.search.config`, the discovery and gates :mod:`dmscale.search.setup`,
the costs of the masks :mod:`dmscale.search.costs` (``searcher.costs``), the targets, resource
loss, schedule and settle phase :mod:`dmscale.search.budget` (``searcher.budget``),
the budget solver :mod:`dmscale.search.solver`,
importance and its all-reduce :mod:`dmscale.search.importance_sync` (``searcher.importance``),
the saved config's comparison :mod:`dmscale.search.config_state`,
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
from dataclasses import replace
from typing import Any, Iterator

import torch
from torch import nn

from dmscale.export.hf_sizes import check_uniform_depth
from dmscale.trace.discover import SearchSpace
from dmscale.core.errors import ConfigError
from dmscale.export.shrink import export_model, structure_of
from dmscale.core.masks import GATES_NAME, Gates
from dmscale.core.ratios import distinct_leaves
from dmscale.search.budget import Budget
from dmscale.search.config import COST_FORWARD, SearchConfig, resolve_align
from dmscale.search.config_state import config_differences, config_state
from dmscale.search.costs import SearchCosts
from dmscale.search.importance_sync import ImportanceSync
from dmscale.search.optimizer import STRUCTURE_LR, SearchOptimizer
from dmscale.search.settle import SettleState
from dmscale.search.setup import attach_gates, discover_space, model_device, unaligned_dims
from dmscale.export.selfcheck import verify_export, verify_open
from dmscale.search.solver import distinct_gates, solve_budget, solve_budgets

__all__ = ["SearchConfig", "Searcher", "prepare", "COST_FORWARD"]


def _delegate(owner: str, name: str, doc: str, settable: bool = False) -> property:
    """A property of the Searcher that reads (and, ``settable``, writes) ``self.<owner>.<name>``,
    with the owner's documentation: the Searcher's API over the objects that own the state."""
    def get(self: Any) -> Any:
        return getattr(getattr(self, owner), name)

    def put(self: Any, value: Any) -> None:
        setattr(getattr(self, owner), name, value)

    return property(get, put if settable else None, doc=f"``searcher.{owner}.{name}``: {doc}")


class Searcher:
    """A DMS search attached to a model. Create it with :func:`prepare`.

    ``align`` is the width multiple the search keeps (``SearchConfig.align``, resolved on the
    model's device when None) and ``unaligned`` the channel dims it could not align (their
    size is not a multiple of it; they are searched without alignment).

    It owns ``costs`` (:class:`~dmscale.search.costs.SearchCosts`: the cost of the gates'
    masks in every resource) and ``budget`` (:class:`~dmscale.search.budget.Budget`: targets,
    resource loss, r_t schedule, settle phase) and ``importance``
    (:class:`~dmscale.search.importance_sync.ImportanceSync`: whether importance exists, its
    all-reduce under torch.distributed); the methods below that concern them call them, and
    :meth:`state_dict` is the gates' and config's state with theirs.

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
        self.importance = ImportanceSync(self.gates, config.importance, type(model).__name__)
        if config.verify and model_device(model).type != "meta":  # meta: no values to compare
            verify_open(model, example_inputs, self.gates, space.example_output)
        self.costs = SearchCosts(model, space, example_inputs, config, self.gates)
        self.budget = Budget(config, self.costs, hint=self._align_hint())
        if self.unaligned:
            warnings.warn(f"align={self.align}: {len(self.unaligned)} width dim(s) have a size that is "
                          f"not a multiple of {self.align} and are searched without alignment: "
                          f"{', '.join(self.unaligned[:5])}{' ...' if len(self.unaligned) > 5 else ''} "
                          "(Searcher.unaligned lists them)", stacklevel=3)

    # ------------------------------------------------------------------ setup
    def _attach(self, space: SearchSpace) -> Gates:
        gates, self.uniform_groups = attach_gates(self.model, space, self.config, align=self.align)
        return gates

    def _align_hint(self) -> str:
        if self.align <= 1:
            return ""
        how = "align=None (auto) is 8 on CUDA" if self.config.align is None else f"align={self.align}"
        return (f" (every searched width is kept at a multiple of {self.align}, which bounds the "
                f"smallest model from below: {how}; align=1, --align 1, searches every width)")

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
        self.importance.require_synced("meet_target()")
        depth = [] if self.gates.depth_frozen else list(self.gates.depth)
        widths = distinct_gates(list(self.gates.width))
        refill = widths if depth and widths else None
        if len(self.config.budgets) == 1:
            solve_budget(distinct_gates(widths + depth),
                         lambda cache=None: self.costs.exact("hard", cache=cache), self.budget.target_cost,
                         iterations, refill=refill)
        else:
            solve_budgets(widths, depth, list(self.structure_parameters()),
                          lambda cache=None: self.costs.exact_all("hard", cache=cache),
                          tuple(self.budget.target_costs[r] for r in self.config.budgets), iterations,
                          self.budget.fills)
        return self.resources()

    @contextlib.contextmanager
    def hardened(self) -> Iterator[nn.Module]:
        """Run the model with 0/1 masks: exactly the function :meth:`export` computes."""
        self.importance.require_synced("hardened()")
        with self.gates.use("hard"):
            yield self.model

    def structure(self) -> dict[str, Any]:
        """The found structure as a JSON-able dict (input of :func:`dmscale.apply_structure`).

        ``structure["align"]`` records the width multiple of the search (:attr:`align`) and
        the dims left unaligned (:attr:`unaligned`).

        Raises :class:`~dmscale.core.errors.NoImportanceError` before any importance exists
        (see :meth:`has_importance`).
        """
        self.importance.require_synced("structure()")
        self.importance.require("structure()")
        with torch.no_grad():
            width_mask, depth_mask = self.costs.masks("hard")
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
        self.importance.require_synced("export()")
        self.importance.require("export()")
        structure = self.structure()
        small = export_model(self.model, structure)
        if self.config.verify if verify is None else verify:
            verify_export(self.model, self.example_inputs, self.hardened, structure["layers"], small)
        return small

    # ------------------------------------------------------------------ budget (self.budget)
    # the calls of the training loop; the rest of the budget (every budget's target and settle
    # state, r_t at a progress, in band, within, fills) is read on ``searcher.budget``, the
    # costs (soft, exact, profile, latency fit) on ``searcher.costs``
    target_cost = _delegate("budget", "target_cost", "the primary budget's final target.", settable=True)
    supernet_cost = _delegate("budget", "supernet_cost", "the supernet's cost in the primary budget's "
                              "resource.", settable=True)

    def structure_lr_scale(self, progress: float) -> float:
        """:meth:`Budget.structure_lr_scale <dmscale.search.budget.Budget.structure_lr_scale>`:
        the factor for the structural parameters' learning rate at ``progress`` (1, then annealed
        to 0 once the settle phase has landed, 0 while held in the band)."""
        return self.budget.structure_lr_scale(progress)

    def resource_loss(self, progress: float = 1.0) -> torch.Tensor:
        """``resource_weight * log(r_c / r_t)`` when r_c > r_t, else 0 (Eq. 6); in the settle
        phase (:meth:`Budget.settling <dmscale.search.budget.Budget.settling>`) the band loss of :func:`dmscale.search.settle.band_loss` instead.

        From ``width_only_from`` on, and in the settle phase once the exact cost has reached
        the target (``searcher.budget.settled_at``), depth masks are frozen at their hard values
        (:meth:`advance`). See :meth:`Budget.loss <dmscale.search.budget.Budget.loss>`.
        """
        self.advance(progress)
        return self.budget.loss(progress)

    def advance(self, progress: float) -> None:
        """The step at ``progress``'s phase: whether the settle phase has landed and so whether
        depth is frozen (:meth:`Budget.advance <dmscale.search.budget.Budget.advance>` decides,
        :meth:`freeze_depth` applies). :meth:`resource_loss` calls it; a loop that must know
        before the forward (DDP leaves frozen depth out) calls it first."""
        self.freeze_depth(self.budget.advance(progress))

    def freeze_depth(self, frozen: bool = True) -> None:
        """Fix depth at its hard value (width-only phase): hard depth masks, no gradient."""
        self.gates.depth_frozen = frozen
        for t in self.gates.depth:
            t.a.requires_grad_(not frozen)

    def resources(self) -> dict[str, Any]:
        """:meth:`Budget.resources <dmscale.search.budget.Budget.resources>`: soft and hard cost
        now, final target and supernet cost (with several budgets also per budget)."""
        return self.budget.resources()

    # ------------------------------------------------------------------ importance (self.importance)
    def has_importance(self) -> bool:
        """:meth:`ImportanceSync.has_importance <dmscale.search.importance_sync.ImportanceSync.has_importance>`:
        whether the hard structure is chosen by importance (else :meth:`structure` and
        :meth:`export` raise :class:`~dmscale.core.errors.NoImportanceError`)."""
        return self.importance.has_importance()

    def randomize_importance(self, seed: int | torch.Generator = 0) -> None:
        """:meth:`ImportanceSync.randomize <dmscale.search.importance_sync.ImportanceSync.randomize>`:
        a random importance for every gate (seeded), for random-pruning baselines."""
        self.importance.randomize(seed)

    def use_grad_scaler(self, scaler: Any) -> None:
        """Tell the search about a ``torch.amp.GradScaler``: importance is computed from
        unscaled gradients (Eq. 4 on g / scale)."""
        self.importance.use_grad_scaler(scaler)

    def sync_importance(self) -> int:
        """:meth:`ImportanceSync.sync <dmscale.search.importance_sync.ImportanceSync.sync>`: under
        torch.distributed, apply this step's importance updates from the global batch's gradient;
        call it on every rank after ``loss.backward()``. Returns the number of updates applied."""
        return self.importance.sync()

    def use_process_group(self, group: Any = None) -> None:
        """Which ranks share importance: ``None`` (default) the default process group, a
        ``ProcessGroup``, or ``False`` (none); see :meth:`ImportanceSync.use_process_group
        <dmscale.search.importance_sync.ImportanceSync.use_process_group>`."""
        self.importance.use_process_group(group)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: structural parameters and importance (the gates'),
        config with the resolved ``align``, depth freezing, the budget's state (target, supernet
        cost, settle phase; with several budgets also ``"budgets"``: every one's, a single
        budget's state is as before ``targets`` existed) and a measured latency profile.

            >>> import torch, dmscale as dms
            >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
            >>> s = dms.prepare(net, torch.randn(2, 4), dms.SearchConfig("params", 0.5))
            >>> state = s.state_dict()
            >>> sorted(state)[:4]
            ['config', 'depth_frozen', 'gates', 'settle_weight']
            >>> s.load_state_dict(state); s.target_cost == state["target_cost"]
            True
        """
        self.importance.require_synced("state_dict()")
        # the resolved align: an auto align on another device would search another space
        return {"gates": {k: v.detach().clone() for k, v in self.gates.state_dict().items()},
                "config": {**config_state(self.config), "align": self.align},
                "depth_frozen": self.gates.depth_frozen, **self.budget.state_dict(), **self.costs.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (same model architecture and config)."""
        diff = config_differences(state["config"], replace(self.config, align=self.align))
        if diff:
            raise ConfigError(f"searcher config differs from the saved one ({diff}); build the "
                              "searcher with the saved config to load this state")
        self.gates.load_state_dict(state["gates"])
        self.costs.load_state_dict(state)
        self.budget.load_state_dict(state)
        self.freeze_depth(bool(state.get("depth_frozen", False)))



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
