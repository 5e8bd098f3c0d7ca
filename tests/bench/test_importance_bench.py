"""bench/importance.py (issue 10, the paper's Table 8): each arm really searches with its
metric, and the table pairs every metric with Taylor by seed, checks the reproduction of
np_uniform_w4's rows and keeps its markdown columns intact."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import dmscale as dms

ROOT = Path(__file__).resolve().parents[2]
from bench import importance  # noqa: E402


def _gates(metric: str) -> list:
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3))
    cfg = dms.SearchConfig(target=0.5, **importance.search_overrides(metric))
    searcher = dms.prepare(model, torch.randn(2, 3, 9, 9), cfg)
    return list(searcher.gates.width)


@pytest.mark.parametrize("metric, kind, decay", [("taylor", "taylor", 0.99), ("taylor_step", "taylor", 0.0),
                                                 ("snip", "snip", 0.99), ("fisher", "fisher", 0.99),
                                                 ("index", "index", 0.99)])
def test_each_arm_searches_with_its_metric(metric: str, kind: str, decay: float) -> None:
    gates = _gates(metric)
    assert gates and all(g.metric == kind and g.decay == decay for g in gates)


def test_unknown_metric_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown metric 'grad'"):
        importance.search_overrides("grad")


def _row(metric: str, seed: int, acc: float, structure: str = "4/4 | blocks 1") -> dict:
    return {"metric": metric, "seed": seed, "acc": acc, "acc_search": acc / 2, "search_end": 0.99,
            "exported": 0.995, "search_epochs": 10.0, "retrain_epochs": 20.0, "commit": "abc",
            "structure": structure}


def test_table_pairs_metrics_with_taylor_and_checks_the_reproduction(tmp_path: Path, monkeypatch) -> None:
    ref = {"runs": {"uniform/t0.25/s0/S0.0/R20.0": {"acc": 0.90, "exported": 0.9},
                    "uniform/t0.25/s1/S0.0/R20.0": {"acc": 0.92, "exported": 0.9},
                    "dms@hold/t0.25/s0/S10.0/R20.0": {"acc": 0.95, "structure": "4/4 | blocks 1"},
                    "dms@hold/t0.25/s1/S10.0/R20.0": {"acc": 0.96, "structure": "3/4 | blocks 1"}}}
    (tmp_path / "ref.json").write_text(json.dumps(ref))
    monkeypatch.setattr(importance, "REFERENCE", tmp_path / "ref.json")
    monkeypatch.setattr(importance, "RESULTS", tmp_path)
    rows = [_row("taylor", 0, 0.95), _row("taylor", 1, 0.96), _row("snip", 0, 0.97), _row("snip", 1, 0.97)]
    cache = {"runs": {f"{r['metric']}/s{r['seed']}": r for r in rows}, "last_command": "python bench/importance.py"}
    md = importance.write_table(cache, tmp_path).read_text()
    table = [line for line in md.splitlines() if line.startswith("| ")]
    assert len({line.count("|") for line in table}) == 1  # no label splits a row into extra columns
    snip = next(line for line in table if line.startswith("| SNIP"))
    assert "**97.00 ± 0.00**" in snip and "+1.50 [" in snip and "ahead on 2/2" in snip
    uniform = next(line for line in table if line.startswith("| uniform"))
    assert "-4.50 [" in uniform and "ahead on 0/2" in uniform
    assert "1 of 2 seeds give the same structure and the same top-1" in md  # seed 1's structure differs
    assert (tmp_path / "importance.png").is_file()
