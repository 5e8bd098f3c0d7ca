"""Regression (issue 55): ``--pipeline p- --search-dims depth`` on an ``hf:`` model crashed with
"element 0 of tensors does not require grad" once the settle phase froze depth, the only thing
a p- search with frozen weights trains; such a step now trains nothing and the run finishes."""

from __future__ import annotations

import json

from dmscale.cli import main
from tiny_hf import make_tiny_hf


def test_a_depth_only_pminus_search_finishes(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DMSCALE_CACHE", str(tmp_path / "token-cache"))
    model_dir, data = make_tiny_hf(tmp_path, 20_000)
    run = tmp_path / "run"
    rc = main(["search", "--model", f"hf:{model_dir}", "--task", "text", "--data", str(data), "--pipeline", "p-",
               "--search-dims", "depth", "--resource", "params", "--target", "0.75", "--epochs", "0.05",
               "--seq-len", "32", "--batch-size", "4", "--distill-weight", "0", "--threads", "1",
               "--out", str(run), "--quiet"])
    assert rc == 0, capsys.readouterr().err
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resources"]["hard"] <= summary["resources"]["target"]
    assert summary["structure"]["depth"][0][2] < summary["structure"]["depth"][0][1]  # a layer went
