"""The loggers of a run (dmscale.engine.loggers, ``--logger``):

* ``--logger tensorboard`` writes event files into ``<run>/tensorboard/`` whose scalars, read
  back with TensorBoard's EventAccumulator, hold the losses, the search's exact cost against
  the target, the kept widths and depths and the evaluations, at the run's global steps;
* a run killed and resumed logs each step once (what the killed run wrote after its last
  checkpoint is purged: the resumed run writes those steps again);
* without the tensorboard package the run fails before it writes anything, with an error
  naming ``pip install dmscale[tensorboard]``; ranks other than 0 log nothing.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from dmscale.cli import main
from dmscale.config.run_config import RunConfig
from dmscale.core.errors import MissingDependencyError
from dmscale.engine.loggers import JsonlLogger, TensorBoardLogger, make_logger
from dmscale.engine.rundir import RunDir, Stopped
from dmscale.run.pipeline import Pipeline

__all__: list[str] = []

TINY = dict(task="digits", model="smallcnn", model_args={"width": 4, "blocks": 2}, train_limit=256,
            test_limit=64, batch_size=64, threads=1, quiet=True, structure_lr=0.05, epochs=3,
            retrain_epochs=1)


def _cfg(out: Path, **kw: Any) -> RunConfig:
    return RunConfig(**{**TINY, "out": str(out), **kw})  # type: ignore[arg-type]


def _scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_event_files_hold_losses_cost_structure_and_evaluations(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    run = tmp_path / "run"
    Pipeline(_cfg(run, logger="tensorboard", eval_every=4)).run()
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    tags = _scalars(run)
    for tag in ("loss/total", "loss/task", "loss/resource", "train/lr", "cost/exact", "cost/soft",
                "cost/target", "cost/target_now", "cost/exact_over_target", "structure/width_kept",
                "structure/depth_kept", "eval/acc", "eval/loss", "eval/best"):
        assert tag in tags, f"{tag} missing from {sorted(tags)}"
    assert any(t.startswith("width/") for t in tags) and any(t.startswith("depth/") for t in tags)
    # the search's steps carry the cost: 12 search steps, the target is the final one throughout
    cost = dict(tags["cost/exact"])
    assert set(range(1, 13)) <= set(cost) and all(v > 0 for v in cost.values())
    assert len({v for _, v in tags["cost/target"]}) == 1
    # evaluations at their global steps: search 4, 8, 12 (the export), retrain 4 (its end)
    assert [s for s, _ in tags["eval/acc"]][:3] == [4, 8, 12]
    # the retrain's losses continue on the run's global step
    assert max(s for s, _ in tags["loss/task"]) == max(s for s, _ in tags["eval/acc"])


def test_a_killed_and_resumed_run_logs_each_step_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    run, early = tmp_path / "run", tmp_path / "checkpoint-5.pt"
    real_save = RunDir.save_checkpoint

    def save(rd: RunDir, state: dict[str, Any]) -> None:  # keep the checkpoint of step 5
        real_save(rd, state)
        if state["global_step"] == 5:
            shutil.copy(rd.checkpoint, early)

    monkeypatch.setattr(RunDir, "save_checkpoint", save)
    with pytest.raises(Stopped):
        Pipeline(_cfg(run, logger="tensorboard", retrain_epochs=0, stop_after=8, checkpoint_every=5)).run()
    shutil.copy(early, run / "checkpoint.pt")  # killed at step 8: its last checkpoint is step 5's
    Pipeline(_cfg(run, logger="tensorboard", retrain_epochs=0), resume=True).run()
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 2
    steps = [s for s, _ in _scalars(run)["loss/task"]]
    assert steps == sorted(set(steps)) and set(range(1, 13)) <= set(steps)  # 6-8 once, not twice


def _no_tensorboard(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("tensorboard", "torch.utils.tensorboard"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails as if not installed


def test_without_the_package_the_error_names_the_extra_and_no_run_directory_is_left(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _no_tensorboard(monkeypatch)
    run = tmp_path / "run"
    with pytest.raises(MissingDependencyError, match=r"pip install dmscale\[tensorboard\]"):
        Pipeline(_cfg(run, logger="tensorboard"))
    assert not run.exists()
    assert isinstance(make_logger("none", run), JsonlLogger)  # the default needs nothing


def test_the_cli_says_the_missing_package_on_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    _no_tensorboard(monkeypatch)
    rc = main(["search", "--task", "digits", "--train-limit", "64", "--test-limit", "32", "--quiet",
               "--logger", "tensorboard", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 1 and len(err.strip().splitlines()) == 1
    assert "--logger tensorboard needs the tensorboard package" in err and "dmscale[tensorboard]" in err


def test_only_the_rank_that_writes_files_logs(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    assert isinstance(make_logger("tensorboard", tmp_path, writes=False), JsonlLogger)
    assert not (tmp_path / "tensorboard").exists()
    logger = make_logger("tensorboard", tmp_path, writes=True)
    assert isinstance(logger, TensorBoardLogger) and logger.enabled
    logger.log_scalars(1, {"loss/total": 1.0})
    logger.close()
    logger.log_scalars(2, {"loss/total": 1.0})  # closed: ignored
    assert [s for s, _ in _scalars(tmp_path)["loss/total"]] == [1]
