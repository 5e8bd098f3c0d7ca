"""bench/RESULTS.md is generated: ``python -m bench.lib.results_doc`` writes exactly the committed
file from bench/results, a number changed in a cached md or json makes its check fail (naming
the line), no number outside the copied tables and the ``num:`` spans, and every link resolves."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"


@pytest.fixture(scope="module")
def rd():
    pytest.importorskip("scipy")  # benchlib.paired_ci, behind the spans
    from bench.lib import results_doc

    return results_doc


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """bench/results without its plots: what the generator reads."""
    out = tmp_path / "results"
    shutil.copytree(RESULTS, out, ignore=shutil.ignore_patterns("*.png"))
    return out


def _line(text: str, needle: str) -> int:
    return text[:text.index(needle)].count("\n") + 1


def test_the_committed_file_is_what_the_generator_writes(rd, capsys) -> None:
    assert rd.check(ROOT / rd.OUT) is None
    assert (ROOT / rd.OUT).read_text(encoding="utf-8") == rd.generate()
    assert rd.main(["--check"]) == 0
    assert "is what its generator writes" in capsys.readouterr().out


def test_a_number_changed_in_a_cached_md_fails_the_check(rd, copy: Path) -> None:
    md = copy / "gates.md"
    text = md.read_text(encoding="utf-8")
    assert "| MES | 59.72 ± 8.30 |" in text
    md.write_text(text.replace("| MES | 59.72 ± 8.30 |", "| MES | 59.73 ± 8.30 |", 1), encoding="utf-8")
    bad = rd.check(ROOT / rd.OUT, results=copy)
    committed = (ROOT / rd.OUT).read_text(encoding="utf-8")
    assert bad is not None and bad.startswith(f"{rd.OUT}:{_line(committed, '| MES | 59.72 ± 8.30 |')}: ")
    assert "59.72" in bad and "59.73" in bad and "--write" in bad


def test_a_number_changed_in_a_json_cache_fails_the_check(rd, copy: Path) -> None:
    """The spans are computed from the json caches, so one accuracy changed in peers.json shows."""
    path = copy / "peers.json"
    cache = json.loads(path.read_text())
    row = cache["runs"]["t0.25-pre10.0-s2.0-ft4.0-settle0.4"]["0"]["dms_p"]
    row["acc"] -= 0.05
    path.write_text(json.dumps(cache))
    bad = rd.check(ROOT / rd.OUT, results=copy)
    committed = (ROOT / rd.OUT).read_text(encoding="utf-8")
    assert bad is not None and bad.startswith(f"{rd.OUT}:{_line(committed, '<!-- num:peers.default -->')}: ")
    assert rd.check(ROOT / rd.OUT) is None  # the real caches are read again afterwards


def test_a_section_whose_tables_are_gone_names_the_fix(rd, copy: Path) -> None:
    (copy / "schedule.md").write_text("# no table\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"schedule.md: expected tables \(0,\), found 0 tables; fix the Include"):
        rd.generate(copy)


def test_no_number_outside_the_copied_tables_and_the_spans(rd) -> None:
    assert rd.stray_numbers((ROOT / rd.OUT).read_text(encoding="utf-8")) == []
    prose = "a 3.5 b\n| x | 12 |\n`1` [t2](x1) ResNet-20 <!-- num:k -->4<!-- /num -->\n## Table 7\n"
    assert rd.stray_numbers(prose) == [(1, "3.5"), (2, "12")]  # the check can fail


def test_every_copied_table_is_its_md_and_every_link_resolves(rd) -> None:
    text = (ROOT / rd.OUT).read_text(encoding="utf-8")
    blocks = re.findall(r"<!-- from: results/(\S+), table (\d+) -->\n\n.*?\n\n(\|.*?)\n\n<!-- /from -->", text, re.S)
    assert len(blocks) == text.count("<!-- from: ")
    for md, n, table in blocks:
        assert table == rd.tables((RESULTS / md).read_text(encoding="utf-8"))[int(n) - 1][1]
    headings = {rd.anchor(h) for h in re.findall(r"^## (.*)$", text, re.M)}
    for target in re.findall(r"\]\(([^)]+)\)", text):
        if target.startswith("#"):
            assert target[1:] in headings, target
        else:
            assert (ROOT / "bench" / target).exists(), target
    for s in rd.SECTIONS:
        assert f"## {s.heading}\n" in text and (RESULTS / f"{s.stem}_results_reading.md").is_file()


def test_the_readings_moved_out_of_results_md_keep_their_links(rd) -> None:
    readings = sorted(RESULTS.glob("*_results_reading.md"))
    assert len(readings) == len(rd.SECTIONS) + 1  # and the preamble's
    for path in readings:
        for target in re.findall(r"\]\(([^)#\s]+)\)", path.read_text(encoding="utf-8")):
            assert (path.parent / target).exists(), f"{path.name}: {target}"
