"""bench/schedule_ablation.py's table from its cache (issue 10, table 7): ``--table-only`` runs
nothing and keeps the command of the last invocation that ran something (its committed table
named a script that had been renamed since, with no way to rewrite it from the cache)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
from bench import schedule_ablation as sa  # noqa: E402


def _fake_run(arm: sa.Arm, seed: int, epochs: float, threads: int) -> dict[str, Any]:
    return {"arm": arm.name, "seed": seed, "epochs": epochs, "search_end": 1.0 + seed / 10,
            "exported": 0.99, "acc_search": 0.6, "acc": 0.95 + seed / 100, "seconds": 1.0,
            "commit": "abc1234"}


def test_table_only_runs_nothing_and_keeps_the_last_command(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sa, "RESULTS", tmp_path)
    monkeypatch.setattr(sa, "CACHE", tmp_path / "schedule.json")
    monkeypatch.setattr(sa, "plot", lambda cache: tmp_path / "schedule.png")
    calls: list[tuple[str, int]] = []

    def run(*a: Any) -> dict[str, Any]:
        calls.append((a[0].name, a[1]))
        return _fake_run(*a)

    monkeypatch.setattr(sa, "run_one", run)
    sa.main(["--seeds", "0", "1", "--epochs", "0.5"])
    assert len(calls) == 2 * len(sa.ARMS)
    first = (tmp_path / "schedule.md").read_text()
    assert "- command: `python -m bench.schedule_ablation --seeds 0 1 --epochs 0.5`" in first
    assert "`abc1234`" in first

    sa.main(["--table-only", "--seeds", "0", "1", "--epochs", "0.5"])
    assert len(calls) == 2 * len(sa.ARMS)  # nothing ran
    assert (tmp_path / "schedule.md").read_text() == first


def test_table_only_without_a_cache_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sa, "RESULTS", tmp_path)
    monkeypatch.setattr(sa, "CACHE", tmp_path / "schedule.json")
    with pytest.raises(SystemExit, match="no cached run"):
        sa.main(["--table-only"])


def test_runs_from_before_per_run_commits_name_the_recorded_range() -> None:
    cache = {"commit": "last000", "run_commits": "`aaa` to `bbb`", "machine": "m", "runs": {}}
    assert sa._commits(cache, {"x": [{"seed": 0}]}) == "`aaa` to `bbb`"
    assert sa._commits(cache, {"x": [{"seed": 0, "commit": "ccc"}]}) == "`ccc`"
    assert sa._commits({"commit": "last000"}, {"x": [{"seed": 0}]}) == "`last000`"
