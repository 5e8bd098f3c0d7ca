"""bench/table16.py: the resource-weight x structure-lr table builds from its cache, marks the
cells whose search did not reach the target, counts landings in the issue's window and keeps
the hand-written reading (no training here)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
from bench import table16 as t16  # noqa: E402


def _row(weight: float, lr: float, seed: int, acc: float, end: float) -> dict:
    return {"weight": weight, "lr": lr, "seed": seed, "target": 0.5, "search_epochs": 10.0,
            "retrain_epochs": 20.0, "search_end": end, "finish_steps": 0, "solver_ran": True,
            "shift_posthoc": 0.01, "exported": 0.995, "acc_search": 0.6, "acc": acc, "structure": "8/8 | blocks 2"}


@pytest.fixture()
def results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(t16, "RESULTS", tmp_path)
    return tmp_path


def test_table_marks_unreached_cells_and_counts_landings(results: Path) -> None:
    runs = [_row(1.0, 0.05, 0, 0.98, 0.99), _row(1.0, 0.05, 1, 0.96, 1.01),
            _row(0.1, 0.05, 0, 0.97, 1.50), _row(0.1, 5e-5, 0, 0.95, 2.00)]
    cache = {"runs": {str(i): r for i, r in enumerate(runs)}, "machine": "m",
             "invocations": [{"command": "python bench/table16.py --seeds 0 1", "commit": "abc1234"}]}
    md = t16.write_table(cache).read_text()
    assert "`python bench/table16.py --seeds 0 1` (commit `abc1234`)" in md
    assert "| lambda_resource \\ lr_structure | 0.05 | 5e-05 |" in md
    # lambda 1, lr 0.05: mean of 98 and 96, search reached the target (mean end 1.00)
    assert "| 1 | 97.00 ± 1.41 | - |" in md
    # lambda 0.1: both cells ended far over the target -> marked (/)
    assert "| 0.1 | 97.00 (/) | 95.00 (/) |" in md
    assert "1.00 ± 0.01 (1/2 in window)" in md
    assert (results / "table16.png").stat().st_size > 0


def test_reading_survives_a_rebuild(results: Path) -> None:
    cache = {"runs": {"a": _row(1.0, 0.05, 0, 0.98, 0.99)}, "invocations": []}
    out = t16.write_table(cache)
    out.write_text(out.read_text() + "\n## Reading\n\nhand-written words\n")
    cache["runs"]["b"] = _row(10.0, 0.05, 0, 0.97, 0.97)
    md = t16.write_table(cache).read_text()
    assert md.count("## Reading") == 1 and "hand-written words" in md
    assert "| 10 | 97.00 | - |" not in md and "| 10 | 97.00 |" in md


def test_run_key_names_every_setting() -> None:
    assert t16.run_key(0.1, 5e-5, 2, 0.5, 10.0, 20.0) == "w0.1/lr5e-05/s2/t0.5/S10/R20"


def test_settle_protocol_needs_a_table_of_its_own() -> None:
    with pytest.raises(SystemExit):
        t16.main(["--settle", "0.4", "--settle-hold", "--table-only"])
