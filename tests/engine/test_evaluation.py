"""Evaluations during training (dmscale.engine.evaluation, ``--eval-every``):

* the value converter: N steps or Xe epochs, and a one-line error otherwise;
* a tiny digits search with ``--eval-every 2`` evaluates every 2nd step of the search (hard
  masks, with the exact cost against the target) and of the retraining, and each phase at its
  end; the finish steps are not evaluated; with ``Xe`` the interval is X epochs;
* the evaluations change nothing the run computes: the weights equal those of a run without
  them;
* the best weights: kept by the task's metric (higher accuracy, lower bits per character),
  strictly better to replace, ties at the phase's end go to the final weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from dmscale.config.run_config import ConfigError, RunConfig
from dmscale.core.values import eval_every_value
from dmscale.engine.evaluation import BEST_FILE, PhaseWatch, offer_best, read_best
from dmscale.engine.rundir import RunDir
from dmscale.run.pipeline import Pipeline

__all__: list[str] = []

TINY = dict(task="digits", model="smallcnn", model_args={"width": 4, "blocks": 2}, train_limit=256,
            test_limit=64, batch_size=64, threads=1, quiet=True, structure_lr=0.05, epochs=3,
            retrain_epochs=2)  # 4 steps per epoch: search 12 steps, retrain 8


def _run(out: Path, **kw: Any) -> dict[str, Any]:
    return Pipeline(RunConfig(**{**TINY, "out": str(out), **kw})).run()  # type: ignore[arg-type]


def _records(run: Path, event: str | None = "eval") -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("event") == event]


@pytest.mark.parametrize("text, value", [("200", 200), (7, 7), ("0.5e", "0.5e"), ("2E", "2e"), (" 1e ", "1e")])
def test_eval_every_takes_steps_or_epochs(text: Any, value: Any) -> None:
    assert eval_every_value(text) == value


@pytest.mark.parametrize("text", ["0", "-2", "2.5", "e", "0e", "abc", "nane", True])
def test_a_bad_eval_every_is_a_one_line_error_naming_both_forms(text: Any) -> None:
    with pytest.raises(ConfigError, match=r"N steps .* or X epochs .*1e or 0\.5e"):
        RunConfig(eval_every=text)


def test_eval_every_2_evaluates_every_second_step_of_each_phase_and_each_phase_end(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _run(run, eval_every=2)
    evals = _records(run)
    search = [r for r in evals if r["phase"] == "search"]
    retrain = [r for r in evals if r["phase"] == "retrain"]
    assert [r["step"] for r in search] == [2, 4, 6, 8, 10, 12]  # 12: the export, at the phase's end
    assert [r["step"] for r in retrain] == [2, 4, 6, 8]
    assert not [r for r in evals if r["phase"] == "finish"]
    # the whole test split, and during the search the cost of the hard structure now
    assert all(r["examples"] == 64 for r in evals)
    for r in search[:-1]:
        assert r["cost_final"] > 0 and r["cost_hard"] > 0 and r["cost_target"] >= r["cost_final"]
        assert r["within_budget"] == (r["cost_hard"] <= r["cost_final"])
    # global steps follow the phase steps: the retrain's continue after the search and finish
    offset = retrain[0]["global_step"] - 2
    assert offset >= 12 and all(r["global_step"] == r["step"] + offset for r in retrain)


def test_eval_every_in_epochs(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _run(run, command="pretrain", epochs=2, eval_every="0.5e")  # 4 steps per epoch: every 2
    assert [r["step"] for r in _records(run)] == [2, 4, 6, 8]


def test_evaluations_change_nothing_the_run_computes(tmp_path: Path) -> None:
    _run(tmp_path / "plain")
    _run(tmp_path / "watched", eval_every=1)
    assert (json.loads((tmp_path / "plain" / "structure.json").read_text())
            == json.loads((tmp_path / "watched" / "structure.json").read_text()))
    a = load_file(tmp_path / "plain" / "model.safetensors")
    b = load_file(tmp_path / "watched" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_without_eval_every_the_per_epoch_evaluations_stay_as_they_were(tmp_path: Path) -> None:
    run = tmp_path / "run"
    summary = _run(run)
    evals = _records(run)
    assert [(r["phase"], r["step"]) for r in evals] == [("search", 12), ("retrain", 4), ("retrain", 8)]
    assert not (run / BEST_FILE).exists() and "exported" not in summary and "best" not in summary


# ----------------------------------------------------------------------------- the best
class _Host(SimpleNamespace):
    """What offer_best reads of a run."""


def _host(tmp_path: Path, metric: str = "acc", higher: bool = True) -> _Host:
    return _Host(task=SimpleNamespace(metric=metric, higher_is_better=higher), state={}, global_step=0,
                 rd=RunDir(tmp_path))


@pytest.mark.parametrize("metric, higher, values, kept", [
    ("acc", True, [0.5, 0.7, 0.6, 0.7], [True, True, False, False]),
    ("bpc", False, [2.5, 2.1, 2.3, 2.1], [True, True, False, False]),
])
def test_the_best_follows_the_tasks_metric_and_needs_a_strictly_better_value(
        tmp_path: Path, metric: str, higher: bool, values: list[float], kept: list[bool]) -> None:
    host = _host(tmp_path, metric, higher)
    model = torch.nn.Linear(2, 2)
    got = []
    for step, value in enumerate(values, start=1):
        host.global_step = step
        with torch.no_grad():
            model.weight.fill_(step)
        got.append(offer_best(host, "retrain", model, step, {metric: value}))
    assert got == kept
    best = read_best(tmp_path / BEST_FILE)
    assert best == {"phase": "retrain", "step": 2, "global_step": 2, "metric": metric, "value": values[1]}
    assert host.state["best"]["step"] == 2
    assert torch.equal(load_file(tmp_path / BEST_FILE)["weight"], torch.full((2, 2), 2.0))
    # the phase's last evaluation wins a tie: of equal weights, the final ones are exported
    assert offer_best(host, "retrain", model, 5, {metric: values[1]}, ties=True)
    assert read_best(tmp_path / BEST_FILE)["step"] == 5
    assert [r["step"] for r in _records(tmp_path, "best")] == [1, 2, 5]


def test_a_rank_that_writes_no_files_keeps_the_record_but_no_file(tmp_path: Path) -> None:
    host = _host(tmp_path)
    host.rd = RunDir(tmp_path, writes=False)
    assert offer_best(host, "retrain", torch.nn.Linear(2, 2), 3, {"acc": 0.5})
    assert host.state["best"]["step"] == 3 and not (tmp_path / BEST_FILE).exists()


def test_phase_watch_evaluates_only_the_phases_that_train(tmp_path: Path) -> None:
    calls: list[tuple[str, int]] = []
    host = _host(tmp_path)
    host.cfg = SimpleNamespace(eval_every=2, batch_size=4)
    host.task.steps_per_epoch = lambda batch_size: 3
    host.evaluate = lambda phase, model, searcher, step, limit=None, extra=None: calls.append((phase, step)) or {}
    for phase in ("pretrain", "finish"):
        watch = PhaseWatch(host, phase, torch.nn.Linear(1, 1), None, total=7)
        for done in range(1, 8):
            watch.after_step(done)
    assert calls == [("pretrain", 2), ("pretrain", 4), ("pretrain", 6)]
