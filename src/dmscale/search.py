"""The Searcher: config, resource loss and schedule, hard masks, export and state.

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
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn

from .discover import SearchSpace, discover
from .tracer import split_inputs
from .errors import (ConfigError, InputError, NothingToSearchError, PendingImportanceError,
                     TraceError, UnsupportedLayerError, VerificationError)
from .export import FORMAT, export_model
from .handlers import handler_for
from .importance import IMPORTANCE_METRICS
from .masks import GATES_NAME, Gates, assemble_width_mask
from .modes import eval_mode
from .topk import GateFactory
from .norms import norm_formula
from .resources import RESOURCES, CostModel
from .uniform import tie_ratios, uniform_groups
from .verify import compare, describe, first_divergence, flat_outputs

__all__ = ["SearchConfig", "Searcher", "prepare", "COST_FORWARD"]

COST_FORWARD = ("soft", "exact")


@dataclass
class SearchConfig:
    """What to search and under which budget.

    Attributes:
        resource: "macs", "params" or "latency".
        target: <= 1: a fraction of the supernet's cost; > 1: an absolute count.
        resource_weight: lambda_resource of Eq. 5.
        schedule: "exp" (r_t decays from the supernet's cost to the target, Eq. 10) or
            "constant" (r_t = target from the start).
        importance: "taylor" (Eq. 4), "snip", "fisher" or "index".
        normalize: rank-normalise importance (Eq. 2); False is the paper's ablation.
        width_temperature / depth_temperature: lambda = temperature * N (1 and 4, A.1.1).
        min_width: smallest width a dimension may keep (x_min, A.1.1).
        width_step: channels per unit in a coarse search space (1 = fine-grained).
        dim_overrides: per width-dimension name, {"min": int, "step": int}.
        search_width: search widths.
        search_depth: True: every residual stage found; False: none; a list: those stages.
        exclude: module names (or prefixes) whose widths stay fixed.
        width_only_from: progress from which depth is frozen at its hard value and only
            widths are searched (the extra width-only phase of A.1.2); None = never.
        latency_options: keyword arguments of :class:`dmscale.latency.LatencyCostModel`
            (ratios, budget_s, quantile, calibrate, profile: a saved profile, e.g. measured
            on the target device). Latency is in microseconds: a target > 1 is in us.
        cost_forward: the value of r_c in the resource loss (Eq. 6). "soft": the cost of the
            soft masks, as the paper writes it; it sits below the exported model's cost while
            the least important kept elements have soft masks under 1, so a search that meets
            its target in soft terms exports a model over it. "exact": the exact cost of the
            hard masks (what the export will cost), with the soft cost's gradient
            (straight-through: r_c = s + (h - s).detach()).
        layer_uniform: the dims of one kind in repeated layers (every layer's FFN width, every
            layer's heads) share one pruning ratio, so all layers keep the same count while
            each keeps its own most important elements (:mod:`dmscale.uniform`); the result
            has a standard config (``dmscale.save_pretrained`` without custom code).
        gate_factory: builds the gate of every width and depth dimension (None: DMS's
            :class:`~dmscale.topk.DifferentiableTopK`). For baselines and ablations: any
            callable with DifferentiableTopK's signature returning a
            :class:`~dmscale.topk.StructuralGate` (bench/gates_lib.py has the paper's MES,
            SNS and GET). Export, exact cost and the export check are the same for every gate.
        verify: self-checks on the example inputs (one extra forward each, tolerance in
            :mod:`dmscale.verify`): ``prepare`` refuses a model whose output changes with all
            masks open, ``export`` raises when the export does not compute what the hardened
            supernet computes. Both name the first layer that diverges.

    ``min_width`` and ``width_step`` apply to channels; attention heads and blocks are
    always searched one at a time (``dim_overrides`` can still set a heads dim's step/min).
    """

    resource: str = "macs"
    target: float = 0.5
    resource_weight: float = 1.0
    schedule: str = "exp"
    importance: str = "taylor"
    normalize: bool = True
    width_temperature: float = 1.0
    depth_temperature: float = 4.0
    min_width: int = 1
    width_step: int = 1
    dim_overrides: dict[str, dict[str, int]] = field(default_factory=dict)
    search_width: bool = True
    search_depth: bool | list[str] = True
    exclude: list[str] = field(default_factory=list)
    width_only_from: float | None = None
    latency_options: dict[str, Any] = field(default_factory=dict)
    cost_forward: str = "soft"
    verify: bool = True
    layer_uniform: bool = False
    gate_factory: GateFactory | None = None

    def __post_init__(self) -> None:
        if self.resource not in RESOURCES:
            raise ConfigError(f"unknown resource {self.resource!r}: expected one of {RESOURCES}")
        if not (isinstance(self.target, (int, float)) and self.target > 0 and math.isfinite(self.target)):
            raise ConfigError(f"target must be a finite number > 0, got {self.target!r}: pass a fraction "
                              "of the supernet's cost (e.g. 0.5) or an absolute count > 1")
        if self.resource_weight < 0:
            raise ConfigError(f"resource_weight must be >= 0, got {self.resource_weight}")
        if self.schedule not in ("exp", "constant"):
            raise ConfigError(f"schedule must be 'exp' or 'constant', got {self.schedule!r}")
        if self.importance not in IMPORTANCE_METRICS:
            raise ConfigError(f"unknown importance {self.importance!r}: expected one of {sorted(IMPORTANCE_METRICS)}")
        if self.min_width < 1:
            raise ConfigError(f"min_width must be >= 1, got {self.min_width}")
        if self.width_step < 1:
            raise ConfigError(f"width_step must be >= 1, got {self.width_step}")
        if self.width_temperature <= 0 or self.depth_temperature <= 0:
            raise ConfigError("temperatures must be > 0, got "
                             f"width={self.width_temperature}, depth={self.depth_temperature}")
        if self.width_only_from is not None and not 0 <= self.width_only_from <= 1:
            raise ConfigError(f"width_only_from must be in [0, 1] or None, got {self.width_only_from}")
        if not (self.search_width or self.search_depth):
            raise ConfigError("nothing to search: search_width and search_depth are both off")
        if self.cost_forward not in COST_FORWARD:
            raise ConfigError(f"cost_forward must be one of {COST_FORWARD}, got {self.cost_forward!r}")
        if not isinstance(self.verify, bool):
            raise ConfigError(f"verify must be True or False, got {self.verify!r}")
        if not isinstance(self.layer_uniform, bool):
            raise ConfigError(f"layer_uniform must be True or False, got {self.layer_uniform!r}")
        if self.gate_factory is not None and not callable(self.gate_factory):
            raise ConfigError(f"gate_factory must be a callable that builds a StructuralGate (e.g. a gate "
                              f"class), got {self.gate_factory!r}; None uses DMS's DifferentiableTopK")
        self.exclude = list(self.exclude)


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


class Searcher:
    """A DMS search attached to a model. Create it with :func:`prepare`.

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
        try:
            space = discover(model, example_inputs, config.exclude,
                             depth=config.search_depth if config.search_depth else False)
        except Exception as err:
            if not isinstance(err, ValueError) and _fails_on(model, example_inputs):
                raise InputError(
                    f"{type(model).__name__} does not run on the example inputs "
                    f"({_describe_inputs(example_inputs)}): {type(err).__name__}: "
                    f"{str(err).splitlines()[0] if str(err) else ''}; pass inputs the model's forward "
                    "accepts (a tensor, a tuple of positional inputs or a dict of keyword inputs)"
                ) from err
            if not isinstance(err, ValueError):
                raise TraceError(
                    f"{type(model).__name__} runs on the example inputs but not under dmscale's trace "
                    f"(forward hooks and a TorchFunctionMode): {type(err).__name__}: "
                    f"{str(err).splitlines()[0] if str(err) else ''}; pass the plain nn.Module (not "
                    "torch.compile'd or scripted), or exclude the module that fails "
                    "(SearchConfig(exclude=[...]))") from err
            raise
        if not config.search_width:
            space = _without_width(space)
        if not space.width and not space.depth:
            raise NothingToSearchError(
                f"found nothing to search in {type(model).__name__}: every width is fixed "
                f"({_reasons(space)}) and no residual block has an identity shortcut; "
                + ("a function with no channel rule fixes the widths it touches: keep it out of "
                   "the hidden layers, or teach dmscale what it computes (dms.register_handler)"
                   if "no channel rule" in _reasons(space) else
                   "search a model with hidden layers, or exclude fewer modules")
            )
        self.space = space
        self.gates = self._attach(space)
        if config.verify:
            self._verify_open(space.example_output)
        self._costs: dict[str, Any] = {}
        self.supernet_cost = float(self._exact_cost(hard=None))
        self.target_cost = self._resolve_target()

    # ------------------------------------------------------------------ setup
    def _attach(self, space: SearchSpace) -> Gates:
        cfg = self.config
        dims = []
        for d in space.width:
            over = cfg.dim_overrides.get(d.name, {})
            channels = d.kind != "heads"  # coarse steps and min width are for channels
            step = int(over.get("step", cfg.width_step if channels else 1))
            # at least one unit for each layer that writes part of this width
            min_keep = min(d.size, max(int(over.get("min", cfg.min_width if channels else 1)),
                                       len(d.required) * step))
            temperature = cfg.depth_temperature if d.kind == "heads" else cfg.width_temperature
            dims.append((d.size, step, min_keep, temperature))
        self.uniform_groups = uniform_groups([d.name for d in space.width],
                                             [(d.kind,) + s for d, s in zip(space.width, dims)]) \
            if cfg.layer_uniform else []
        depth = [(len(d.blocks), 1, d.min_keep, cfg.depth_temperature) for d in space.depth]
        modules = dict(self.model.named_modules())
        consumers, norms, outputs = {}, {}, {}
        for name, layer in space.layers.items():
            if layer.mask_output and layer.out_slots is not None and (layer.out_slots >= 0).any():
                outputs[name] = (handler_for(modules[name]).channel_dim, layer.out_slots)
            if layer.virtual or layer.in_slots is None or (layer.in_slots < 0).all():
                continue
            if "in" in layer.macs_sides:
                consumers[name] = (handler_for(modules[name]).channel_dim, layer.in_slots)
            elif layer.masked_norm:
                formula = norm_formula(modules[name])
                if formula is None:
                    raise UnsupportedLayerError(
                        f"layer {name!r} ({type(modules[name]).__name__}) asks for a masked norm "
                        "but does not compute a LayerNorm or RMSNorm over its last dim; exclude "
                        f"it (SearchConfig(exclude=[{name!r}])) or give its handler masked_norm=False")
                norms[name] = (layer.in_slots, formula.kind, formula.eps)
        branches = {m: (j, i) for j, d in enumerate(space.depth) for i, b in enumerate(d.blocks)
                    for m in b.branch_modules}
        gates = Gates.attach(self.model, dims, depth, consumers, branches,
                             importance=cfg.importance, normalize=cfg.normalize, norms=norms,
                             outputs=outputs, derived=space.derived, gate_factory=cfg.gate_factory)
        tie_ratios(list(gates.width), self.uniform_groups)
        for d, topk in zip(space.width, gates.width):
            topk.required_groups = [torch.unique(torch.tensor(g) // topk.step) for g in d.required]
        # the gates live where the model lives (prepare may come after model.to(device))
        param = next(iter(self.model.parameters()), None)
        if param is not None:
            gates.to(param.device)
        return gates

    def _cost_model(self, resource: str | None = None) -> Any:
        resource = resource or self.config.resource
        if resource not in self._costs:
            if resource == "latency":
                from .latency import LatencyCostModel

                self._costs[resource] = LatencyCostModel(self.model, self.space, self.example_inputs,
                                                         **self.config.latency_options)
            else:
                self._costs[resource] = CostModel(self.model, self.space, resource)
        return self._costs[resource]

    def _resolve_target(self) -> float:
        t = float(self.config.target)
        target = t * self.supernet_cost if t <= 1 else t
        bounds = self.profile()
        low, high = bounds["min"], bounds["max"]
        if not low - 1e-9 <= target <= high + 1e-9:
            raise ConfigError(
                f"target {self.config.resource} = {target:,.0f} is outside what this search "
                f"space can reach: [{low:,.0f} (smallest), {high:,.0f} (supernet)]; pass a target "
                f"between {low / high:.3g} and 1 (a fraction of the supernet) or between "
                f"{low:,.0f} and {high:,.0f}"
            )
        return target

    # ------------------------------------------------------------------ masks
    def _masks(self, kind: str, cache: dict[int, list[Any]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(width mask with trailing 1, flat depth mask) of kind "soft", "hard", "open", "min".

        ``cache`` (hard masks only): each dim's last two hard masks by the value of its ``a``,
        for the budget solver, which changes one dim at a time (the importances stay fixed).
        """
        def pick(t: Any) -> torch.Tensor:
            if kind == "soft":
                return t.soft_mask()
            if kind == "hard":
                return t.hard_mask() if cache is None else _cached_hard_mask(t, cache)
            if kind == "min":  # the smallest units: the short last one and the first full ones
                unit = torch.zeros(t.n_units, dtype=torch.float32, device=t.a.device)
                if t.min_units > 0:
                    unit[t.n_units - 1] = 1.0
                    unit[:t.min_units - 1] = 1.0
                return t.expand(unit)
            return torch.ones(t.size, dtype=torch.float32, device=t.a.device)

        g = self.gates
        width = assemble_width_mask([pick(t) for t in g.width], g.derived_a, g.derived_b,
                                    like=torch.ones(1, device=g._device()))
        depth_frozen = g.depth_frozen and kind == "soft"
        depth_parts = [t.hard_mask() if depth_frozen else pick(t) for t in g.depth]
        depth = torch.cat(depth_parts) if depth_parts else torch.zeros(0, device=g._device())
        return width, depth

    def _exact_cost(self, hard: str | None, resource: str | None = None,
                    cache: dict[int, list[Any]] | None = None) -> float:
        kind = "open" if hard is None else hard
        with torch.no_grad():
            w, d = self._masks(kind, cache)
            return float(self._cost_model(resource)(w, d))

    # ------------------------------------------------------------------ public API
    def model_parameters(self) -> Iterator[nn.Parameter]:
        """The model's own parameters (everything but the structural ones)."""
        for name, p in self.model.named_parameters():
            if not name.startswith(GATES_NAME + "."):
                yield p

    def structure_parameters(self) -> Iterator[nn.Parameter]:
        """The learnable pruning ratios ``a``, one per dimension."""
        return iter([t.a for t in _distinct(list(self.gates.width) + list(self.gates.depth))])

    def target_at(self, progress: float) -> float:
        """r_t at ``progress`` in [0, 1] (Eq. 10, or constant)."""
        p = min(max(float(progress), 0.0), 1.0)
        if self.config.schedule == "constant":
            return self.target_cost
        ratio = self.target_cost / self.supernet_cost
        return ratio**p * self.supernet_cost

    def soft_cost(self) -> torch.Tensor:
        """r_c from the current soft masks (differentiable in every ``a``)."""
        w, d = self._masks("soft")
        return self._cost_model()(w, d)

    def resource_loss(self, progress: float = 1.0) -> torch.Tensor:
        """``resource_weight * log(r_c / r_t)`` when r_c > r_t, else 0 (Eq. 6).

        From ``width_only_from`` on, depth masks are frozen at their hard values.
        """
        frozen = self.config.width_only_from is not None and progress >= self.config.width_only_from
        self.freeze_depth(frozen)
        r_c = self.soft_cost()
        if self.config.cost_forward == "exact":  # forward: the export's cost; backward: soft
            r_c = r_c + (self._exact_cost("hard") - r_c.detach())
        r_t = self.target_at(progress)
        if float(r_c.detach()) <= r_t:
            return r_c.new_zeros(()).float()
        return (self.config.resource_weight * torch.log(r_c / r_t)).float()

    def freeze_depth(self, frozen: bool = True) -> None:
        """Fix depth at its hard value (width-only phase): hard depth masks, no gradient."""
        self.gates.depth_frozen = frozen
        for t in self.gates.depth:
            t.a.requires_grad_(not frozen)

    def resources(self) -> dict[str, Any]:
        """Soft and hard cost now, the final target and the supernet's cost."""
        with torch.no_grad():
            soft = float(self.soft_cost())
        return {
            "resource": self.config.resource,
            "soft": soft,
            "hard": self._exact_cost("hard"),
            "target": self.target_cost,
            "supernet": self.supernet_cost,
        }

    def latency_fit(self) -> dict[str, Any]:
        """The latency model's fit report (per-layer and pooled relative RMSE, calibration,
        how the parts add up to the timed model); see ``LatencyCostModel.fit_report``."""
        if self.config.resource != "latency":
            raise ValueError(f"latency_fit() needs resource='latency', this search uses {self.config.resource!r}")
        return self._cost_model("latency").fit_report()

    def profile(self) -> dict[str, float]:
        """Smallest and largest cost this search space can reach."""
        return {"min": self._exact_cost("min"), "max": self._exact_cost(None)}

    def meet_target(self, iterations: int = 40) -> dict[str, float]:
        """Budget solver: bring the hard structure to the largest cost not above the target.

        The search ends near, not exactly at, r_t. First one common offset is added to every
        ``a`` (binary search; the hard cost is non-increasing in it), then single units are
        given back greedily, each time the one that adds the least cost, while the hard cost
        stays under the target. Returns :meth:`resources` afterwards.
        """
        self._require_synced("meet_target()")
        topks = _distinct(list(self.gates.width) + ([] if self.gates.depth_frozen else list(self.gates.depth)))
        # a scalar a is a pruning ratio (DMS): shifted directly; a gate with vector parameters
        # (a baseline's logits) is shifted in the same ratio terms through set_count
        base = [float(t.a.detach()) if t.a.numel() == 1 else 1.0 - t.hard_count() / t.n_units
                for t in topks]

        def cost_at(offset: float) -> float:
            with torch.no_grad():
                for t, a0 in zip(topks, base):
                    if t.a.numel() == 1:
                        t.a.fill_(a0 + offset)
                        t.clamp_()
                    else:
                        ratio = min(max(a0 + offset, 0.0), t.max_ratio)
                        t.set_count(int(round((1.0 - ratio) * t.n_units)))
            return self._exact_cost("hard")

        lo, hi = -1.0, 1.0  # cost_at(lo) is the largest, cost_at(hi) the smallest
        if cost_at(lo) <= self.target_cost:
            hi = lo
        for _ in range(iterations):
            if hi - lo < 1e-6:
                break
            mid = (lo + hi) / 2
            if cost_at(mid) <= self.target_cost:
                hi = mid
            else:
                lo = mid
        cost_at(hi)
        self._give_back_units(topks)
        return self.resources()

    def _give_back_units(self, topks: list[Any]) -> None:
        """Greedy: add one unit to the dim whose unit costs least, while under target.

        A unit that costs nothing (a width inside a block that depth search removed) is given
        back together with every further free unit of its dim: the one-by-one greedy would
        pick them next anyway, one full cost evaluation per dim for each unit, which took
        hours for an LLM's FFN widths.
        """
        cache: dict[int, list[Any]] = {}
        current = self._exact_cost("hard", cache=cache)
        for _ in range(10 * sum(t.n_units for t in topks)):
            best: tuple[float, Any, int] | None = None
            for t in topks:
                k = t.hard_count()
                if k >= t.n_units:
                    continue
                old_a = t.a.detach().clone()
                t.set_count(k + 1)
                cost = self._exact_cost("hard", cache=cache) if t.hard_count() == k + 1 else math.inf
                with torch.no_grad():
                    t.a.copy_(old_a)
                if cost <= self.target_cost and (best is None or cost < best[0]):
                    best = (cost, t, k + 1)
            if best is None:
                break
            cost, t, k = best
            if cost <= current:
                k = self._last_free_count(t, k, current)
            t.set_count(k)
            current = self._exact_cost("hard", cache=cache)

    def _last_free_count(self, t: Any, k: int, current: float) -> int:
        """The largest count >= ``k`` of ``t`` whose hard cost stays ``current`` (binary
        search: the cost does not fall as a dim keeps more units)."""
        old_a = t.a.detach().clone()
        lo, hi = k, t.n_units
        while lo < hi:
            mid = (lo + hi + 1) // 2
            t.set_count(mid)
            if t.hard_count() == mid and self._exact_cost("hard") <= current:
                lo = mid
            else:
                hi = mid - 1
        with torch.no_grad():
            t.a.copy_(old_a)
        return lo

    @contextlib.contextmanager
    def hardened(self) -> Iterator[nn.Module]:
        """Run the model with 0/1 masks: exactly the function :meth:`export` computes."""
        self._require_synced("hardened()")
        with self.gates.use("hard"):
            yield self.model

    def structure(self) -> dict[str, Any]:
        """The found structure as a JSON-able dict (input of :func:`dmscale.apply_structure`)."""
        self._require_synced("structure()")
        with torch.no_grad():
            width_mask, depth_mask = self._masks("hard")
        keep = width_mask.cpu().numpy() > 0.5
        keep_depth = depth_mask.cpu().numpy() > 0.5
        modules = dict(self.model.named_modules())
        layers = {}
        for name, layer in self.space.layers.items():
            if layer.virtual:
                continue
            spec_in = _kept(layer.in_slots, keep)
            spec_out = _kept(layer.out_slots, keep)
            if spec_in is None and spec_out is None:
                continue
            m = modules[name]
            shapes = {p: list(t.shape) for p, t in m.named_parameters(recurse=False)}
            layers[name] = {"handler": layer.handler, "in": spec_in, "out": spec_out, "shapes": shapes}
        removed, depth, k = [], [], 0
        for d in self.space.depth:
            kept_blocks = []
            for b in d.blocks:
                if keep_depth[k]:
                    kept_blocks.append(b.name)
                else:
                    removed.append({"name": b.name, "post_module": b.post_module, "post_function": b.post_function,
                                    "output": b.output, "inputs": b.n_inputs, "mutated": b.mutated})
                k += 1
            depth.append({"name": d.name, "blocks": [b.name for b in d.blocks], "kept": kept_blocks})
        width, off = [], 0
        for d in self.space.width:
            kept_slots = np.nonzero(keep[off:off + d.size])[0].tolist()
            width.append({"name": d.name, "size": d.size, "kept": len(kept_slots), "producers": d.producers})
            off += d.size
        params = {}
        for pname, (dim, slots) in self.space.params.items():
            kept = _kept(slots, keep)
            if kept is not None:
                params[pname] = {"dim": dim, "keep": kept,
                                 "shape": list(self.model.get_parameter(pname).shape)}
        return {"format": FORMAT, "resource": self.resources(), "width": width, "depth": depth,
                "layers": layers, "params": params, "removed_blocks": removed}

    def export(self, verify: bool | None = None) -> nn.Module:
        """A new, physically smaller model computing what :meth:`hardened` computes.

        With ``verify`` (default: ``config.verify``) the export is run on the example inputs
        against the hardened supernet (eval mode) and a :class:`VerificationError` naming
        the first diverging layer is raised when they differ; ``self.model`` is untouched.
        """
        small = export_model(self.model, self.structure())
        if self.config.verify if verify is None else verify:
            self._verify_export(small)
        return small

    def use_grad_scaler(self, scaler: Any) -> None:
        """Tell the search about a ``torch.amp.GradScaler``: importance is computed from
        unscaled gradients (Eq. 4 on g / scale), so steps at different loss scales weigh the
        same. Steps whose gradients are not finite never touch importance."""
        self.gates.grad_scaler = scaler

    # ------------------------------------------------------------------ torch.distributed
    def sync_importance(self) -> int:
        """Under torch.distributed: apply this step's importance updates (Eq. 4) from the
        gradient of the *global* batch. Call it on every rank after ``loss.backward()`` and
        before the next forward (before or after ``opt.step()``)::

            loss = task_loss(ddp_model(x_shard), y_shard) + searcher.resource_loss(p)
            opt.zero_grad(); loss.backward(); searcher.sync_importance(); opt.step()

        Each rank's mask gradients are held back by the backward, averaged in one all-reduce
        (their concatenation; with each rank's loss a mean over an equal shard, the mean is
        the global batch's gradient) and applied identically on every rank, so importance,
        structure and export are the same everywhere and equal one process's on the whole
        batch. The Taylor score (m g)^2 is not linear in g: averaging the ranks' importances
        instead would not give that.

        Forgotten, the next training forward applies the pending updates itself (the same
        all-reduce, in lockstep on every rank: the result is the same); :meth:`structure`,
        :meth:`export`, :meth:`hardened`, :meth:`meet_target` and :meth:`state_dict` raise
        :class:`~dmscale.errors.PendingImportanceError` while updates are pending (they
        would miss the last step, and calling them on rank 0 only must not start a
        collective). Returns the number of updates applied: 0 in a single process (the
        backward updates importance at once) or when nothing is pending.
        """
        return self.gates.sync_importance()

    def use_process_group(self, group: Any = None) -> None:
        """Which ranks share importance: ``None`` (default) the default process group when
        it is initialised with more than one process; a ``ProcessGroup`` (the data-parallel
        ranks of a model-parallel run); ``False``: none (independent searches per rank)."""
        if len(self.gates.pending):
            raise PendingImportanceError(
                f"{len(self.gates.pending)} importance updates are pending: call "
                "searcher.sync_importance() before changing the process group")
        self.gates.process_group = group

    def _require_synced(self, what: str) -> None:
        n = len(self.gates.pending)
        if n:
            raise PendingImportanceError(
                f"{what} under torch.distributed with {n} importance updates of the last "
                "backward still pending: call searcher.sync_importance() on every rank after "
                "loss.backward() (it all-reduces the mask gradients), then read the structure")

    # ------------------------------------------------------------------ self-checks
    def _run_example(self, model: nn.Module) -> Any:
        args, kwargs = split_inputs(self.example_inputs)
        with torch.no_grad(), eval_mode(model):
            return model(*args, **kwargs)

    def _verify_open(self, reference: Any) -> None:
        """All masks open must reproduce the original model (the trace's output)."""
        bad = compare(flat_outputs(self._open_run()), flat_outputs(reference))
        if bad is None:
            return
        with self.gates.use(enabled=False):
            where = first_divergence(lambda: self._run_example(self.model), self.model,
                                     self._open_run, self.model, skip=GATES_NAME)
        layer = "no single layer (only the final output)" if where is None else \
            f"{describe(self.model, where[0])} (differs by {where[1]:.3g}, allowed {where[2]:.3g})"
        fix = "" if where is None else (
            f" Exclude it to keep its channels fixed (SearchConfig(exclude=[{where[0]!r}]) or "
            f"--exclude {where[0]}), or register a handler that knows what it computes "
            "(dmscale.register_handler).")
        raise VerificationError(
            f"with all masks open {type(self.model).__name__} no longer computes its own output "
            f"(output {bad[0]} differs by {bad[1]:.3g}, allowed {bad[2]:.3g}): dmscale does not "
            f"handle some layer exactly. First layer whose output diverges: {layer}.{fix} "
            "SearchConfig(verify=False) skips this check.")

    def _open_run(self) -> Any:
        with self.gates.use("open"):
            return self._run_example(self.model)

    def _verify_export(self, small: nn.Module) -> None:
        """The export must compute what the hardened supernet computes."""
        def hard_run() -> Any:
            with self.hardened():
                return self._run_example(self.model)

        try:
            got = flat_outputs(self._run_example(small))
        except Exception as err:
            raise VerificationError(
                f"the export fails on the example inputs ({type(err).__name__}: {err}); the model "
                "was not changed. This is a dmscale bug or a custom handler's: please report it "
                "with the model; excluding the layer named in the error keeps its channels "
                "fixed. export(verify=False) skips this check.") from err
        bad = compare(got, flat_outputs(hard_run()))
        if bad is None:
            return
        modules = dict(self.model.named_modules())
        align = {name: (handler_for(modules[name]).channel_dim, spec["out"])
                 for name, spec in self.structure()["layers"].items()
                 if spec["out"] is not None and handler_for(modules[name]) is not None}
        where = first_divergence(hard_run, self.model, lambda: self._run_example(small), small,
                                 skip=GATES_NAME, align=align)
        layer = "none of equal shape (only the final output)" if where is None else \
            f"{describe(small, where[0])} (differs by {where[1]:.3g}, allowed {where[2]:.3g})"
        fix = "" if where is None else (
            f" Excluding {where[0]!r} (SearchConfig(exclude=[...])) keeps its channels fixed.")
        raise VerificationError(
            f"the export does not compute what the hardened supernet computes (output {bad[0]} "
            f"differs by {bad[1]:.3g}, allowed {bad[2]:.3g}); the model was not changed. First "
            f"layer whose output diverges: {layer}.{fix} This is a dmscale bug or a custom "
            "handler's: please report it with the model. export(verify=False) skips this check.")

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: structural parameters, importance, config, target."""
        self._require_synced("state_dict()")
        state = {"gates": {k: v.detach().clone() for k, v in self.gates.state_dict().items()},
                 "config": _config_state(self.config), "target_cost": self.target_cost,
                 "supernet_cost": self.supernet_cost, "depth_frozen": self.gates.depth_frozen}
        if "latency" in self._costs:  # a resumed search keeps the measured cost scale
            state["latency_profile"] = self._costs["latency"].state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (same model architecture and config)."""
        saved = dict(state["config"])
        current = _config_state(self.config)
        for key in ("latency_options", "verify"):  # neither changes what is searched
            saved.pop(key, None), current.pop(key, None)
        saved.setdefault("layer_uniform", False)  # states saved before the option existed
        saved.setdefault("gate_factory", None)
        if current != saved:
            raise ValueError(f"searcher config differs from the saved one: {state['config']} vs {asdict(self.config)}")
        self.gates.load_state_dict(state["gates"])
        if "latency_profile" in state:
            from .latency import LatencyCostModel

            options = {**self.config.latency_options, "profile": state["latency_profile"]}
            self._costs["latency"] = LatencyCostModel(self.model, self.space, self.example_inputs, **options)
        self.target_cost = float(state["target_cost"])
        self.supernet_cost = float(state["supernet_cost"])
        self.freeze_depth(bool(state.get("depth_frozen", False)))


def _config_state(config: SearchConfig) -> dict[str, Any]:
    """The config as plain data: the gate factory by its qualified name (checkpoints stay
    loadable without importing it; a resume with another gate is refused by name)."""
    factory = config.gate_factory
    state = asdict(replace(config, gate_factory=None))
    state["gate_factory"] = None if factory is None else \
        f"{getattr(factory, '__module__', '?')}.{getattr(factory, '__qualname__', repr(factory))}"
    return state


def _distinct(topks: list[Any]) -> list[Any]:
    """One gate per distinct ``a`` (layer-uniform dims share theirs)."""
    seen: set[int] = set()
    out = []
    for t in topks:
        if id(t.a) not in seen:
            seen.add(id(t.a))
            out.append(t)
    return out


def _kept(slots: np.ndarray | None, keep: np.ndarray) -> list[int] | None:
    if slots is None or (slots < 0).all():
        return None
    mask = (slots < 0) | keep[np.where(slots < 0, 0, slots)]
    return None if mask.all() else np.nonzero(mask)[0].tolist()


def _without_width(space: SearchSpace) -> SearchSpace:
    layers = {n: type(l)(l.name, l.handler, None, None, l.macs, l.macs_sides, l.virtual, l.masked_norm,
                         l.mask_output) for n, l in space.layers.items()}
    return SearchSpace([], space.depth, layers, space.pinned_reasons, space.total_macs, space.module_macs,
                       example_output=space.example_output)


def _describe_inputs(inputs: Any) -> str:
    """Shapes of the example inputs, for error messages."""
    if isinstance(inputs, torch.Tensor):
        return f"a tensor of shape {tuple(inputs.shape)}"
    if isinstance(inputs, dict):
        return "keywords " + ", ".join(f"{k}={_describe_inputs(v)}" for k, v in inputs.items())
    if isinstance(inputs, (tuple, list)):
        return "(" + ", ".join(_describe_inputs(v) for v in inputs) + ")"
    return type(inputs).__name__


def _fails_on(model: nn.Module, inputs: Any) -> bool:
    """Whether the plain model (a copy: BatchNorm statistics stay as they are) raises on
    ``inputs``; tells a wrong input from a tracing problem."""
    import copy

    args, kwargs = split_inputs(inputs)
    try:
        with torch.no_grad():
            copy.deepcopy(model)(*args, **kwargs)
    except Exception:
        return True
    return False


def _reasons(space: SearchSpace) -> str:
    items = list(space.pinned_reasons.items())[:3]
    return "; ".join(f"{k}: {v}" for k, v in items) or "no layer with searchable channels"


def prepare(model: nn.Module, example_inputs: Any, config: SearchConfig | None = None) -> Searcher:
    """Attach a DMS search to ``model`` in place (hooks + a ``dms_gates`` submodule).

    On any error the model is left as it was.
    """
    config = config or SearchConfig()
    try:
        return Searcher(model, example_inputs, config)
    except BaseException:
        from .masks import detach

        if GATES_NAME in model._modules:
            detach(model)
        raise
