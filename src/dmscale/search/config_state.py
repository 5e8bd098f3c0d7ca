"""A :class:`~dmscale.search.config.SearchConfig` as plain data for checkpoints
(:func:`config_state`) and what differs from a saved one on resume (:func:`config_differences`).

Example:
    >>> from dmscale.search.config import SearchConfig
    >>> cfg = SearchConfig(resource="params", target=0.25)
    >>> config_state(cfg)["target"], config_state(cfg)["gate_factory"]
    (0.25, None)
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, fields, replace
from typing import Any

from dmscale.search.config import BEFORE_OPTION, SearchConfig

__all__ = ["config_state", "config_differences"]


def config_state(config: SearchConfig) -> dict[str, Any]:
    """The config as plain data: the gate factory by its qualified name (checkpoints stay
    loadable without importing it; a resume with another gate is refused by name)."""
    factory = config.gate_factory
    state = asdict(replace(config, gate_factory=None))
    state["budget_band"] = list(config.budget_band)  # the same in a checkpoint and in JSON
    if config.targets is None:  # one budget: the state as before ``targets`` existed
        del state["targets"]
    state["gate_factory"] = None if factory is None else \
        f"{getattr(factory, '__module__', '?')}.{getattr(factory, '__qualname__', repr(factory))}"
    return state


def config_differences(saved: dict[str, Any], config: SearchConfig) -> str:
    """What differs between a saved :func:`config_state` and ``config``, as
    ``"name: saved X, now Y, ..."`` ("" when nothing that changes the search differs).

    Options missing from ``saved`` (a state from before they existed) take the value that
    reproduces that state's behaviour (:data:`BEFORE_OPTION`, else their default);
    ``latency_options`` and ``verify`` do not change what is searched and are not compared,
    nor is ``settle_hold`` when neither side has a settle phase.

        >>> config_differences(config_state(SearchConfig()), SearchConfig(target=0.3))
        'target: saved 0.5, now 0.3'
    """
    saved, current = dict(saved), config_state(config)
    for f in fields(SearchConfig):
        if f.name in saved:
            continue
        if f.default is not MISSING:
            saved[f.name] = BEFORE_OPTION.get(f.name, f.default)
        elif f.default_factory is not MISSING:  # a list option added later (keep_depth)
            saved[f.name] = BEFORE_OPTION.get(f.name, f.default_factory())
    saved["budget_band"] = list(saved["budget_band"])  # a tuple default, a list in config_state
    for key in ("latency_options", "verify", "fold_masks", "fuse_norms"):
        saved.pop(key, None), current.pop(key, None)
    if not saved.get("settle") and not current.get("settle"):  # no settle phase: the hold never acts
        saved.pop("settle_hold", None), current.pop("settle_hold", None)
    return ", ".join(f"{k}: saved {saved.get(k)!r}, now {current.get(k)!r}"
                     for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k))
