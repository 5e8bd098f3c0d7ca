"""The value converters of the command's options (:data:`dmscale.config.run_config.OPTIONS`,
and the options declared on :class:`~dmscale.SearchConfig`'s fields).

Each takes a value from the command line (a string) or a config file (any YAML scalar) and
returns it typed, or raises :class:`~dmscale.core.errors.ConfigError` saying what was expected.

Example:
    >>> expand_factors("width=1.5,depth=2")
    {'width': 1.5, 'depth': 2.0}
    >>> positive_int("0")
    Traceback (most recent call last):
    ...
    dmscale.core.errors.ConfigError: expected a positive integer, got '0'
"""

from __future__ import annotations

import math
from typing import Any, Callable

from dmscale.core.errors import ConfigError

__all__ = [
    "positive_int",
    "device_value",
    "nonneg_int",
    "align_value",
    "integer",
    "real",
    "positive_float",
    "nonneg_float",
    "fraction",
    "open_fraction",
    "unit_fraction",
    "band",
    "nonempty_str",
    "boolean",
    "choice",
    "scalar",
    "kv_dict",
    "expand_factors",
    "budget_targets",
    "str_list",
    "eval_every_value",
    "auto_or",
]


def positive_int(value: Any) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"expected a positive integer, got {value!r}")
    try:
        number = int(str(value), 10) if isinstance(value, str) else value
    except ValueError:
        raise ConfigError(f"expected a positive integer, got {value!r}") from None
    if not isinstance(number, int) or number < 1:
        raise ConfigError(f"expected a positive integer, got {value!r}")
    return number


def nonneg_int(value: Any) -> int:
    """An integer >= 0 (a count where 0 means none, e.g. ``--workers 0``).

    Example:
        >>> nonneg_int("0"), nonneg_int(3)
        (0, 3)
    """
    if isinstance(value, bool):
        raise ConfigError(f"expected an integer >= 0, got {value!r}")
    try:
        number = int(str(value), 10) if isinstance(value, str) else value
    except ValueError:
        raise ConfigError(f"expected an integer >= 0, got {value!r}") from None
    if not isinstance(number, int) or number < 0:
        raise ConfigError(f"expected an integer >= 0, got {value!r}")
    return number


def align_value(value: Any) -> int | None:
    """'auto' (or None) -> None, the device's default; else a positive integer.

    Example:
        >>> align_value("8"), align_value("auto")
        (8, None)
    """
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    try:
        return positive_int(value)
    except ConfigError:
        raise ConfigError(f"expected auto (8 on a CUDA device, 1 elsewhere) or an integer >= 1 (the "
                          f"multiple every searched width keeps, e.g. 8), got {value!r}") from None


def integer(value: Any) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"expected an integer, got {value!r}")
    try:
        return int(str(value), 10) if isinstance(value, str) else int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"expected an integer, got {value!r}") from None


def real(value: Any) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"expected a number, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"expected a number, got {value!r}") from None
    if not math.isfinite(number):
        raise ConfigError(f"expected a finite number, got {value!r}")
    return number


def positive_float(value: Any) -> float:
    number = real(value)
    if number <= 0:
        raise ConfigError(f"expected a number > 0, got {value!r}")
    return number


def nonneg_float(value: Any) -> float:
    number = real(value)
    if number < 0:
        raise ConfigError(f"expected a number >= 0, got {value!r}")
    return number


def fraction(value: Any) -> float:
    number = real(value)
    if not 0.0 <= number <= 1.0:
        raise ConfigError(f"expected a number in [0, 1], got {value!r}")
    return number


def open_fraction(value: Any) -> float:
    number = real(value)
    if not 0.0 < number <= 1.0:
        raise ConfigError(f"expected a number in (0, 1], got {value!r}")
    return number


def unit_fraction(value: Any) -> float:
    number = real(value)
    if not 0.0 <= number < 1.0:
        raise ConfigError(f"expected a number in [0, 1), got {value!r}")
    return number


def band(value: Any) -> tuple[float, float]:
    """'0.95,1.0' (or a two-item list) -> (0.95, 1.0): fractions 0 < low <= high <= 1 of a target."""
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    if len(items) != 2:
        raise ConfigError(f"expected LOW,HIGH (two fractions of the target, e.g. 0.98,1.0), got {value!r}")
    low, high = (real(v) for v in items)
    if not 0.0 < low <= high <= 1.0:
        raise ConfigError(f"expected 0 < LOW <= HIGH <= 1 (fractions of the target), got {value!r}")
    return (low, high)


def nonempty_str(value: Any) -> str:
    if not isinstance(value, (str, int, float)) or isinstance(value, bool) or str(value) == "":
        raise ConfigError(f"expected a non-empty string, got {value!r}")
    return str(value)


def boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"expected true or false, got {value!r}")


def choice(*choices: str) -> Callable[[Any], str]:
    def convert(value: Any) -> str:
        text = str(value)
        if text not in choices:
            raise ConfigError(f"expected one of {', '.join(choices)}; got {value!r}")
        return text

    convert.choices = choices  # type: ignore[attr-defined]
    return convert


def auto_or(convert: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``convert``, but ``auto`` (or None) is None: the value the run's task chooses
    (:mod:`dmscale.config.defaults`); a choice converter keeps its choices, ``auto`` first.

    Example:
        >>> auto_or(positive_float)("0.1"), auto_or(positive_float)("auto")
        (0.1, None)
        >>> auto_or(choice("sgd", "adamw")).choices
        ('auto', 'sgd', 'adamw')
    """
    def converted(value: Any) -> Any:
        if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
            return None
        try:
            return convert(value)
        except ConfigError as err:
            raise ConfigError(f"{err} (or auto: the task's default)") from None

    choices = getattr(convert, "choices", None)
    if choices is not None:
        converted.choices = ("auto", *choices)  # type: ignore[attr-defined]
    return converted


def device_value(value: Any) -> str:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N`` (one GPU of several).

    Example:
        >>> device_value("cuda:1"), device_value("auto")
        ('cuda:1', 'auto')
    """
    text = str(value).strip()
    if text in ("auto", "cpu", "cuda") or (text.startswith("cuda:") and text[5:].isdigit()):
        return text
    raise ConfigError(f"expected auto, cpu, cuda or cuda:N (a GPU index); got {value!r}")


def scalar(text: str) -> Any:
    """'3' -> 3, '0.5' -> 0.5, 'true' -> True, anything else stays a string."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def kv_dict(value: Any) -> dict[str, Any]:
    """'depth=20,width=16' (or a mapping) -> {'depth': 20, 'width': 16}."""
    if isinstance(value, dict):
        return {str(k): v for k, v in value.items()}
    text = nonempty_str(value)
    out: dict[str, Any] = {}
    for part in text.split(","):
        key, sep, val = part.partition("=")
        if not sep or not key.strip() or not val.strip():
            raise ConfigError(f"expected KEY=VALUE[,KEY=VALUE...], got {text!r}")
        out[key.strip()] = scalar(val.strip())
    return out


def budget_targets(resources: tuple[str, ...]) -> Callable[[Any], float | dict[str, float]]:
    """A converter for ``--target``: a number > 0 (the budget of ``--resource``), or several
    budgets ``RESOURCE=T[,RESOURCE=T...]`` (or a mapping) of the ``resources`` named.

        >>> convert = budget_targets(("macs", "params", "kv_cache"))
        >>> convert("0.4"), convert("params=0.7,kv_cache=0.5")
        (0.4, {'params': 0.7, 'kv_cache': 0.5})
        >>> convert("flops=0.5")
        Traceback (most recent call last):
        ...
        dmscale.core.errors.ConfigError: unknown resource 'flops' in the budgets 'flops=0.5': expected RESOURCE=T[,RESOURCE=T...] with RESOURCE one of macs, params, kv_cache
    """
    def convert(value: Any) -> float | dict[str, float]:
        if not isinstance(value, dict) and "=" not in str(value):
            return positive_float(value)
        items = kv_dict(value)
        out: dict[str, float] = {}
        for key, val in items.items():
            if key not in resources:
                raise ConfigError(f"unknown resource {key!r} in the budgets {value!r}: expected "
                                  f"RESOURCE=T[,RESOURCE=T...] with RESOURCE one of {', '.join(resources)}")
            try:
                out[key] = positive_float(val)
            except ConfigError:
                raise ConfigError(f"the target of {key} must be a number > 0 (<= 1: a fraction of the "
                                  f"supernet's cost, > 1: an absolute count), got {val!r}") from None
        return out

    return convert


def expand_factors(value: Any) -> dict[str, float]:
    """'width=1.5,depth=2' -> {'width': 1.5, 'depth': 2.0}; either key may be left out."""
    items = kv_dict(value)
    unknown = sorted(set(items) - {"width", "depth"})
    if unknown:
        raise ConfigError(f"expected width=W,depth=D, got unknown key(s) {unknown}")
    out = {"width": 1.0, "depth": 1.0}
    for key, val in items.items():
        number = real(val)
        if number <= 0:
            raise ConfigError(f"expand {key} must be > 0, got {val!r}")
        out[key] = number
    return out


def str_list(value: Any) -> list[str]:
    if isinstance(value, (list, tuple)):
        items = [str(v) for v in value]
    else:
        items = nonempty_str(value).split(",")
    items = [i.strip() for i in items if i.strip()]
    return items


def eval_every_value(value: Any) -> int | str:
    """``--eval-every``: N steps (a positive integer) or X epochs (a positive number followed
    by ``e``); steps come back as an int, epochs as the normalised text ``'<X>e'``.

    Example:
        >>> eval_every_value("200"), eval_every_value(50), eval_every_value("0.50e"), eval_every_value("2E")
        (200, 50, '0.5e', '2e')
        >>> eval_every_value("2.5")
        Traceback (most recent call last):
        ...
        dmscale.core.errors.ConfigError: expected N steps (a positive integer, e.g. 200) or X epochs (a number followed by e, e.g. 1e or 0.5e), got '2.5'
    """
    bad = ConfigError("expected N steps (a positive integer, e.g. 200) or X epochs (a number "
                      f"followed by e, e.g. 1e or 0.5e), got {value!r}")
    if isinstance(value, bool):
        raise bad
    text = str(value).strip().lower()
    if text.endswith("e"):
        try:
            epochs = float(text[:-1])
        except ValueError:
            raise bad from None
        if not math.isfinite(epochs) or epochs <= 0:
            raise bad
        return f"{epochs:g}e"
    if isinstance(value, float) and not value.is_integer():
        raise bad
    try:
        return positive_int(int(value) if isinstance(value, float) else value)
    except ConfigError:
        raise bad from None


# ----------------------------------------------------------------------------- options
