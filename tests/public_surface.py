"""What a user of dmscale sees, as plain data: ``dms.__all__`` with each name's kind and
signature, the public submodules' ``__all__``, and the ``dmscale`` command's subcommands with
their flags, choices and defaults. ``tests/test_public_surface.py`` compares it with the
snapshot in ``tests/fixtures/public_surface.json``.

Regenerate the snapshot only for a deliberate change of the public surface:

    PYTHONPATH=src:tests python -m public_surface > tests/fixtures/public_surface.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import types
from typing import Any

__all__ = ["surface"]


def _describe(obj: Any) -> dict[str, Any]:
    if isinstance(obj, types.ModuleType):
        return {"kind": "module", "all": sorted(getattr(obj, "__all__", []))}
    kind = "class" if isinstance(obj, type) else "function" if callable(obj) else type(obj).__name__
    try:
        sig = str(inspect.signature(obj))
    except (TypeError, ValueError):
        sig = None
    return {"kind": kind, "signature": sig}


def _actions(parser: argparse.ArgumentParser) -> list[dict[str, Any]]:
    out = []
    for a in parser._actions:
        if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        out.append({"dest": a.dest, "flags": list(a.option_strings), "nargs": a.nargs,
                    "choices": list(a.choices) if a.choices is not None else None,
                    "default": repr(a.default)})
    return sorted(out, key=lambda d: (d["flags"], d["dest"]))


def _commands(parser: argparse.ArgumentParser) -> dict[str, Any]:
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            return {name: {"options": _actions(p), "commands": _commands(p)}
                    for name, p in sorted(a.choices.items())}
    return {}


def surface() -> dict[str, Any]:
    """The public surface of the installed dmscale, JSON-serialisable."""
    import dmscale as dms
    from dmscale.cli import build_parser

    parser = build_parser()
    return {"all": sorted(dms.__all__),
            "names": {name: _describe(getattr(dms, name)) for name in sorted(dms.__all__)},
            "cli": {"options": _actions(parser), "commands": _commands(parser)}}


if __name__ == "__main__":
    print(json.dumps(surface(), indent=1, sort_keys=True))
