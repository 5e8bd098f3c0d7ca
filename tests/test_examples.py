"""The README's quick start (examples/quickstart.py) runs and does what it says."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def test_quickstart_meets_the_budget_and_learns():
    path = Path(__file__).resolve().parents[1] / "examples" / "quickstart.py"
    spec = importlib.util.spec_from_file_location("quickstart", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    r = module.main(steps=60)
    assert 0.98 * r["target_macs"] <= r["macs"] <= r["target_macs"]
    assert r["accuracy"] > 0.3  # 10 classes: far above chance after 60 steps
