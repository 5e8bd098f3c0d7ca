"""How an option of the run is declared once, on a field of the run configuration.

A run option is a field of :class:`~dmscale.config.options.RunOptions` (the fields of
:class:`~dmscale.config.run_config.RunConfig`) declared ``name: type = run_option(default,
convert=..., help=..., commands=..., group=...)``: its help, converter, subcommands, help group,
metavar and default on the command line live in the field's metadata
(:func:`dmscale.core.options.option`), beside two facts only the run needs (``resume_mutable``,
``retrain_inherits``, read back by :func:`flagged`). An option of the search itself is declared
on :class:`~dmscale.SearchConfig`'s field; the run's class only places it by name
(``name: Any = searched()``), and :func:`with_search_options` gives that field the search
option's default and declaration. A search option with no place goes last in its help group, so
a new field of ``SearchConfig`` is an option of the command with no change here.

Example:
    >>> from dataclasses import dataclass
    >>> from dmscale.core.options import declared_options
    >>> from dmscale.core.values import positive_int
    >>> from dmscale.search.config import SearchConfig
    >>> @dataclass
    ... @with_search_options(declared_options(SearchConfig))
    ... class Run:
    ...     command: str = "search"
    ...     batch_size: int = run_option(128, convert=positive_int, help="examples per step",
    ...                                  commands=("search",), group="search", resume_mutable=True)
    ...     target: Any = searched()
    >>> [o.name for o in declared_options(Run)][:3], Run().target, flagged(Run, RESUME_MUTABLE_KEY)
    (['batch_size', 'target', 'resource'], 0.5, ('batch_size',))
"""

from __future__ import annotations

import copy
from dataclasses import Field, dataclass, field, fields
from typing import Any, Callable

from dmscale.core.errors import ConfigError
from dmscale.core.options import OPTION_KEY, Option, mirror_option, option, option_of

__all__ = ["run_option", "searched", "with_search_options", "flagged", "RESUME_MUTABLE_KEY",
           "RETRAIN_INHERITS_KEY"]

# the metadata keys of the run's own facts about a field
RESUME_MUTABLE_KEY = "dmscale.resume_mutable"  # may differ from the saved run on resume
RETRAIN_INHERITS_KEY = "dmscale.retrain_inherits"  # a retrain takes it from the search run
_PLACE_KEY = "dmscale.search_option_place"


def _flags(resume_mutable: bool, retrain_inherits: bool) -> dict[str, bool]:
    return {k: True for k, on in ((RESUME_MUTABLE_KEY, resume_mutable), (RETRAIN_INHERITS_KEY, retrain_inherits))
            if on}


def run_option(default: Any, *, resume_mutable: bool = False, retrain_inherits: bool = False, **kw: Any) -> Any:
    """A field that is an option of the command: ``field(default=default, metadata=option(**kw))``.

    ``kw`` are :func:`dmscale.core.options.option`'s (``convert``, ``help``, ``commands``,
    ``group``, ``metavar``, ``flag_kind``, ``cli_default``: ``"auto"`` for a field whose None
    the run resolves). ``resume_mutable``: the option may differ from the saved run's when it
    is resumed (it changes how the run goes, not what it computes: ``--device``,
    ``--stop-after``) and starts from its default then. ``retrain_inherits``: ``dmscale
    retrain`` takes it from the search run it retrains (the task, the data, the model).
    """
    return field(default=default, metadata={**option(**kw), **_flags(resume_mutable, retrain_inherits)})


def searched(*, resume_mutable: bool = False) -> Any:
    """The place, among the run's fields, of the option :class:`~dmscale.SearchConfig`
    declares on its field of the same name (:func:`with_search_options` fills it in)."""
    return field(metadata={_PLACE_KEY: True, **_flags(resume_mutable, False)})


def flagged(cls: type, key: str) -> tuple[str, ...]:
    """The names of the fields of dataclass ``cls`` whose metadata sets ``key``, in field order."""
    return tuple(f.name for f in fields(cls) if f.metadata.get(key))


@dataclass(frozen=True)
class _Place:
    """Where an option declared on :class:`~dmscale.SearchConfig` stands in the table."""

    name: str


def _table(rows: tuple[Option | _Place, ...], declared: tuple[Option, ...]) -> tuple[Option, ...]:
    """``rows`` with each place filled by the declared option of its name; a declared option
    with no place goes last in its help group (so a new field of ``SearchConfig`` is an
    option of the command with no change here)."""
    by_name = {o.name: o for o in declared}
    stale = [r.name for r in rows if isinstance(r, _Place) and r.name not in by_name]
    if stale:
        raise ConfigError(f"the option table places {stale}, which SearchConfig does not declare: "
                          "declare them with option(...) on SearchConfig, or drop their place")
    twice = [r.name for r in rows if isinstance(r, Option) and r.name in by_name]
    if twice:
        raise ConfigError(f"options {twice} are declared on the run configuration and on SearchConfig: "
                          "declare each once (a search option's place is searched())")
    table = [by_name[r.name] if isinstance(r, _Place) else r for r in rows]
    placed = {o.name for o in table}
    for extra in (o for o in declared if o.name not in placed):
        last = max((i for i, o in enumerate(table) if o.group == extra.group), default=len(table) - 1)
        table.insert(last + 1, extra)
    return tuple(table)


def _search_field(opt: Option, flags: dict[str, Any]) -> Field[Any]:
    """The run's field of search option ``opt``: its default (None for ``auto``, resolved per
    run), its declaration (:func:`~dmscale.core.options.mirror_option`) and the run's flags."""
    default = None if opt.default == "auto" else opt.default
    meta = {**mirror_option(opt), **flags}
    if isinstance(default, (list, dict, set)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)


def with_search_options(declared: tuple[Option, ...]) -> Callable[[type], type]:
    """A class decorator, applied before ``@dataclass``: every :func:`searched` place of the
    class body becomes the field of the ``declared`` option of its name, and a declared option
    with no place gets a field last in its help group. The fields that are not options (no
    :func:`run_option`, no place) lead; the options follow in the order of the table they
    make (``config.yaml`` keeps it).

    Raises:
        ConfigError: a place ``declared`` has no option for, an option declared twice, or a
            field that is not an option after the options.
    """
    def fill(cls: type) -> type:
        body = dict(cls.__dict__.get("__annotations__", {}))
        lead: list[str] = []
        rows: list[Option | _Place] = []
        flags: dict[str, dict[str, Any]] = {}
        for name in body:
            value = cls.__dict__.get(name)
            meta = value.metadata if isinstance(value, Field) else {}
            if _PLACE_KEY in meta:
                rows.append(_Place(name))
                flags[name] = {k: v for k, v in meta.items() if k != _PLACE_KEY}
            elif OPTION_KEY in meta:
                rows.append(option_of(value, name))
            elif rows:
                raise ConfigError(f"{cls.__name__}.{name} is not an option and follows the options: "
                                  "declare it with run_option(...), or before the first option")
            else:
                lead.append(name)
        table = _table(tuple(rows), declared)
        own = {r.name for r in rows if isinstance(r, Option)}
        for opt in table:
            if opt.name not in own:
                setattr(cls, opt.name, _search_field(opt, flags.get(opt.name, {})))
        cls.__annotations__ = {name: body.get(name, "Any") for name in [*lead, *(o.name for o in table)]}
        return cls

    return fill
