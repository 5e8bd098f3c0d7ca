"""``dmscale`` with the user's own model and weights, end to end on tiny budgets:
``--model package.module:factory`` through search, export, eval and retrain of the run
directory; ``--weights PATH`` (the run starts from the file, a resumed one from its
checkpoint); ``--pretrained`` offline (a one-line error within seconds)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import dmscale.tasks.pretrained as pretrained
from dmscale.cli import main

SRC = str(Path(__file__).resolve().parents[2] / "src")
NETS = '''
from torch import nn


def build(num_classes=10, in_channels=3, width=8):
    """A small classifier; dmscale passes num_classes and in_channels, --model-args the width."""
    return nn.Sequential(
        nn.Conv2d(in_channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1, stride=2), nn.BatchNorm2d(2 * width), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, num_classes))
'''
MODEL = ["--task", "digits", "--model", "my_pkg.nets:build", "--model-args", "width=8"]
TINY = [*MODEL, "--train-limit", "256", "--test-limit", "128", "--batch-size", "64", "--threads", "1",
        "--quiet"]


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def _first_record(run: Path) -> dict:
    return json.loads((run / "metrics.jsonl").read_text().splitlines()[0])


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A project folder holding ``my_pkg/nets.py``, on sys.path for this module's tests."""
    root = tmp_path_factory.mktemp("project")
    (root / "my_pkg").mkdir()
    (root / "my_pkg" / "__init__.py").write_text("")
    (root / "my_pkg" / "nets.py").write_text(NETS)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(root))
        yield root
    for name in [m for m in sys.modules if m == "my_pkg" or m.startswith("my_pkg.")]:
        del sys.modules[name]


@pytest.fixture(scope="module")
def searched(project: Path) -> Path:
    """One np run of the user's model from random weights: search + retrain."""
    run = project / "runs" / "own"
    assert main(["search", *TINY, "--epochs", "1", "--structure-lr", "0.1", "--out", str(run)]) == 0
    return run


@pytest.fixture(scope="module")
def weights(project: Path) -> Path:
    """A state dict of the same architecture, trained (a pretrain run's weights, torch.save'd)."""
    run = project / "runs" / "pre"
    assert main(["pretrain", *MODEL, "--train-limit", "512", "--test-limit", "128", "--batch-size", "64",
                 "--epochs", "8", "--lr", "0.2", "--threads", "1", "--quiet", "--out", str(run)]) == 0
    path = project / "trained.pt"
    torch.save(load_file(run / "model.safetensors"), path)
    return path


# ----------------------------------------------------------------------------- --model module:factory
def test_the_run_directory_records_and_rebuilds_the_own_model(searched: Path, project: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    cfg = yaml.safe_load((searched / "config.yaml").read_text())
    assert cfg["model"] == "my_pkg.nets:build" and cfg["model_args"] == {"width": 8}
    assert cfg["weights"] is None and cfg["pretrained"] is False
    out = project / "export"
    rc, text, err = _run(capsys, "export", searched, "--out", out, "--format", "pt")
    assert rc == 0, err
    assert "model.pt loads with torch.load(..., weights_only=False), without dmscale" in text
    for run in (searched, out):
        rc, text, err = _run(capsys, "eval", run)
        assert rc == 0 and "accuracy" in text and "my_pkg.nets:build, found structure" in text, err
    rc, _, err = _run(capsys, "retrain", searched, "--epochs", "0.5", "--out", project / "runs" / "retrained",
                      "--quiet", "--threads", "1")
    assert rc == 0, err


def test_the_exported_module_loads_in_plain_torch_without_dmscale(searched: Path, project: Path) -> None:
    out = project / "export-plain"
    assert main(["export", str(searched), "--out", str(out), "--format", "pt", "--quiet"]) == 0
    code = ("import sys; sys.modules['dmscale'] = None\n"  # any import of dmscale fails
            "import torch\n"
            f"m = torch.load({str(out / 'model.pt')!r}, weights_only=False).eval()\n"
            "print(tuple(m(torch.zeros(2, 1, 8, 8)).shape))\n")
    env = {**os.environ, "PYTHONPATH": str(project)}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "(2, 10)"


def test_export_where_the_module_is_not_importable_says_so(searched: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": SRC}
    p = subprocess.run([sys.executable, "-m", "dmscale", "export", str(searched), "--out", str(tmp_path / "x")],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert p.returncode == 2
    line = p.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    for words in (f"cannot rebuild the model of {searched} from its config.yaml",
                  "cannot import module 'my_pkg.nets'", "No module named 'my_pkg'", "PYTHONPATH",
                  "exported, evaluated or retrained"):
        assert words in line, (words, line)


# ----------------------------------------------------------------------------- --weights
def test_a_search_starts_from_the_weights_file(weights: Path, searched: Path, project: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    run = project / "runs" / "from-file"
    rc, _, err = _run(capsys, "search", *TINY, "--epochs", "1", "--structure-lr", "0.1",
                      "--weights", weights, "--out", run)
    assert rc == 0, err
    assert yaml.safe_load((run / "config.yaml").read_text())["weights"] == str(weights)
    assert json.loads((run / "state.json").read_text())["start_weights"] == f"starting from the weights in {weights}"
    # the first step computes the loss of the file's weights, far below a random start's
    assert _first_record(run)["task_loss"] < 0.8 * _first_record(searched)["task_loss"]
    rc, text, err = _run(capsys, "eval", run)
    assert rc == 0, err


def test_p_minus_without_pretraining_keeps_the_file_as_its_supernet(weights: Path, project: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    run = project / "runs" / "p-minus"
    rc, _, err = _run(capsys, "search", *TINY, "--pipeline", "p-", "--pretrain-epochs", "0", "--epochs", "0.5",
                      "--weights", weights, "--out", run)
    assert rc == 0, err
    state = json.loads((run / "state.json").read_text())
    assert state["phases"] == ["search"]
    saved, given = load_file(run / "supernet.safetensors"), torch.load(weights)
    assert saved.keys() == given.keys() and all(torch.equal(saved[k], given[k]) for k in given)
    # --init takes the same file formats
    rc, _, err = _run(capsys, "search", *TINY, "--pipeline", "p-", "--epochs", "0.5", "--init", weights,
                      "--out", project / "runs" / "init-file")
    assert rc == 0, err


def test_pretrain_from_a_safetensors_file(weights: Path, project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = project / "runs" / "pre" / "model.safetensors"
    run = project / "runs" / "pre-again"
    rc, _, err = _run(capsys, "pretrain", *TINY, "--epochs", "0.25", "--weights", source, "--out", run)
    assert rc == 0, err
    assert json.loads((run / "state.json").read_text())["start_weights"] == f"starting from the weights in {source}"


def test_a_resumed_run_continues_from_its_checkpoint_not_the_file(weights: Path, project: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    copy = project / "copy.pt"
    copy.write_bytes(weights.read_bytes())
    run = project / "runs" / "resumed"
    rc, _, err = _run(capsys, "search", *TINY, "--epochs", "1", "--weights", copy, "--stop-after", "2", "--out", run)
    assert rc == 0 and (run / "checkpoint.pt").is_file(), err
    copy.unlink()
    rc, _, err = _run(capsys, "search", "--resume", run, "--quiet")
    assert rc == 0, err
    assert json.loads((run / "state.json").read_text())["status"] == "done"


def test_a_file_of_another_width_is_a_one_line_error(weights: Path, project: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    run = project / "runs" / "mismatch"
    args = [a if a != "width=8" else "width=4" for a in TINY]
    rc, _, err = _run(capsys, "search", *args, "--weights", weights, "--out", run)
    assert rc == 2
    line = err.strip()
    assert "\n" not in line and line.startswith("dmscale search: error: --weights: the weights in")
    assert "'0.weight' is [8, 1, 3, 3] in the file, [4, 1, 3, 3] in --model my_pkg.nets:build" in line
    assert not run.exists()  # a run that failed before its first step leaves no directory


# ----------------------------------------------------------------------------- --pretrained offline
def test_pretrained_offline_is_a_one_line_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setattr(pretrained, "_hub_cached", lambda repo, filename: False)
    for model in ("tv:resnet18", "timm:resnet18"):
        rc, _, err = _run(capsys, "search", "--task", "digits", "--model", model, "--pretrained",
                          "--train-limit", "64", "--test-limit", "32", "--quiet", "--out", tmp_path / model[:2])
        line = err.strip()
        assert rc == 2 and "\n" not in line, err
        assert "could not be fetched" in line and "this machine seems offline (HF_HUB_OFFLINE=1 is set)" in line
        assert "--weights PATH" in line


def test_pretrained_timm_offline_does_not_wait_for_the_hub_retries(tmp_path: Path) -> None:
    """A real process, nothing patched: the Hub offline variable and empty caches. timm's own
    download would retry for about a minute; dmscale refuses before it starts."""
    env = {**os.environ, "PYTHONPATH": SRC, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "TORCH_HOME": str(tmp_path / "torch")}
    p = subprocess.run([sys.executable, "-m", "dmscale", "search", "--task", "digits", "--model", "timm:resnet18",
                        "--pretrained", "--train-limit", "64", "--test-limit", "32", "--quiet",
                        "--out", str(tmp_path / "run")], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 2, p.stderr
    assert "could not be fetched" in p.stderr and "offline" in p.stderr and "--weights PATH" in p.stderr


@pytest.mark.slow
def test_timm_resnet18_from_a_weights_file_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dmscale.core._compat import ensure_torchvision

    ensure_torchvision()
    import timm

    torch.manual_seed(0)
    path = tmp_path / "resnet18-digits.pt"
    torch.save(timm.create_model("resnet18", num_classes=10, in_chans=1).state_dict(), path)
    run = tmp_path / "run"
    rc, _, err = _run(capsys, "search", "--task", "digits", "--model", "timm:resnet18", "--weights", path,
                      "--train-limit", "64", "--test-limit", "32", "--batch-size", "32", "--epochs", "1",
                      "--retrain-epochs", "0", "--target", "0.8", "--structure-lr", "0.2", "--threads", "2",
                      "--quiet", "--out", run)
    assert rc == 0, err
    assert yaml.safe_load((run / "config.yaml").read_text())["weights"] == str(path)
    rc, text, err = _run(capsys, "export", run, "--out", tmp_path / "export", "--format", "pt")
    assert rc == 0 and "without dmscale" in text, err
    # timm imports torchvision; a CPU-only torch may lack torchvision's compiled operators, so
    # declare the two it registers at import (what dmscale.core._compat does) before loading
    code = ("import sys; sys.modules['dmscale'] = None\n"
            "import torch\n"
            "try:\n    torch.ops.torchvision.nms\n"
            "except (AttributeError, RuntimeError):\n"
            "    lib = torch.library.Library('torchvision', 'DEF')\n"
            "    lib.define('nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor')\n"
            "    lib.define('qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor')\n"
            f"m = torch.load({str(tmp_path / 'export' / 'model.pt')!r}, weights_only=False).eval()\n"
            "print(tuple(m(torch.zeros(2, 1, 8, 8)).shape))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "(2, 10)", p.stderr
    rc, text, err = _run(capsys, "eval", tmp_path / "export")
    assert rc == 0 and "timm:resnet18" in text, err
