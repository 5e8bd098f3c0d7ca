"""Options declared once, on the fields of a dataclass (:func:`option`, :func:`declared_options`).

A field declared with ``metadata=option(...)`` carries what the ``dmscale`` command needs to
offer it (help text, value converter, default on the command line, help group, the
subcommands that take it, metavar) in its ``metadata``; :func:`declared_options` reads them back as
:class:`Option` rows. The argument parser, the keys a ``--config`` file may set,
``--print-config`` and the run's ``config.yaml`` are built from these rows, so a field
declared this way (e.g. on :class:`dmscale.SearchConfig`) is a command-line option with no
other file changed. A field may also stand for an option declared on another class's field
(:func:`mirror_option`: the run configuration's field of a search option), and
:func:`option_of` reads a field's option before ``@dataclass`` has named it. It lives in
``core`` because both the search (which declares its fields) and the configuration (which
reads them) use it; it knows nothing of either.

Example:
    >>> from dataclasses import dataclass, field
    >>> from dmscale.core.values import positive_int
    >>> @dataclass
    ... class Knobs:
    ...     width: int = field(default=8, metadata=option(
    ...         convert=positive_int, help="channels per layer", commands=("search",), group="search",
    ...         metavar="N"))
    ...     note: str = "not an option"
    >>> [(o.name, o.flag, o.default, o.metavar) for o in declared_options(Knobs)]
    [('width', '--width', 8, 'N')]
"""

from __future__ import annotations

from dataclasses import MISSING, Field, dataclass, fields
from typing import Any, Callable

from dmscale.core.errors import ConfigError

__all__ = ["Option", "option", "mirror_option", "option_of", "declared_options", "OPTION_KEY"]

OPTION_KEY = "dmscale.option"  # the key of a field's metadata that holds its option


@dataclass(frozen=True)
class Option:
    """One option: ``--flag`` on the command line and ``name`` in a config file."""

    name: str
    convert: Callable[[Any], Any]
    default: Any
    help: str
    commands: tuple[str, ...]
    group: str
    metavar: str | None = None
    flag_kind: str = "value"  # "value" | "flag" (store_true) | "append"

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def choices(self) -> tuple[str, ...] | None:
        return getattr(self.convert, "choices", None)


def option(*, convert: Callable[[Any], Any], help: str, commands: tuple[str, ...], group: str,
           metavar: str | None = None, flag_kind: str = "value", cli_default: Any = MISSING) -> dict[str, Any]:
    """The ``metadata`` of a dataclass field that is also an option of the command:
    ``field(default=..., metadata=option(...))`` (see the module docstring).

    The option's default is the field's, or ``cli_default`` where the command's differs (e.g.
    ``"auto"``, resolved per run, for a field whose library default is a number; a field with a
    ``default_factory`` needs one). ``convert`` turns a command-line string or a config-file
    value into the field's value and raises :class:`~dmscale.core.errors.ConfigError` on a bad one.
    """
    return {OPTION_KEY: {"convert": convert, "help": help, "commands": tuple(commands), "group": group,
                         "metavar": metavar, "flag_kind": flag_kind, "default": cli_default}}


def mirror_option(opt: Option) -> dict[str, Any]:
    """The ``metadata`` of a field that stands for ``opt``, an option declared on another
    class's field: :func:`option_of` gives back ``opt`` itself (so both classes offer the
    same option, declared once)."""
    return {OPTION_KEY: opt}


def option_of(f: Field[Any], name: str | None = None) -> Option:
    """The :class:`Option` field ``f`` declares (its ``metadata`` holds :data:`OPTION_KEY`).

    ``name`` is the field's name where ``@dataclass`` has not set it yet (a class decorator
    that reads the body before ``@dataclass`` runs); the default is ``f.name``.
    """
    spec = f.metadata[OPTION_KEY]
    if isinstance(spec, Option):
        return spec
    spec = dict(spec)
    name = f.name if name is None else name
    if spec["default"] is MISSING:
        if f.default is MISSING:
            raise ConfigError(f"option {name!r}: a field without a plain default needs cli_default, "
                              "the option's default on the command line")
        spec["default"] = f.default
    return Option(name, **spec)


def declared_options(cls: type) -> tuple[Option, ...]:
    """The :class:`Option` of every field of dataclass ``cls`` declared with :func:`option`
    (or :func:`mirror_option`), in field order (the option's name is the field's)."""
    return tuple(option_of(f) for f in fields(cls) if OPTION_KEY in f.metadata)
