"""A fixed-seed CLI search stopped after its search phase (on the retrain's first step, and one
step into it) and resumed from that checkpoint writes byte-identical ``structure.json`` and
``model.safetensors`` to the same run left uninterrupted (issue 57: the phases as objects
over one run context change nothing a run computes or resumes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dmscale.cli import main

__all__: list[str] = []

ARGS = ["search", "--task", "digits", "--model", "smallcnn", "--model-args", "width=4,blocks=2",
        "--train-limit", "128", "--test-limit", "32", "--batch-size", "64", "--threads", "1", "--quiet",
        "--structure-lr", "0.05", "--epochs", "2", "--retrain-epochs", "1", "--seed", "3"]
OUTPUTS = ("structure.json", "model.safetensors")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """The run, and the global step its search (with the finish) ended at."""
    out = tmp_path_factory.mktemp("full") / "run"
    assert main([*ARGS, "--out", str(out)]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    searched = max(r["global_step"] for r in records if r.get("phase") in ("search", "finish"))
    assert any(r.get("phase") == "retrain" for r in records), "the run has no retraining: nothing is tested"
    return out, searched


@pytest.mark.parametrize("into_retrain", [0, 1])
def test_resumed_after_the_search_equals_the_uninterrupted_run(uninterrupted: tuple[Path, int], tmp_path: Path,
                                                               into_retrain: int) -> None:
    full, searched = uninterrupted
    out = tmp_path / "run"
    assert main([*ARGS, "--out", str(out), "--stop-after", str(searched + into_retrain)]) == 0
    state = json.loads((out / "state.json").read_text())
    assert state["status"] == "stopped" and state["done"] == ["search"]
    assert (out / "checkpoint.pt").is_file() and (out / "structure.json").is_file()
    assert main(["search", "--resume", str(out), "--quiet"]) == 0
    for name in OUTPUTS:
        assert (out / name).read_bytes() == (full / name).read_bytes(), name
    assert json.loads((out / "state.json").read_text())["status"] == "done"
