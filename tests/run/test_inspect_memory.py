"""``dmscale inspect --memory``: the per-rank memory of a search before launching it
(src/dmscale/run/inspect_memory.py; the estimate itself is tested in tests/engine/test_memory.py)."""

from __future__ import annotations

import json

from dmscale.cli import main

TINY = ["--task", "digits", "--model", "smallcnn", "--model-args", "width=4,blocks=1",
        "--train-limit", "64", "--test-limit", "32"]


def test_inspect_memory_prints_and_writes_the_estimate_per_rank(tmp_path, capsys):
    args = ["inspect", *TINY, "--memory", "--batch-size", "32", "--optimizer", "adamw", "--precision", "bf16"]
    assert main([*args, "--out", str(tmp_path / "one.json")]) == 0
    assert main([*args, "--world-size", "4", "--shard", "fsdp", "--out", str(tmp_path / "four.json")]) == 0
    text = capsys.readouterr().out
    one, four = (json.loads((tmp_path / f).read_text()) for f in ("one.json", "four.json"))
    assert one["optimizer_state"] == 2 * one["weights"] and one["world_size"] == 1
    assert four["weights"] == -(-one["weights"] // 4) and four["shard"] == "fsdp"
    assert four["activations"] < one["activations"]  # a quarter of the batch per rank
    assert "total (peak)" in text and "FSDP gathered" in text and not (tmp_path / "runs").exists()


def test_inspect_memory_counts_a_frozen_search_and_refuses_more_ranks_than_examples(capsys):
    assert main(["inspect", *TINY, "--memory", "--pipeline", "p-", "--batch-size", "8", "--out", "/dev/null"]) == 0
    assert "none (frozen weights)" in capsys.readouterr().out
    assert main(["inspect", *TINY, "--memory", "--batch-size", "2", "--world-size", "4"]) == 2
    assert "expected at least one example per rank" in capsys.readouterr().err
