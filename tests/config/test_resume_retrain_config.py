"""``RunConfig.for_resume`` / ``for_retrain``: the configuration of a resumed run and of a
retraining, and a run directory saved before the options were declared on ``SearchConfig``
that still resumes.

``tests/fixtures/saved_runs/stopped_search`` was written by dmscale as of the commit before the
search options moved onto ``SearchConfig`` (config.yaml in the field order of that time, its
``out`` set to a relative path), with ``dmscale search`` and the options of :data:`FLAGS` and
``--stop-after 3``: a search of two budgets stopped after 3 of its 8 steps.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dmscale.cli import main
from dmscale.config.run_config import TASK_FIELDS, ConfigError, RunConfig, load_run_config

OLD_RUN = Path(__file__).parents[1] / "fixtures" / "saved_runs" / "stopped_search"
FLAGS = ["--task", "digits", "--model", "smallcnn", "--model-args", "width=4,blocks=1", "--train-limit", "128",
         "--test-limit", "64", "--batch-size", "64", "--threads", "1", "--epochs", "2", "--retrain-epochs", "1",
         "--checkpoint-every", "2", "--target", "params=0.7,macs=0.6", "--exclude", "stem", "--settle", "0.3",
         "--width-only-from", "0.9", "--quiet"]


def test_a_run_saved_before_the_declarations_resumes_as_if_never_stopped(tmp_path: Path) -> None:
    run = tmp_path / "old"
    shutil.copytree(OLD_RUN, run)
    cfg = load_run_config(run)
    assert cfg.budgets == {"params": 0.7, "macs": 0.6} and cfg.exclude == ["stem"] and cfg.width_only_from == 0.9
    assert cfg.search_config(["stem"]).budgets == {"params": 0.7, "macs": 0.6}
    assert main(["search", "--resume", str(run), "--quiet"]) == 0
    whole = tmp_path / "whole"
    assert main(["search", *FLAGS, "--out", str(whole)]) == 0
    for name in ("structure.json", "model.safetensors"):
        assert (run / name).is_file()
    # the fixture's first 3 steps ran on another machine, whose CPU kernels (oneDNN picks AVX-512 /
    # AMX paths where a CPU has them) round differently: the same structure, numbers equal to rounding
    resumed, fresh = (json.loads((d / "structure.json").read_text()) for d in (run, whole))
    assert _kept(resumed) == _kept(fresh)
    assert _numbers(resumed) == pytest.approx(_numbers(fresh), rel=1e-5, abs=1e-7)
    a, b = load_file(str(run / "model.safetensors")), load_file(str(whole / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6) for k in a)


def _kept(structure: dict) -> str:
    """The structure without its floating-point numbers (kept channels, blocks, names, counts)."""
    return json.dumps(_strip_floats(structure), sort_keys=True)


def _strip_floats(o):
    if isinstance(o, float):
        return "float"
    if isinstance(o, dict):
        return {k: _strip_floats(v) for k, v in o.items()}
    if isinstance(o, list):
        return [_strip_floats(v) for v in o]
    return o


def _numbers(o) -> list:
    """Every floating-point number of ``o``, in order."""
    if isinstance(o, float):
        return [o]
    if isinstance(o, dict):
        return [x for k in sorted(o) for x in _numbers(o[k])]
    if isinstance(o, list):
        return [x for v in o for x in _numbers(v)]
    return []


def test_for_resume_keeps_the_run_and_starts_per_invocation_options_afresh() -> None:
    cfg = RunConfig.for_resume(OLD_RUN, "search", {"device": "cpu"})
    saved = load_run_config(OLD_RUN)
    assert cfg.out == str(OLD_RUN) and cfg.command == "search" and cfg.device == "cpu"
    assert saved.stop_after == 3 and cfg.stop_after is None  # --stop-after: per invocation
    assert cfg.checkpoint_every == 100 and cfg.threads is None
    same = ("target", "resource", "exclude", "settle", "lr", "optimizer", "structure_lr", "task_info")
    assert {k: getattr(cfg, k) for k in same} == {k: getattr(saved, k) for k in same}
    with pytest.raises(ConfigError, match="is not a dmscale run directory"):
        RunConfig.for_resume(OLD_RUN / "nothing", "search", {})


def test_for_retrain_takes_task_and_model_from_the_search_run(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="retrain needs RUN"):
        RunConfig.for_retrain(None, {})
    with pytest.raises(ConfigError, match="has no structure.json"):
        RunConfig.for_retrain(OLD_RUN, {})  # a stopped search found no structure yet
    run = tmp_path / "found"
    shutil.copytree(OLD_RUN, run)
    (run / "structure.json").write_text("{}")
    cfg = RunConfig.for_retrain(run, {"epochs": 3.0, "train_limit": 64})
    saved = load_run_config(run)
    assert cfg.command == "retrain" and cfg.source == str(run) and cfg.pipeline == saved.pipeline
    assert cfg.train_limit == 64 and cfg.epochs == 3.0  # given: wins over the run's
    assert {k: getattr(cfg, k) for k in TASK_FIELDS if k != "train_limit"} == \
        {k: getattr(saved, k) for k in TASK_FIELDS if k != "train_limit"}
    assert cfg.out is None  # the command names the directory
