"""bench/lib/benchlib.py: the helpers every results table is written with."""

from __future__ import annotations

import doctest
import math
import os
import sys
from pathlib import Path

import pytest

from bench.lib import benchlib  # noqa: E402


def test_doctests_pass() -> None:
    result = doctest.testmod(benchlib)
    assert result.attempted >= 6 and result.failed == 0


def test_paired_ci_matches_the_t_interval_by_hand() -> None:
    diffs = [0.56, -0.28, 1.11, 0.84, 0.0, 0.28]
    mean, low, high, p = benchlib.paired_ci(diffs)
    n = len(diffs)
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    half = 2.570582 * sd / math.sqrt(n)  # t_{0.975, 5}
    assert mean == pytest.approx(sum(diffs) / n)
    assert (low, high) == pytest.approx((mean - half, mean + half), abs=1e-5)
    assert 0.0 < p < 1.0
    # a wider level gives a wider interval around the same mean
    _, low99, high99, _ = benchlib.paired_ci(diffs, level=0.99)
    assert low99 < low and high99 > high


def test_paired_ci_without_spread_and_without_data() -> None:
    mean, low, high, p = benchlib.paired_ci([0.5, 0.5])
    assert (mean, low, high) == (0.5, 0.5, 0.5) and math.isnan(p)
    with pytest.raises(ValueError, match="no paired differences"):
        benchlib.paired_ci([])


def _store_seeds(path: str, first: int, n: int, start: float) -> None:
    """One invocation's stores: seeds ``first .. first + n - 1`` of one key, one write each,
    from ``start`` (a wall time: both processes begin together)."""
    import time

    time.sleep(max(0.0, start - time.time()))
    for seed in range(first, first + n):
        mine = {"runs": {"k": {str(seed): {"acc": seed}}}, "settings": {"k": {}}, "info": {"k": {}}, "machine": "m"}
        benchlib.save_merged(Path(path), mine, "k", [seed])


def test_concurrent_invocations_lose_no_rows(tmp_path: Path) -> None:
    """Two processes adding seeds to one cache at the same time (the way the tables are run:
    one invocation per seed range) keep every row: the read-modify-write is under a lock and
    the write is atomic (a reader never sees half a file). Before, rows were lost."""
    import multiprocessing

    import time

    path = tmp_path / "c.json"  # a cache of a realistic size: each read and write takes a while
    benchlib.save_cache(path, {"runs": {"other": {str(i): {"structure": "8/" * 200} for i in range(300)}}})
    ctx = multiprocessing.get_context("spawn")
    start = time.time() + 3.0
    procs = [ctx.Process(target=_store_seeds, args=(str(path), first, 40, start)) for first in (0, 1000)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    runs = benchlib.load_cache(path)["runs"]["k"]
    assert sorted(map(int, runs)) == list(range(40)) + list(range(1000, 1040))


def test_a_rerun_that_completes_a_cut_off_invocation_is_named_once() -> None:
    info: dict = {}
    benchlib.record_invocation(info, "k", "python b.py --seeds 0 1", "aaa", [0])
    benchlib.record_invocation(info, "k", "python b.py --seeds 0 1", "aaa", [1])
    benchlib.record_invocation(info, "k", "python b.py --seeds 2", "bbb", [2])
    assert benchlib.invocations_text(info["k"]) == (
        "`python b.py --seeds 0 1` (commit `aaa`), `python b.py --seeds 2` (commit `bbb`)")
    assert len(info["k"]["earlier"]) == 2  # the record keeps every invocation


def test_child_json_returns_the_last_line_and_a_failure_carries_its_error_output(tmp_path):
    from bench.lib.benchlib import child_json, snapshot_commit

    (tmp_path / "src").mkdir()
    script = tmp_path / "src" / "child_mod.py"  # run as ``python -m child_mod`` with src on PYTHONPATH
    script.write_text("import json, os, sys\nprint('progress')\n"
                      "if sys.argv[1] == 'fail': sys.exit('no such model')\n"
                      "print(json.dumps({'arg': sys.argv[1], 'path': os.environ['PYTHONPATH']}))\n")
    out = child_json("child_mod", ["x"], [tmp_path / "src", tmp_path / "tests"])
    assert out == {"arg": "x", "path": os.pathsep.join([str(tmp_path / "src"), str(tmp_path / "tests")])}
    with pytest.raises(RuntimeError, match="no such model"):
        child_json("child_mod", ["fail"], [tmp_path / "src"])
    assert snapshot_commit(tmp_path / "src") == "?"
    (tmp_path / "COMMIT").write_text("340ec91143e7\n")
    assert snapshot_commit(tmp_path / "src") == "340ec91"
