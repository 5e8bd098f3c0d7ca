"""``src/`` says what the code does and why; what was measured lives in ``bench/results``.
No module of the package cites a benchmark file or quotes a measured result (seed counts,
intervals, p-values, "measured: ..."): such text goes stale the day a table is rerun."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "dmscale"

# a benchmark's file, a results table, a measurement quoted as a figure
MEASURED = re.compile(
    r"bench/|RESULTS\.md|\(measured[:,]|measured: |\b\d+ of \d+ (?:seeds|searches|runs)\b"
    r"|[+-]\d+\.\d+ \[-?\d+\.\d+, ?-?\d+\.\d+\]|\bp = 0\.\d|\b\d+ seeds\b")


def measured_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line of ``text`` that cites a benchmark or a measured figure."""
    return [(i, line.strip()) for i, line in enumerate(text.splitlines(), 1) if MEASURED.search(line)]


def test_no_module_cites_a_benchmark_or_a_measured_figure():
    found = {str(p.relative_to(PACKAGE)): hits for p in sorted(PACKAGE.rglob("*.py"))
             if (hits := measured_lines(p.read_text(encoding="utf-8")))}
    assert found == {}, ("numbers belong in bench/results; the docstring says what and why: "
                         + "; ".join(f"{m}:{i}: {line}" for m, hits in found.items() for i, line in hits))


@pytest.mark.parametrize("line", [
    "    measured in ``bench/results/budget.md``, the loss alone",
    "# (measured: DMS_p- on frozen weights stayed at 1.1-1.2 x target)",
    "    every search lands in the band (40 of 40 searches, against 38)",
    "    +0.49 [0.08, 0.90] over uniform, p = 0.02",
])
def test_the_check_finds_each_kind_of_citation(line: str):
    assert measured_lines(f"def f():\n{line}\n") == [(2, line.strip())]
