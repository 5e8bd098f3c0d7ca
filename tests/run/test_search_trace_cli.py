"""From the command line: ``dmscale search`` writes the search trace and the report names the
residual streams; ``dmscale inspect RUN --search-trace`` prints it; ``--keep-width residual``
holds the streams whole. On the project's ResNet-20 (width 4) on the digits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dmscale.cli import main
from dmscale.search.search_trace import TRACE_FILE, read_trace

SEARCH = ["search", "--task", "digits", "--model", "resnet", "--model-args", "width=4", "--train-limit", "256",
          "--test-limit", "64", "--batch-size", "32", "--epochs", "1", "--retrain-epochs", "0.25", "--target", "0.5", "--quiet",
          "--threads", "1"]


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("traced") / "run"
    assert main([*SEARCH, "--out", str(out)]) == 0
    return out


def test_search_writes_the_trace_and_the_report_names_the_streams(traced: Path):
    dims, records = read_trace(traced)
    labels = {d["name"]: d["label"] for d in dims}
    assert labels["layer3.0.conv2"] == "layer3 residual stream, 3 blocks"
    assert labels["layer3.1.conv1"] == "layer3.1.conv1"
    assert {r["phase"] for r in records} >= {"search"}
    assert all(len(r["grad_task"]) == len(dims) for r in records)
    report = (traced / "report.md").read_text()
    assert "| layer3 residual stream, 3 blocks | `layer3.0.conv2` and 3 more | 16 |" in report
    assert (traced / "plots" / "search_trace.png").is_file() and "plots/search_trace.png" in report


def test_inspect_prints_the_trace_and_writes_it_as_json(traced: Path, tmp_path: Path, capsys):
    assert main(["inspect", str(traced), "--search-trace", "--out", str(tmp_path / "t.json")]) == 0
    text = capsys.readouterr().out
    assert "layer3 residual stream, 3 blocks" in text and "cost/elem" in text
    rows = json.loads((tmp_path / "t.json").read_text())
    stream = next(r for r in rows if r["name"] == "layer3.0.conv2")
    assert stream["layers"] == 4 and stream["size"] == 16 and stream["kept_first"] >= stream["kept_last"]


def test_inspect_search_trace_refuses_a_directory_that_is_no_run(tmp_path: Path, capsys):
    assert main(["inspect", str(tmp_path), "--search-trace"]) == 2
    assert "not a dmscale run directory" in capsys.readouterr().err
    assert main(["inspect", "--search-trace"]) == 2
    assert "needs RUN" in capsys.readouterr().err


def test_the_trace_changes_no_byte_of_the_search(traced: Path, tmp_path: Path):
    plain = tmp_path / "plain"
    assert main([*SEARCH, "--out", str(plain), "--no-search-trace"]) == 0
    assert not (plain / TRACE_FILE).exists()
    for name in ("structure.json", "model.safetensors"):
        assert (plain / name).read_bytes() == (traced / name).read_bytes(), name


def test_keep_width_residual_holds_every_stream_whole(tmp_path: Path):
    out = tmp_path / "held"
    assert main([*SEARCH, "--out", str(out), "--keep-width", "residual"]) == 0
    width = {w["name"]: (w["kept"], w["size"]) for w in json.loads((out / "structure.json").read_text())["width"]}
    assert width["conv1"] == (4, 4) and width["layer2.0.conv2"] == (8, 8) and width["layer3.0.conv2"] == (16, 16)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resources"]["hard"] <= summary["resources"]["target"] * (1 + 1e-9)


def test_inspect_names_the_residual_streams_of_the_search_space(tmp_path: Path, capsys):
    assert main(["inspect", "--task", "digits", "--model", "resnet", "--model-args", "width=4",
                 "--out", str(tmp_path / "space.json")]) == 0
    text = capsys.readouterr().out
    assert "4 layer(s) (layer3 residual stream, 3 blocks)" in text
    space = json.loads((tmp_path / "space.json").read_text())
    labels = {d["name"]: d["label"] for d in space["width"]}
    assert labels["layer2.0.conv2"] == "layer2 residual stream, 3 blocks" and labels["layer2.1.conv1"] == "layer2.1.conv1"
