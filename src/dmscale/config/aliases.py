"""Old spellings of options that still work: ``--imgsz`` (and ``imgsz:`` in a ``--config``
file) is ``--image-size``, which serves ``--task imagefolder`` and ``--task detect`` alike.

A deprecated spelling maps to its option with a ``FutureWarning``, once per process and
spelling; giving both spellings with different values is an error. Run directories saved
while ``imgsz`` was an option of its own hold both keys in ``config.yaml``:
:func:`saved_config_keys` reads them as the run used them (``imgsz`` was the detection image
size, ``image_size`` the image folders' crop size), without a warning.

Example:
    >>> import warnings
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore")
    ...     rename_deprecated({"imgsz": 64, "seed": 1}, "--config run.yaml")
    {'seed': 1, 'image_size': 64}
    >>> saved_config_keys({"task": "detect", "image_size": None, "imgsz": 96})["image_size"]
    96
"""

from __future__ import annotations

import warnings
from typing import Any

from dmscale.core.errors import ConfigError

__all__ = ["DEPRECATED", "rename_deprecated", "saved_config_keys", "warn_deprecated"]

# old option name -> the option it now spells
DEPRECATED: dict[str, str] = {"imgsz": "image_size"}

_WARNED: set[str] = set()


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def warn_deprecated(old: str) -> None:
    """Warn (once per process) that option ``old`` is a deprecated spelling."""
    if old in _WARNED:
        return
    _WARNED.add(old)
    new = DEPRECATED[old]
    warnings.warn(f"{_flag(old)} is deprecated and will be removed: it is {_flag(new)} now, which "
                  f"sets the image size of --task detect and imagefolder alike; write {_flag(new)} "
                  f"(or '{new.replace('_', '-')}:' in a --config file)", FutureWarning, stacklevel=3)


def rename_deprecated(options: dict[str, Any], origin: str) -> dict[str, Any]:
    """``options`` with every deprecated name replaced by its option's (warning once each).

    Raises:
        ConfigError: both spellings of one option are given, with different values.
    """
    out = {k: v for k, v in options.items() if k not in DEPRECATED}
    for old, new in DEPRECATED.items():
        if old not in options:
            continue
        warn_deprecated(old)
        value = options[old]
        if out.get(new) is not None and value is not None and out[new] != value:
            raise ConfigError(f"{origin}: {_flag(old)} {value} and {_flag(new)} {out[new]} set the same "
                              f"option to different values; give {_flag(new)} alone")
        if value is not None or new not in out:
            out[new] = value
    return out


def saved_config_keys(data: dict[str, Any]) -> dict[str, Any]:
    """A ``config.yaml`` mapping saved before ``imgsz`` became ``image_size``, as today's keys:
    a detection run's ``imgsz`` is its ``image_size``; other tasks never read ``imgsz``, so it
    is dropped. Today's mappings come back unchanged."""
    if "imgsz" not in data:
        return data
    out = dict(data)
    imgsz = out.pop("imgsz")
    if out.get("task") == "detect" and imgsz is not None:
        out["image_size"] = imgsz
    return out
