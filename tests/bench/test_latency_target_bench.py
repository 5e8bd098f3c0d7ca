"""bench/latency_target.py (issue 29): both budgets are met on the model it times, and the table
says what each export measured against what the latency model predicted."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import latency_target  # noqa: E402


def test_quick_run_meets_both_budgets_and_tables_them(tmp_path: Path) -> None:
    latency_target.main(["--quick", "--workdir", str(tmp_path)])
    cache = json.loads((tmp_path / "quick" / "latency_target.json").read_text())
    (row,) = cache["rows"].values()
    assert (row["model"], row["batch"], row["dtype"]) == ("resnet18 (torchvision)", 1, "float32")
    macs, lat = row["arms"]["macs"], row["arms"]["latency0"]
    assert 0.49 < macs["macs_ratio"] <= 0.5 and 0.49 < macs["predicted"] <= 0.5  # the solver lands under the target
    assert 0.49 < lat["predicted"] <= 0.5  # of the fitted latency
    for arm in (macs, lat):  # measured: positive ratios in order (not asserted near 0.5: timings are noise here)
        assert 0 < arm["q1"] <= arm["ratio"] <= arm["q3"]
    table = (tmp_path / "quick" / "latency_target.md").read_text()
    line = next(t for t in table.splitlines() if t.startswith("| resnet18 (torchvision) | 96 px, float32 | 1 |"))
    assert f"| {macs['macs_ratio']:.3f} / {macs['ratio']:.3f} (" in line, line
    assert f"| {lat['predicted']:.3f} / {lat['ratio']:.3f} (" in line, line
