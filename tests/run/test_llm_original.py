"""Issue 48: every ``hf:`` run evaluates the original model once, before its first step, on the
held-out tokens the found model is evaluated on, and its summary, ``report.md`` and
``summary.json`` say "original -> found" (perplexity and bits per byte)."""

from __future__ import annotations

import json

import pytest

from dmscale.cli import main
from dmscale.config.run_config import load_run_config
from dmscale.run.report import format_summary
from tiny_hf import TEXT_CHARS, make_tiny_hf


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    return make_tiny_hf(tmp_path_factory.mktemp("tiny_hf_original"), TEXT_CHARS)


@pytest.fixture(autouse=True)
def _token_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DMSCALE_CACHE", str(tmp_path / "token-cache"))


COMMON = ["--resource", "params", "--target", "0.8", "--seq-len", "32", "--batch-size", "4",
          "--optimizer", "adamw", "--structure-lr", "0.05", "--threads", "1", "--test-limit", "300"]


@pytest.mark.parametrize("pipeline", ["p", "p-"])
def test_an_hf_run_reports_the_original_and_the_found_model(tiny_hf, tmp_path, capsys, pipeline):
    from dmscale.tasks.hf_model import load_hf_model
    from dmscale.tasks.registry import build_task

    model_dir, data = tiny_hf
    run = tmp_path / "run"
    extra = ["--retrain-epochs", "0.01", "--pretrain-epochs", "0"] if pipeline == "p" else ["--distill-weight", "0"]
    rc = main(["search", "--model", f"hf:{model_dir}", "--task", "text", "--data", str(data),
               "--pipeline", pipeline, "--epochs", "0.02", *extra, "--out", str(run), *COMMON])
    out, err = capsys.readouterr()
    assert rc == 0, err
    summary = json.loads((run / "summary.json").read_text())
    original, final = summary["original"], summary["evals"]["final"]
    # the original is the model as loaded, on the same held-out tokens as the found model
    task = build_task(load_run_config(run))
    direct = task.evaluate(load_hf_model(str(model_dir)))
    assert original["ppl"] == pytest.approx(direct["ppl"], rel=1e-5)
    assert original["bpb"] == pytest.approx(direct["bpb"], rel=1e-5)
    assert original["examples"] == final["examples"] and original["bytes"] == final["bytes"]
    assert original["ppl"] != pytest.approx(final["ppl"], rel=1e-6)  # the search changed the model
    line = (f"original -> found  perplexity {original['ppl']:,.2f} -> {final['ppl']:,.2f}, "
            f"{original['bpb']:.3f} -> {final['bpb']:.3f} bits/byte")
    assert line in out and line in format_summary(summary)
    assert line.replace("found  ", "found: ") in (run / "report.md").read_text()
    # evaluated once, before the first step
    records = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    firsts = [i for i, r in enumerate(records) if r.get("phase") == "original"]
    assert len(firsts) == 1 and records[firsts[0]]["global_step"] == 0
    assert all(r.get("event") == "eval" or r["global_step"] >= 1 for r in records[firsts[0]:])
    assert not any("task_loss" in r for r in records[:firsts[0]])


def test_a_run_of_another_model_has_no_original(tmp_path, capsys):
    run = tmp_path / "run"
    rc = main(["search", "--task", "digits", "--model", "smallcnn", "--model-args", "width=4,blocks=1",
               "--pipeline", "np", "--epochs", "0.05", "--retrain-epochs", "0", "--train-limit", "64",
               "--test-limit", "32", "--batch-size", "32", "--threads", "1", "--quiet", "--out", str(run)])
    assert rc == 0, capsys.readouterr().err
    summary = json.loads((run / "summary.json").read_text())
    assert summary["original"] is None and "original -> found" not in format_summary(summary)
