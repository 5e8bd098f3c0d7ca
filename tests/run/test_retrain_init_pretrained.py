"""``--retrain-init pretrained`` (src/dmscale/run/phases.py): the retraining of a pipeline p
search starts from the pretrained supernet's weights of the channels and blocks the search kept,
not from the weights the search trained under soft masks; refused where there are none."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dmscale as dms
from dmscale.cli import main
from dmscale.engine.loop import StepLoop
from dmscale.run.pipeline import load_run_model

TINY = ["--task", "digits", "--model", "resnet", "--model-args", "width=4", "--train-limit", "256",
        "--test-limit", "64", "--batch-size", "32", "--quiet", "--threads", "1"]
DATA = TINY[6:]  # what a retrain takes (the task and model come from the search run)


@pytest.fixture(scope="module")
def searched(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("ri")
    assert main(["pretrain", *TINY, "--epochs", "1", "--out", str(root / "pre")]) == 0
    assert main(["search", *TINY, "--pipeline", "p", "--init", str(root / "pre"), "--epochs", "1",
                 "--retrain-epochs", "0", "--out", str(root / "search")]) == 0
    return root / "pre", root / "search"


def _start_of_retrain(monkeypatch: pytest.MonkeyPatch) -> dict[str, torch.Tensor]:
    """Patch the step loop to keep a copy of the model's weights when the retraining starts."""
    seen: dict[str, torch.Tensor] = {}
    run = StepLoop.run

    def spy(self: StepLoop) -> None:
        if self.phase == "retrain" and not seen:
            seen.update({k: v.detach().clone() for k, v in self.model.state_dict().items()})
        run(self)
    monkeypatch.setattr(StepLoop, "run", spy)
    return seen


@pytest.mark.parametrize("how", ["pretrained", "inherit"])
def test_the_retraining_starts_from_the_pretrained_weights_of_the_kept_channels(how, searched, tmp_path, monkeypatch):
    pre, search = searched
    seen = _start_of_retrain(monkeypatch)
    assert main(["retrain", str(search), *DATA, "--epochs", "0.25", "--retrain-init", how,
                 "--out", str(tmp_path / "r")]) == 0
    supernet, _ = load_run_model(pre)
    expected = dms.apply_structure(supernet, json.loads((search / "structure.json").read_text())).state_dict()
    same = all(torch.equal(seen[k], v) for k, v in expected.items() if v.is_floating_point())
    assert same == (how == "pretrained")  # inherit: the search's weights, trained under soft masks
    if how == "inherit":
        searched_model, _ = load_run_model(search)
        assert all(torch.equal(seen[k], v) for k, v in searched_model.state_dict().items())


def test_a_search_retrains_from_its_pretrained_supernet_in_the_same_run(searched, tmp_path):
    pre, _ = searched
    assert main(["search", *TINY, "--pipeline", "p", "--init", str(pre), "--epochs", "1",
                 "--retrain-epochs", "0.25", "--retrain-init", "pretrained", "--out", str(tmp_path / "s")]) == 0
    assert (tmp_path / "s" / "model.safetensors").is_file()


@pytest.mark.parametrize("pipeline", ["np", "p-"])
def test_a_search_without_pretrained_weights_to_retrain_is_refused_before_its_first_step(pipeline, tmp_path, capsys):
    assert main(["search", *TINY, "--pipeline", pipeline, "--epochs", "1", "--retrain-init", "pretrained",
                 "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert ("trains no weights" in err and "--retrain-init inherit" in err) if pipeline == "p-" else \
        (f"a pipeline {pipeline} search has none" in err and "--pipeline p" in err)
    assert not (tmp_path / "x").exists()
