"""Watching a run (dmscale.run.watching): the best weights and what the run exports.

* ``dmscale search --task digits --eval-every 2``: the retraining keeps its best weights in
  ``best.safetensors``, which loads into the found model; ``summary.json``, the printed
  summary and ``report.md`` name what ``model.safetensors`` holds (the final weights) and the
  best (phase, step, metric);
* ``--export-best``: ``model.safetensors`` holds the best evaluation's weights and the
  summary says so; with a final evaluation that ties the best, the final weights;
* a run killed after its last checkpoint (before or after the best was kept) and resumed
  evaluates at the same steps and keeps the same best as an uninterrupted run;
* a search without retraining keeps no best and says why; ``--export-best`` without a phase
  that keeps a best, or without ``--eval-every``, is a one-line error; ``--eval-every`` cannot
  change on resume.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from dmscale.cli import main
from dmscale.config.run_config import ConfigError, RunConfig
from dmscale.engine.evaluation import BEST_FILE, read_best
from dmscale.engine.rundir import RunDir, Stopped
from dmscale.run.pipeline import Pipeline, load_run_model
from dmscale.run.report import format_summary
from dmscale.tasks.image import ClassificationTask

__all__: list[str] = []

ARGS = ["search", "--task", "digits", "--model", "smallcnn", "--model-args", "width=4,blocks=2",
        "--train-limit", "256", "--test-limit", "64", "--batch-size", "64", "--threads", "1",
        "--structure-lr", "0.05", "--epochs", "3", "--retrain-epochs", "2", "--seed", "0"]
TINY = dict(task="digits", model="smallcnn", model_args={"width": 4, "blocks": 2}, train_limit=256,
            test_limit=64, batch_size=64, threads=1, quiet=True, structure_lr=0.05, epochs=3,
            retrain_epochs=2, eval_every=2, checkpoint_every=3)  # search 12 steps, retrain 8


def _cfg(out: Path, **kw: Any) -> RunConfig:
    return RunConfig(**{**TINY, "out": str(out), **kw})  # type: ignore[arg-type]


def _records(run: Path, event: str) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "time"} for r in rows if r.get("event") == event]


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_digits_search_keeps_the_best_retrained_weights_and_the_summary_names_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    assert main([*ARGS, "--eval-every", "2", "--out", str(run)]) == 0
    printed = capsys.readouterr().out
    summary = json.loads((run / "summary.json").read_text())
    evals = {r["step"]: r for r in _records(run, "eval") if r["phase"] == "retrain"}
    assert sorted(evals) == [2, 4, 6, 8]
    best = summary["best"]
    expected = None  # strictly better replaces it; the phase's last evaluation also on a tie
    for s in sorted(evals):
        if expected is None or evals[s]["acc"] > evals[expected]["acc"] or (
                s == 8 and evals[s]["acc"] == evals[expected]["acc"]):
            expected = s
    assert (best["phase"], best["metric"], best["step"]) == ("retrain", "acc", expected)
    assert best["value"] == evals[expected]["acc"]
    assert read_best(run / BEST_FILE) == {k: best[k] for k in ("phase", "step", "global_step", "metric", "value")}
    # without --export-best the run exports its final weights, and says so
    assert summary["exported"] == {"checkpoint": "final", "phase": "retrain", "step": 8,
                                   "global_step": evals[8]["global_step"], "metric": "acc",
                                   "value": evals[8]["acc"], "file": "model.safetensors", "best_kept": True}
    # best.safetensors loads into the found model (structure.json) and computes its accuracy
    model, cfg = load_run_model(run, weights=run / BEST_FILE)
    from dmscale.tasks.registry import build_task

    assert build_task(cfg).evaluate(model)["acc"] == pytest.approx(best["value"])
    for text in (printed, format_summary(summary)):
        assert "exported      the final weights of retrain (step 8" in text
        assert f"best          retrain step {best['step']} " in text and "kept in best.safetensors" in text
    report = (run / "report.md").read_text()
    assert "- exported (model.safetensors): the final weights of retrain" in report
    assert f"- best: retrain step {best['step']} " in report


def _scripted(monkeypatch: pytest.MonkeyPatch, accs: list[float]) -> None:
    """From now on the task's evaluations report the accuracies ``accs`` in turn."""
    real, calls = ClassificationTask.evaluate, iter(accs)

    def evaluate(self: ClassificationTask, model: torch.nn.Module, *a: Any, **kw: Any) -> dict[str, float]:
        return {**real(self, model, *a, **kw), "acc": next(calls)}

    monkeypatch.setattr(ClassificationTask, "evaluate", evaluate)


@pytest.fixture
def searched(tmp_path: Path) -> Path:
    """A search run without retraining, for `dmscale retrain` (all of whose evaluations are then
    the retraining's)."""
    src = tmp_path / "search"
    Pipeline(_cfg(src, retrain_epochs=0, eval_every=None)).run()
    return src


@pytest.mark.parametrize("accs, checkpoint, step", [
    ([0.5, 0.9, 0.7, 0.6], "best", 4),   # the best at step 4 is exported
    ([0.5, 0.9, 0.7, 0.9], "final", 8),  # the final evaluation ties it: the final weights
])
def test_export_best_exports_the_best_weights_and_says_which(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, searched: Path,
        accs: list[float], checkpoint: str, step: int) -> None:
    _scripted(monkeypatch, accs)
    run = tmp_path / "retrain"
    cfg = RunConfig(**{**_cfg(run, export_best=True, epochs=2).to_dict(), "command": "retrain", "source": str(searched)})
    summary = Pipeline(cfg).run()
    ex = summary["exported"]
    assert (ex["checkpoint"], ex["step"], ex["value"]) == (checkpoint, step, 0.9)
    assert summary["best"]["step"] == step and summary["evals"]["final"]["acc"] == 0.9
    assert _same(_tensors(run / "model.safetensors"), _tensors(run / BEST_FILE))
    word = "best" if checkpoint == "best" else "final"
    assert f"exported      the {word} weights of retrain (step {step}" in format_summary(summary)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("watch") / "full"
    Pipeline(_cfg(run)).run()
    return run


@pytest.mark.parametrize("kept_at", [9, 15])  # the last checkpoint before / after the best was kept
def test_a_killed_run_resumes_with_the_same_evaluation_steps_and_best(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, uninterrupted: Path, kept_at: int) -> None:
    run, early = tmp_path / "run", tmp_path / "early.pt"
    real_save = RunDir.save_checkpoint

    def save(rd: RunDir, state: dict[str, Any]) -> None:
        real_save(rd, state)
        if state["global_step"] == kept_at:
            shutil.copy(rd.checkpoint, early)

    monkeypatch.setattr(RunDir, "save_checkpoint", save)
    with pytest.raises(Stopped):
        Pipeline(_cfg(run, stop_after=19)).run()
    shutil.copy(early, run / "checkpoint.pt")  # killed at step 19: its last checkpoint is an older one
    if kept_at == 15:
        ck = torch.load(run / "checkpoint.pt", weights_only=False)
        assert ck["phase"] == "retrain" and ck["state"]["best"]["phase"] == "retrain"
    summary = Pipeline(_cfg(run), resume=True).run()
    full = json.loads((uninterrupted / "summary.json").read_text())
    assert _records(run, "eval") == _records(uninterrupted, "eval")
    assert _records(run, "best") == _records(uninterrupted, "best")
    assert summary["best"] == full["best"] and summary["exported"] == full["exported"]
    assert _same(_tensors(run / BEST_FILE), _tensors(uninterrupted / BEST_FILE))
    assert _same(_tensors(run / "model.safetensors"), _tensors(uninterrupted / "model.safetensors"))


def test_a_search_without_retraining_keeps_no_best_and_says_why(tmp_path: Path) -> None:
    run = tmp_path / "run"
    summary = Pipeline(_cfg(run, retrain_epochs=0)).run()
    assert summary["best"] is None and not (run / BEST_FILE).exists()
    assert summary["exported"]["phase"] == "search" and summary["exported"]["checkpoint"] == "final"
    text = format_summary(summary)
    assert "exported      the search's export (step 12" in text
    assert "best          none kept" in text and "structure changes" in text


def test_dmscale_pretrain_keeps_the_best_pretrained_supernet(tmp_path: Path) -> None:
    run = tmp_path / "run"
    summary = Pipeline(_cfg(run, command="pretrain", epochs=2)).run()
    assert summary["best"]["phase"] == "pretrain" and (run / BEST_FILE).is_file()
    load_run_model(run, weights=run / BEST_FILE)


@pytest.mark.parametrize("kw, message", [
    ({"export_best": True, "eval_every": None}, "--export-best picks the best of the evaluations --eval-every"),
    ({"export_best": True, "retrain_epochs": 0}, "this search has none"),
    ({"export_best": True, "pipeline": "p-"}, "this search has none"),
])
def test_export_best_without_a_best_to_export_is_refused(tmp_path: Path, kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _cfg(tmp_path / "run", **kw).resolved()


def test_eval_every_cannot_change_on_resume(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    assert main([*ARGS, "--quiet", "--eval-every", "2", "--stop-after", "3", "--out", str(run)]) == 0
    assert main(["search", "--resume", str(run), "--eval-every", "3", "--quiet"]) == 2
    assert "--eval-every (run: 2, now: 3)" in capsys.readouterr().err
