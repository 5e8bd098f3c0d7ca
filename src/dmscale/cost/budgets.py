"""The budgets of a search, one value: ``resource -> target`` pairs and their band.

:class:`Budgets` is parsed once (:func:`parse_targets`: ``--target``'s string or a config
file's value; :meth:`Budgets.of`: ``SearchConfig``'s ``resource`` / ``target`` / ``targets``
or the run's ``--resource`` / ``--target``), validated once (its constructor: registered
resources, finite targets > 0, a band inside (0, 1]) and held by the run
(``RunConfig.budgets``) and the searcher (``SearchConfig.budgets``) alike. It is a read-only
mapping ``{resource: target}`` in budget order; the first budget is the primary one (the one
single-resource reports show).

Example:
    >>> b = Budgets.of("macs", "params=0.7,kv_cache=0.5")
    >>> b.primary, dict(b), b.band
    ('params', {'params': 0.7, 'kv_cache': 0.5}, (0.98, 1.0))
    >>> Budgets.of("kv_cache", {"params": 0.7, "kv_cache": 0.5}).primary  # --resource moves first
    'kv_cache'
    >>> Budgets({"flops": 0.5})
    Traceback (most recent call last):
    ...
    dmscale.core.errors.ConfigError: unknown resource 'flops': expected one of ('macs', 'params', 'latency', 'kv_cache')
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Mapping

from dmscale.core.errors import ConfigError
from dmscale.core.values import kv_dict
from dmscale.cost.registry import RESOURCE_NAMES, resource_named

__all__ = ["Budgets", "parse_targets", "parse_band", "DEFAULT_RESOURCE", "DEFAULT_TARGET", "DEFAULT_BAND"]

# the budget of a search that names none, and the band the settle phase lands in
DEFAULT_RESOURCE, DEFAULT_TARGET = "macs", 0.5
DEFAULT_BAND = (0.98, 1.0)

_FIX = "pass a fraction of the supernet's cost (e.g. 0.5) or an absolute count > 1"


def _target(resource: str | None, value: Any) -> float:
    """``value`` as a target: a finite number > 0 (``resource``: the budget it is the target
    of, named in the error; None: the one budget's)."""
    if isinstance(value, bool) or not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
        if resource is None:
            raise ConfigError(f"target must be a finite number > 0, got {value!r}: {_FIX}")
        raise ConfigError(f"the target of {resource} must be a number > 0 (finite; <= 1: a fraction of "
                          f"the supernet's cost, > 1: an absolute count), got {value!r}")
    return float(value)


def _band(value: Any) -> tuple[float, float]:
    band = tuple(value) if isinstance(value, (list, tuple)) else ()
    if len(band) != 2 or not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in band) \
            or not 0 < band[0] <= band[1] <= 1:
        raise ConfigError(f"budget_band must be (low, high) with 0 < low <= high <= 1 (fractions of "
                          f"the target the settle phase aims between), got {value!r}")
    return (float(band[0]), float(band[1]))


def _require_mapping(targets: Any) -> None:
    if not isinstance(targets, Mapping) or not targets:
        raise ConfigError(f"targets must be a non-empty dict {{resource: target}} (e.g. "
                          f"{{'params': 0.7, 'kv_cache': 0.5}}), got {targets!r}")


class Budgets(Mapping[str, float]):
    """One or several budgets ``{resource: target}`` (a target <= 1 is a fraction of the
    supernet's cost, > 1 an absolute count in the resource's unit) and the band
    ``(low, high)`` of the target the settle phase lands the exact cost in.

    Raises:
        ConfigError: no budget, an unregistered resource, a target that is not a finite
            number > 0, or a band outside 0 < low <= high <= 1.
    """

    def __init__(self, targets: Mapping[str, Any], band: Any = DEFAULT_BAND) -> None:
        _require_mapping(targets)
        items: dict[str, float] = {}
        for name, value in targets.items():
            resource_named(name)  # a registered resource
            items[str(name)] = _target(str(name), value)
        self._items = items
        self.band: tuple[float, float] = _band(band)

    @classmethod
    def of(cls, resource: str = DEFAULT_RESOURCE, target: Any = DEFAULT_TARGET,
           targets: Mapping[str, Any] | None = None, band: Any = DEFAULT_BAND) -> Budgets:
        """The budgets of ``resource`` / ``target`` (one budget, or with ``target`` a mapping or
        ``RESOURCE=T,...`` string several) or of ``targets`` (several; ``resource`` and
        ``target`` then at their defaults or naming one of them). A ``resource`` other than
        the default that is among several budgets becomes the primary one (moved first); one
        that is not is refused.

        Raises:
            ConfigError: what :class:`Budgets` refuses, both forms at once with other values,
                or a ``resource`` not among several budgets.
        """
        resource_named(resource)
        if isinstance(target, str) or isinstance(target, Mapping):
            target = parse_targets(target)
        if targets is not None:
            _require_mapping(targets)
            if isinstance(target, dict) or target != DEFAULT_TARGET and target != targets.get(resource):
                raise ConfigError(f"pass either resource={resource!r}, target={target!r} (one "
                                  f"budget) or targets={dict(targets)!r} (several), not both")
            several = cls(targets, band)
        elif isinstance(target, dict):
            several = cls(target, band)
        else:
            return cls({resource: _target(None, target)}, band)
        # "macs" is also the default, which cannot tell an explicit resource="macs" from none:
        # it leaves the first budget primary
        if resource in (DEFAULT_RESOURCE, several.primary):
            return several
        if resource not in several:
            raise ConfigError(f"resource {resource!r} is not among the budgets ({', '.join(several)}): "
                              "leave --resource (resource=) out with several budgets, or add its target")
        return several.with_primary(resource)

    def with_primary(self, resource: str) -> Budgets:
        """The same budgets with ``resource`` first (the primary one)."""
        moved = {resource: self[resource], **{k: v for k, v in self.items() if k != resource}}
        return Budgets(moved, self.band)

    @property
    def primary(self) -> str:
        """The first budget's resource: ``SearchConfig.resource``, what one-budget reports show."""
        return next(iter(self._items))

    @property
    def several(self) -> bool:
        """Whether there are two budgets or more (``SearchConfig.targets`` is set)."""
        return len(self._items) > 1

    def check(self, config: Any) -> None:
        """Every budget's resource's checks of ``config`` (:meth:`Resource.check
        <dmscale.cost.registry.Resource.check>`, e.g. latency refuses sublayer depth)."""
        for name in self._items:
            resource_named(name).check(config)

    def __getitem__(self, name: str) -> float:
        return self._items[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Budgets({self._items!r}, band={self.band!r})"


def parse_targets(value: Any) -> float | dict[str, float]:
    """The converter of ``--target`` (and of a config file's ``target``): a number > 0 (the
    budget of ``--resource``), or several budgets ``RESOURCE=T[,RESOURCE=T...]`` (or a
    mapping), validated as :class:`Budgets` validates them.

    Example:
        >>> parse_targets("0.4"), parse_targets("params=0.7,kv_cache=0.5")
        (0.4, {'params': 0.7, 'kv_cache': 0.5})
    """
    if not isinstance(value, Mapping) and "=" not in str(value):
        try:
            number = float(value) if not isinstance(value, bool) else value
        except (TypeError, ValueError):
            raise ConfigError(f"expected a number > 0 or RESOURCE=T[,RESOURCE=T...] with RESOURCE one "
                              f"of {', '.join(RESOURCE_NAMES)}, got {value!r}") from None
        return _target(None, number)
    items = kv_dict(dict(value) if isinstance(value, Mapping) else value)
    if not items:
        raise ConfigError("--target: expected a number > 0 or RESOURCE=T[,RESOURCE=T...], got none")
    for name, target in items.items():
        if isinstance(target, str):  # a config file's "0.5": the number it spells
            try:
                items[name] = float(target)
            except ValueError:
                _target(name, target)
    return dict(Budgets(items))


def parse_band(value: Any) -> tuple[float, float]:
    """The converter of ``--budget-band``: ``'0.95,1.0'`` (or a two-item list) as ``(low,
    high)``, validated as :class:`Budgets` validates its band.

    Example:
        >>> parse_band("0.95,1.0")
        (0.95, 1.0)
    """
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    try:
        return _band([float(v) if isinstance(v, str) else v for v in items])
    except ValueError:
        raise ConfigError(f"budget_band must be LOW,HIGH (two fractions of the target, e.g. 0.98,1.0), "
                          f"got {value!r}") from None
