"""``python -m bench``: the table registry and its entry point. ``table peers`` rewrites
``peers.md`` byte for byte from ``peers.json`` (on a copy of the bench), and ``--check`` fails
once a cached number is altered."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.lib.tables import TABLES, table

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"


def test_every_table_names_a_script_and_its_files() -> None:
    for t in TABLES.values():
        assert importlib.util.find_spec(t.module) is not None, t
        assert t.outputs and t.question, t
        for f in t.caches + t.outputs:
            assert (RESULTS / f).exists(), f"{t.name}: no bench/results/{f}"
    with pytest.raises(KeyError, match="python -m bench list"):
        table("no_such_table")


def _bench(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench", *cmd], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT / "src"), **(env or {})})


def test_list_shows_every_table() -> None:
    done = _bench(["list"], ROOT)
    assert done.returncode == 0, done.stderr
    for t in TABLES.values():
        assert f"python -m {t.module}" in done.stdout and t.name in done.stdout


@pytest.fixture()
def copy(tmp_path: Path) -> Path:
    """The bench's code and the peers table's files, in a scratch root."""
    shutil.copytree(ROOT / "bench", tmp_path / "bench", ignore=lambda d, names: [
        n for n in names if n in ("__pycache__", "results", "runs", "_baseline")])
    (tmp_path / "bench" / "results").mkdir()
    for name in ("peers.json", "peers.md", "peers_reading.md"):
        shutil.copy(RESULTS / name, tmp_path / "bench" / "results" / name)
    return tmp_path


def test_table_peers_rewrites_its_md_byte_for_byte(copy: Path) -> None:
    md = copy / "bench" / "results" / "peers.md"
    md.write_text("stale\n")
    done = _bench(["table", "peers"], copy)
    assert done.returncode == 0, done.stderr
    assert md.read_bytes() == (RESULTS / "peers.md").read_bytes()
    assert _bench(["table", "peers", "--check"], copy).returncode == 0


def test_check_fails_when_a_cached_number_is_altered(copy: Path) -> None:
    cache = copy / "bench" / "results" / "peers.json"
    data = json.loads(cache.read_text())
    setting = next(iter(data["runs"]))
    row = data["runs"][setting]["0"]["dms_p"]
    row["acc"] = row["acc"] - 0.1
    cache.write_text(json.dumps(data))
    done = _bench(["table", "peers", "--check"], copy)
    assert done.returncode == 1 and "peers.md" in done.stderr, done.stderr
    # --check leaves the committed table as it was
    assert (copy / "bench" / "results" / "peers.md").read_bytes() == (RESULTS / "peers.md").read_bytes()


def test_table_only_keeps_the_machine_its_runs_ran_on(copy: Path) -> None:
    """``--table-only`` wrote this machine's name over the cache's: a table rebuilt elsewhere
    named the wrong machine (and was not the committed one)."""
    cache = copy / "bench" / "results" / "peers.json"
    data = json.loads(cache.read_text())
    data["machine"] = "the machine the runs ran on"
    cache.write_text(json.dumps(data))
    assert _bench(["table", "peers"], copy).returncode == 0
    assert "- machine: the machine the runs ran on\n" in (copy / "bench" / "results" / "peers.md").read_text()


def test_a_table_without_a_cache_is_refused() -> None:
    done = _bench(["table", "latency"], ROOT)
    assert done.returncode != 0 and "no cache" in done.stderr



def test_every_table_is_what_its_cache_gives(tmp_path: Path) -> None:
    """``python -m bench check`` on a copy of the bench: every committed md with a cache is what
    its script writes from it; an altered cached number makes it fail, naming the table."""
    shutil.copytree(ROOT / "bench", tmp_path / "bench", ignore=lambda d, names: [
        n for n in names if n in ("__pycache__", "runs", "_baseline")])
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")])}
    done = _bench(["check"], tmp_path, env)
    assert done.returncode == 0 and "0 of" in done.stdout, done.stdout + done.stderr[-2000:]
    cache = tmp_path / "bench" / "results" / "budget.json"
    cache.write_text(cache.read_text().replace('"acc": 0.', '"acc": 0.0', 1))
    done = _bench(["check", "budget", "peers"], tmp_path, env)
    assert done.returncode == 1 and "1 of 2 tables" in done.stdout and ": budget" in done.stdout, done.stdout
