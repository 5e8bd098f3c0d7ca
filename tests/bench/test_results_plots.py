"""Every plot of ``bench/results_plots.py`` draws a file from its committed json cache.

A plot function that forgot to save (and returned None) left its committed png stale while
``python bench/results_plots.py`` printed "wrote None".
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[2]
from bench import results_plots  # noqa: E402


@pytest.mark.parametrize("name", sorted(results_plots.PLOTS))
def test_plot_writes_its_png_from_the_committed_cache(name: str, tmp_path: Path) -> None:
    cache = results_plots.RESULTS / f"{name}.json"
    if not cache.exists():
        pytest.skip(f"no committed cache {cache.name}")
    out = tmp_path / f"{name}.png"
    written = results_plots.PLOTS[name](json.loads(cache.read_text()), out)
    assert written == out
    assert out.stat().st_size > 1000, f"{name}: {out} is empty"
