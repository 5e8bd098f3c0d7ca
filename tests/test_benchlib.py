"""bench/benchlib.py: the helpers every results table is written with."""

from __future__ import annotations

import doctest
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import benchlib  # noqa: E402


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
