"""The public surface (``dms.__all__``, public submodules, the CLI's subcommands and flags) is
what the snapshot says: a layout change inside the package must not change it."""

import json
from pathlib import Path

from public_surface import surface

SNAPSHOT = Path(__file__).parent / "fixtures" / "public_surface.json"


def test_public_surface_matches_snapshot():
    want = json.loads(SNAPSHOT.read_text())
    got = json.loads(json.dumps(surface(), sort_keys=True))
    assert got["all"] == want["all"]
    for name in want["names"]:
        assert got["names"][name] == want["names"][name], name
    assert got["cli"] == want["cli"]
    assert got == want


def test_public_submodules_import_by_path():
    """``dms.deploy``, ``dms.distributed`` and ``dms.errors`` are documented as modules: both
    spellings work."""
    import importlib

    import dmscale as dms

    for name in ("deploy", "distributed", "errors"):
        mod = importlib.import_module(f"dmscale.{name}")
        assert getattr(dms, name) is mod
        assert sorted(mod.__all__) == sorted(json.loads(SNAPSHOT.read_text())["names"][name]["all"])
