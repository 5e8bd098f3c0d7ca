"""bench/scaling_claim.py and its table: the cache keys settings share runs by, the bars a
setting is won by, the narrow-width count, the causal-conv MACs the baseline arm checks, and
the table built from a cache (no training)."""

from __future__ import annotations

import dataclasses
import doctest
import sys
from pathlib import Path

import pytest
import torch

from bench.lib import peers_lib  # noqa: E402
from bench import scaling_claim as sc  # noqa: E402
from bench.lib import scaling_claim_settings as scs  # noqa: E402
from bench.lib import scaling_claim_table as st  # noqa: E402


def test_doctests_pass() -> None:
    for module in (scs, st):
        result = doctest.testmod(module)
        assert result.attempted >= 2 and result.failed == 0


def test_settings_share_searches_and_baselines_only_where_the_protocol_agrees() -> None:
    by = {s.name: s for s in sc.SETTINGS}
    w4, r40, s30 = by["digits-w4"], by["digits-w4-R40"], by["digits-w4-S30"]
    params, min3 = by["digits-w4-params"], by["digits-w4-min3"]
    # a longer retrain reuses the searches, not the baselines or the retrained DMS models
    assert sc.search_key(r40, 0) == sc.search_key(w4, 0)
    assert sc.baseline_key(r40, 0) != sc.baseline_key(w4, 0) and sc.dms_key(r40, 0) != sc.dms_key(w4, 0)
    # a longer search or another budget reuses the baselines, never the searches
    for other in (s30, params, min3):
        assert sc.baseline_key(other, 0) == sc.baseline_key(w4, 0)
        assert sc.search_key(other, 0) != sc.search_key(w4, 0)
    assert len({sc.search_key(s, 0) for s in (w4, s30, params, min3)}) == 4
    assert sc.baseline_key(by["digits-w8"], 0) != sc.baseline_key(w4, 0)
    text = [s for s in sc.SETTINGS if s.kind == "text"]
    assert text and sc.search_key(text[0], 1) == sc.search_key(text[-1], 1)
    assert len({s.name for s in sc.SETTINGS}) == len(sc.SETTINGS)


def test_verdict_needs_both_the_bar_and_the_interval() -> None:
    assert st.verdict("image", [0.3, 0.4, 0.35, 0.3]) == "won"
    assert st.verdict("image", [0.2, 0.25, 0.2, 0.25]) == "tie"  # resolved, under the bar
    assert st.verdict("image", [2.0, -1.0, 1.5, -0.5]) == "tie"  # over the bar, interval spans 0
    assert st.verdict("image", [0.5]) == "tie"  # one seed: no interval
    # text: lower is better, the bar is relative
    assert st.verdict("text", [-1.2, -1.1, -1.3]) == "won"
    assert st.verdict("text", [-0.5, -0.6, -0.4]) == "tie"
    assert st.verdict("text", [1.2, 1.1, 1.3]) == "lost"
    assert st.differences("text", [{"seed": 1, "bpc": 2.0}, {"seed": 0, "bpc": 4.0}],
                          [{"seed": 0, "bpc": 3.0}, {"seed": 1, "bpc": 2.0}, {"seed": 2, "bpc": 1.0}]) == [-25.0, 0.0]


def test_narrow_dims_counts_only_dims_in_the_export() -> None:
    structure = {"width": [{"size": 8, "kept": 1, "producers": ["s.0.conv1"]},
                           {"size": 8, "kept": 2, "producers": ["s.1.conv1"]},
                           {"size": 8, "kept": 3, "producers": ["s.2.conv1"]},
                           {"size": 8, "kept": 2, "producers": ["stem", "s.1.conv2"]}],
                 "depth": [{"blocks": ["s.0", "s.1", "s.2"], "kept": ["s.0", "s.2"]}],
                 "removed_blocks": [{"name": "s.1"}]}
    assert sc.narrow_dims(structure) == 2  # s.1's own dim is gone; the shared one stays
    assert sc.narrow_dims(structure, at_most=3) == 3


def test_fast_macs_counts_causal_convolutions_like_the_exact_counter() -> None:
    from dmscale.tasks.language import CharCNN

    model = CharCNN(vocab_size=11, width=6, hidden=10, blocks=2)
    ids = torch.randint(0, 11, (1, 16))
    assert peers_lib.fast_macs(model, ids) == peers_lib.macs(model, ids) > 0


def _row(seed: int, acc: float, **kw: object) -> dict:
    return {"seed": seed, "acc": acc, "macs": 100, "base_macs": 100, "params": 80, "base_params": 100,
            "structure": "2/3 | blocks 1", "narrow": 1, **kw}


def test_table_from_a_cache_reports_every_setting_and_keeps_the_reading(tmp_path: Path) -> None:
    s = next(x for x in sc.SETTINGS if x.name == "digits-w4")
    runs = {}
    for seed, (b, d) in enumerate([(0.95, 0.96), (0.96, 0.965), (0.94, 0.95)]):
        runs[sc.baseline_key(s, seed)] = _row(seed, b)
        runs[sc.dms_key(s, seed)] = _row(seed, d)
        runs[sc.search_key(s, seed)] = {"seed": seed, "supernet_macs": 460, "search_end": 1.0}
    md = tmp_path / "scaling_claim.md"
    md.write_text("stale table\n\n## Reading\n\nkept words\n")
    text = st.write_table({"runs": runs}, sc.SETTINGS, md).read_text()
    line = next(x for x in text.splitlines() if x.startswith("| digits-w4 |"))
    assert "4.60 x" in line and "3 of 20" in line and "+0.83 [" in line and "pending (3 of 20)" in line
    assert "| digits-w8 |" in text  # a setting with no runs yet still has its row
    assert text.rstrip().endswith("kept words") and "stale table" not in text
    assert "| 1 | 96.00 | 96.50 | +0.50 pt |" in text
    # with every planned seed in, the verdict stands
    done = dataclasses.replace(s, seeds=(0, 1, 2))
    line = next(x for x in st.write_table({"runs": runs}, (done,), md).read_text().splitlines()
                if x.startswith("| digits-w4 |"))
    assert "**won**" in line and "pending" not in line


@pytest.mark.parametrize("kind", ["image", "text"])
def test_every_setting_is_one_of_the_two_kinds(kind: str) -> None:
    assert any(s.kind == kind for s in sc.SETTINGS)
    assert all(s.kind in ("image", "text") and s.budgets[0] == "macs" for s in sc.SETTINGS)
