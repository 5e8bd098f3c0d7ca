"""The result numbers of README.md, docs/, bench/RESULTS.md and the readings in bench/results are the caches' numbers:
``scripts/doc_numbers.py --check`` finds no marked span whose text differs from what
bench/results gives, and a number altered by hand is reported (file, line, key, both texts)
and put back by ``--write``."""

from __future__ import annotations

import importlib.util
import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dn():
    pytest.importorskip("scipy")  # benchlib.paired_ci
    spec = importlib.util.spec_from_file_location("doc_numbers", ROOT / "scripts" / "doc_numbers.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["doc_numbers"] = module
    spec.loader.exec_module(module)
    return module


def test_the_documents_agree_with_the_caches(dn) -> None:
    bad = dn.check()
    assert not bad, "documents disagree with bench/results (python scripts/doc_numbers.py --write):\n" + \
        "\n".join(map(str, bad))


def test_every_number_is_shown_and_every_span_has_a_number(dn) -> None:
    used = {key for doc in dn.documents() for key, _, _ in dn.spans(doc.read_text(encoding="utf-8"))}
    assert used <= set(dn.NUMBERS)
    assert set(dn.NUMBERS) <= used, f"keys no document shows: {sorted(set(dn.NUMBERS) - used)}"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert {"default_run.where", "default_run.table", "peers.w8.t0.25"} <= {k for k, _, _ in dn.spans(readme)}


def _copy(tmp_path: Path, name: str) -> Path:
    out = tmp_path / name
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / name, out)
    return out


def _alter(text: str, key: str) -> tuple[str, str]:
    """``text`` with the first digit of span ``key`` changed; and the altered span's text."""
    m = next(m for m in re.finditer(r"<!-- num:(?P<key>[\w.@-]+) -->(?P<text>.*?)<!-- /num -->", text, re.S)
             if m["key"] == key)
    body = m["text"]
    i = next(i for i, ch in enumerate(body) if ch.isdigit())
    new = body[:i] + str((int(body[i]) + 1) % 10) + body[i + 1:]
    return text[:m.start("text")] + new + text[m.end("text"):], new


@pytest.mark.parametrize("name, key", [("README.md", "peers.w8.t0.25"), ("README.md", "default_run.table"),
                                       ("docs/benchmarks.md", "llm5.t0.8.headline"),
                                       ("docs/gpus.md", "gpu.cost"), ("docs/deploy.md", "deploy.cuda.compiled"),
                                       ("bench/RESULTS.md", "llm5.band"), ("bench/RESULTS.md", "results.machines"),
                                       ("bench/results/llm_table5_results_reading.md", "llm5.band")])
def test_an_altered_number_is_reported_and_written_back(dn, tmp_path: Path, name: str, key: str) -> None:
    doc = _copy(tmp_path, name)
    original = doc.read_text(encoding="utf-8")
    altered, span = _alter(original, key)
    doc.write_text(altered, encoding="utf-8")
    bad = dn.check([doc], root=tmp_path)
    assert [(d.file, d.key) for d in bad] == [(name, key)]
    line = original.count("\n", 0, original.index(f"<!-- num:{key} -->")) + 1
    assert bad[0].line == line
    assert bad[0].cache == dn.value(key) and bad[0].document != bad[0].cache
    assert " ".join(span.split()) == " ".join(bad[0].document.split())
    assert str(bad[0]).startswith(f"{name}:{line}: {key}: document ")
    assert dn.write([doc], root=tmp_path) == [doc]
    assert doc.read_text(encoding="utf-8") == original
    assert dn.check([doc], root=tmp_path) == []


def test_an_unknown_key_and_the_command_line(dn, tmp_path: Path, capsys) -> None:
    doc = tmp_path / "x.md"
    doc.write_text("a <!-- num:no.such.key -->1.0<!-- /num --> b\n", encoding="utf-8")
    bad = dn.check([doc], root=tmp_path)
    assert len(bad) == 1 and bad[0].key == "no.such.key" and "no number" in bad[0].cache
    assert dn.main(["--check", str(doc)]) == 1
    assert "no.such.key" in capsys.readouterr().out
    assert dn.write([doc], root=tmp_path) == []  # nothing to write it from: left as it is
    doc.write_text("a <!-- num:gates.hold -->1.0 b <!-- num:gates.settle -->2.0<!-- /num -->\n", encoding="utf-8")
    bad = dn.check([doc], root=tmp_path)
    assert len(bad) == 1 and bad[0].key == "gates.hold" and "unclosed" in bad[0].cache
    assert dn.write([doc], root=tmp_path) == []


def test_the_latency_target_count_comes_from_the_band(dn) -> None:
    """"N of M" counts the exports inside the band, so one that misses it shows."""
    rows = [dict(r) for r in dn.cache("latency_target")["rows"].values()]
    text = dn.latency_target_text(rows)
    n = sum(k.startswith("latency") for r in rows for k in r["arms"])
    assert text.startswith(f"{n} of {n} exports within 10 % of half")
    far = {**rows[0]["arms"]["latency0"], "ratio": 0.5 * (1 + 2 * dn.LATENCY_BAND)}  # 20 % over the target
    rows[0] = {**rows[0], "arms": {**rows[0]["arms"], "latency0": far}}
    missed = dn.latency_target_text(rows)
    assert missed.startswith(f"{n - 1} of {n} exports within 10 % of half")
    assert "x the original's time" in missed and "0.60x" in missed  # the range shows the miss too
    edge = {**far, "ratio": 0.5 * (1 - dn.LATENCY_BAND)}  # on the band's edge: inside
    rows[0]["arms"]["latency0"] = edge
    assert dn.latency_target_text(rows).startswith(f"{n} of {n} ")


def test_the_gpu_step_line_counts_the_models_over_the_goal(dn) -> None:
    now = dn.value("gpu.step.readme")
    assert "on the SmolLM2-shaped Llama" in now and "goal" in now
    assert dn.gpu_step_text({"resnet50": 1.1, "vit_b16": 1.2, "llama_135m": 1.0}).endswith(
        "all 3 within the 1.2x goal")
    assert dn.gpu_step_text({"resnet50": 1.1, "vit_b16": 2.47, "llama_135m": 1.0}).endswith(
        "1 of 3 over the 1.2x goal")


def test_the_readings_are_documents_and_the_caches_can_be_read_from_a_copy(dn, tmp_path: Path) -> None:
    """The hand-written readings in bench/results are checked like the documents; ``use_results``
    points every key at a copy of the caches (the check of bench/lib/results_doc.py reads one)."""
    names = {p.relative_to(ROOT).as_posix() for p in dn.documents()}
    assert {"bench/RESULTS.md", "bench/results/llm_table5_results_reading.md"} <= names
    shutil.copy(ROOT / "bench" / "results" / "default_run.json", tmp_path / "default_run.json")
    before = dn.use_results(tmp_path)
    try:
        assert dn.value("results.machines") == "2 CPUs (x86_64), torch 2.13.0+cpu (1 row)"
    finally:
        dn.use_results(before)
    assert dn.value("results.machines").startswith("2 CPUs (x86_64), torch 2.13.0+cpu (")
    assert dn.value("results.machines") != "2 CPUs (x86_64), torch 2.13.0+cpu (1 row)"
