"""The resources a search can budget, one object each, registered by name.

A :class:`Resource` owns everything that differs between resources: its exact count of a
model (:meth:`Resource.count`), the differentiable cost of a search's masks
(:meth:`Resource.cost_model`), how a value is shown (:attr:`Resource.unit`,
:meth:`Resource.format`), the search options it cannot be searched with
(:meth:`Resource.check`) and what a run records about its cost model
(:meth:`Resource.run_note`). ``--resource``'s choices, the budgets
(:class:`~dmscale.cost.budgets.Budgets`), the search's costs, the summary and the docs' table
of resources read :func:`resources`; :func:`register_resource` adds one (before the search,
or before ``dmscale.cli.main`` builds its parser).

Built in: ``macs``, ``params``, ``kv_cache`` (sums of terms of a
:class:`~dmscale.cost.resources.CostModel`) and ``latency`` (a measured
:class:`~dmscale.cost.latency.LatencyCostModel`).

Example (a resource counting the parameters of linear layers only):
    >>> import torch
    >>> from torch import nn
    >>> import dmscale as dms
    >>> def linear(name, module):
    ...     return isinstance(module, nn.Linear)
    >>> res = register_resource(TermResource(
    ...     "linear_params", "parameters of nn.Linear layers", "parameters",
    ...     rows=lambda cm, model, space: cm.params_rows(model, space, where=linear)))
    >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> s = dms.prepare(net, torch.randn(2, 4), dms.SearchConfig("linear_params", 0.5))
    >>> s.resources()["resource"], s.resources()["supernet"]
    ('linear_params', 58.0)
    >>> unregister_resource("linear_params")
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from torch import nn

from dmscale.core.errors import ConfigError
from dmscale.cost.resources import CostModel, TermRows, count
from dmscale.trace.discover import SearchSpace

__all__ = ["Resource", "TermResource", "LatencyResource", "RunNote", "register_resource",
           "unregister_resource", "resource_named", "resources", "RESOURCE_NAMES", "ResourceName",
           "format_value", "format_in"]


@dataclass(frozen=True)
class RunNote:
    """What a run records about a resource's cost model once the search is over: ``state``
    under ``key`` in the run's ``state.json`` and ``line`` in its log."""

    key: str
    state: dict[str, Any]
    line: str


def format_value(value: float | None) -> str:
    """A count with a K/M/G suffix (``-`` for None).

    Example:
        >>> format_value(12_345_678), format_value(950), format_value(None)
        ('12.35M', '950', '-')
    """
    if value is None:
        return "-"
    for unit, div in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= div:
            return f"{value / div:.2f}{unit}"
    return f"{value:.0f}"


class Resource:
    """One resource a search can budget.

    Args:
        name: the name ``--resource``, ``--target NAME=T`` and ``SearchConfig`` take.
        description: what it counts (``--help``, the docs' table of resources).
        unit: what a value is in ("MACs", "parameters", "us", "bytes"); an absolute target
            is in it.
    """

    def __init__(self, name: str, description: str, unit: str) -> None:
        if not name.isidentifier():
            raise ConfigError(f"a resource's name must be an identifier (it is a --target key and a "
                              f"metrics column, e.g. 'linear_params'), got {name!r}")
        self.name, self.description, self.unit = name, description, unit

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    def count(self, model: nn.Module, example_inputs: Any) -> float | None:
        """The exact cost of ``model`` on ``example_inputs`` (None: not countable without a
        search, e.g. a measured latency)."""
        return None

    def cost_model(self, model: nn.Module, space: SearchSpace, example_inputs: Any,
                   options: dict[str, Any], saved: dict[str, Any] | None = None) -> Any:
        """The differentiable cost of a search of ``model`` in this resource: a callable
        ``(width_mask, depth_mask) -> float64 scalar`` (see
        :class:`~dmscale.cost.resources.CostModel`). ``options``: ``SearchConfig.latency_options``;
        ``saved``: what :attr:`state_key` held in a resumed search's state."""
        raise NotImplementedError(f"resource {self.name!r} has no cost model")

    # what the search's state_dict keeps of this resource's cost model (None: nothing)
    state_key: str | None = None

    def check(self, config: Any) -> None:
        """Refuse, with a :class:`~dmscale.core.errors.ConfigError` naming the fix, a
        ``SearchConfig`` this resource cannot be searched with (default: none)."""

    def format(self, value: float | None) -> str:
        """``value`` as the summary and the report show it."""
        return format_value(value)

    def run_note(self, cost_model: Any) -> RunNote | None:
        """What a run records about ``cost_model`` after the search (default: nothing)."""
        return None


class TermResource(Resource):
    """A resource whose cost is a sum of terms of a :class:`~dmscale.cost.resources.CostModel`
    (``rows``, e.g. :meth:`~dmscale.cost.resources.CostModel.params_rows`), exact at hard masks.

    Args:
        rows: the terms, ``rows(cost_model, model, space)``.
        counter: the exact count of a model, ``counter(model, example_inputs)``; None: the key
            ``name`` of :func:`dmscale.count` (macs, params, kv_cache).
    """

    def __init__(self, name: str, description: str, unit: str, rows: TermRows,
                 counter: Callable[[nn.Module, Any], float] | None = None) -> None:
        super().__init__(name, description, unit)
        self.rows, self.counter = rows, counter

    def count(self, model: nn.Module, example_inputs: Any) -> float | None:
        if self.counter is not None:
            return float(self.counter(model, example_inputs))
        value = count(model, example_inputs).get(self.name)
        return None if value is None else float(value)

    def cost_model(self, model: nn.Module, space: SearchSpace, example_inputs: Any,
                   options: dict[str, Any], saved: dict[str, Any] | None = None) -> CostModel:
        return CostModel(model, space, self.name, rows=self.rows)


class LatencyResource(Resource):
    """Latency in microseconds, from a per-layer profile measured on the model's device
    (:class:`~dmscale.cost.latency.LatencyCostModel`); a resumed search keeps the profile."""

    state_key = "latency_profile"

    def cost_model(self, model: nn.Module, space: SearchSpace, example_inputs: Any,
                   options: dict[str, Any], saved: dict[str, Any] | None = None) -> Any:
        from dmscale.cost.latency import LatencyCostModel

        options = dict(options) if saved is None else {**options, "profile": saved}
        return LatencyCostModel(model, space, example_inputs, **options)

    def check(self, config: Any) -> None:
        if config.depth_unit == "sublayer":
            raise ConfigError("depth_unit='sublayer' with resource='latency': the latency profile times "
                              "whole residual blocks, not their branches; search macs or params with "
                              "sublayer depth (--resource params), or latency with depth_unit='block'")

    def run_note(self, cost_model: Any) -> RunNote:
        fit = cost_model.fit_report()
        state = {k: fit[k] for k in ("fit_rmse_rel", "fit_rmse_rel_max", "parts_rel_error", "calibration")}
        line = (f"latency model: fit error {fit['fit_rmse_rel']:.1%} (pooled relative RMSE, "
                f"worst layer {fit['fit_rmse_rel_max']:.1%}); the parts add up to the timed "
                f"model within {fit['parts_rel_error']:+.1%}, calibration x{fit['calibration']:.3f}")
        return RunNote("latency_fit", state, line)


_REGISTRY: dict[str, Resource] = {}


def register_resource(resource: Resource, replace: bool = False) -> Resource:
    """Make ``resource`` a choice of ``--resource``, ``--target`` and ``SearchConfig``; returns it.

    Raises:
        ConfigError: a resource of that name is registered already (pass ``replace=True``).
    """
    if not isinstance(resource, Resource):
        raise ConfigError(f"register_resource expects a dmscale.cost.registry.Resource, got "
                          f"{type(resource).__name__}")
    if resource.name in _REGISTRY and not replace:
        raise ConfigError(f"resource {resource.name!r} is registered already: pass replace=True to "
                          "replace it, or give the new one another name")
    _REGISTRY[resource.name] = resource
    return resource


def unregister_resource(name: str) -> None:
    """Remove the resource ``name`` (a test's, or one being replaced); unknown names are ignored."""
    _REGISTRY.pop(name, None)


def resources() -> tuple[Resource, ...]:
    """Every registered resource, in registration order (the built-ins first)."""
    return tuple(_REGISTRY.values())


def resource_named(name: str) -> Resource:
    """The registered resource ``name``.

    Raises:
        ConfigError: no resource of that name (the message lists the registered ones).
    """
    found = _REGISTRY.get(name) if isinstance(name, str) else None
    if found is None:
        raise ConfigError(f"unknown resource {name!r}: expected one of {tuple(_REGISTRY)}")
    return found


def format_in(name: str, value: float | None) -> str:
    """``value`` as resource ``name`` shows it (:meth:`Resource.format`); a name not
    registered in this process (a saved run's) as a plain count.

    Example:
        >>> format_in("params", 12_345), format_in("not_registered", 12_345)
        ('12.35K', '12.35K')
    """
    found = _REGISTRY.get(name)
    return format_value(value) if found is None else found.format(value)


class _Names(Sequence[str]):
    """The registered names, read at every use (a resource registered later is in it)."""

    def __getitem__(self, index: Any) -> Any:
        return tuple(_REGISTRY)[index]

    def __len__(self) -> int:
        return len(_REGISTRY)

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(_REGISTRY))

    def __contains__(self, name: object) -> bool:
        return name in _REGISTRY

    def __repr__(self) -> str:
        return repr(tuple(_REGISTRY))


RESOURCE_NAMES: Sequence[str] = _Names()


class ResourceName:
    """The converter of ``--resource``: a registered resource's name. Its :attr:`choices`
    are read when a parser is built, so a resource registered before then is offered."""

    @property
    def choices(self) -> tuple[str, ...]:
        return tuple(_REGISTRY)

    def __call__(self, value: Any) -> str:
        return resource_named(str(value)).name


def _builtin() -> None:
    register_resource(TermResource(
        "macs", "multiply-accumulates of one forward on the example inputs (convolutions, linear "
        "layers, matrix products, attention; element-wise ops not counted)", "MACs",
        rows=CostModel.macs_rows))
    register_resource(TermResource(
        "params", "the model's parameters (tied weights once, buffers not counted)", "parameters",
        rows=CostModel.params_rows))
    register_resource(LatencyResource(
        "latency", "the forward's latency on the search's device, fitted from a measured per-layer "
        "profile (a target > 1 is in microseconds)", "us"))
    register_resource(TermResource(
        "kv_cache", "bytes of K and V cached per token per sequence: the sum over attention layers "
        "of 2 x KV heads x head dim x dtype size", "bytes", rows=CostModel.kv_rows))


_builtin()
