"""One image-size flag: ``--image-size`` sets the crops of ``--task imagefolder`` and the image
size of ``--task detect``; ``--imgsz`` (detect's flag before) still works as its deprecated
spelling, warning once, on the command line and in a ``--config`` file; run directories saved
with ``imgsz`` load and resume as they ran."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import yaml

from dmscale.cli import build_parser, main
from dmscale.config import aliases
from dmscale.config.run_config import ConfigError, RunConfig, load_run_config, parse_mapping


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aliases, "_WARNED", set())


def _image_size_line(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("image-size:"))


def test_image_size_sets_the_detection_image_size(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["search", "--task", "detect", "--data", "d.yaml", "--image-size", "96", "--print-config"]) == 0
    assert _image_size_line(capsys.readouterr().out) == "image-size: 96"
    help_text = build_parser()._subparsers._group_actions[0].choices["search"].format_help()
    assert "--image-size SIZE" in help_text and "--imgsz" not in help_text.replace("--imgsz is its", "")


def test_imgsz_is_a_deprecated_spelling_that_warns_once(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.warns(FutureWarning, match=r"--imgsz is deprecated.*--image-size") as seen:
        assert main(["search", "--task", "detect", "--data", "d.yaml", "--imgsz", "96", "--print-config"]) == 0
        assert main(["search", "--task", "detect", "--data", "d.yaml", "--imgsz", "128", "--print-config"]) == 0
    assert [str(w.message).startswith("--imgsz") for w in seen] == [True]
    out = capsys.readouterr().out
    assert "image-size: 96\n" in out and "image-size: 128\n" in out and "imgsz" not in out


def test_imgsz_in_a_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "run.yaml").write_text("task: detect\ndata: d.yaml\nimgsz: 160\n")
    with pytest.warns(FutureWarning, match="--imgsz"):
        assert main(["search", "--config", str(tmp_path / "run.yaml"), "--print-config"]) == 0
    assert _image_size_line(capsys.readouterr().out) == "image-size: 160"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert parse_mapping({"imgsz": "64", "image-size": 64}) == {"image_size": 64}  # the same value
        with pytest.raises(ConfigError, match=r"--imgsz 64 and --image-size 96 .*give --image-size alone"):
            parse_mapping({"imgsz": 64, "image_size": 96}, origin="--config run.yaml")


def test_both_spellings_with_different_values_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = main(["search", "--task", "detect", "--data", "d.yaml", "--imgsz", "64", "--image-size", "96",
                     "--print-config"])
    assert code == 2
    assert "--imgsz 64 and --image-size 96 set the same option" in capsys.readouterr().err


def test_detection_keeps_the_multiple_of_32_rule() -> None:
    from dmscale.tasks.detect import DetectTask

    with pytest.raises(ConfigError, match=r"--image-size 50: YOLO needs a multiple of its stride 32; "
                                          r"use e\.g\. --image-size 64"):
        DetectTask(RunConfig(task="detect", data="d.yaml", image_size=50).resolved())


def test_mnist_detect_takes_image_size_and_imgsz(tmp_path: Path) -> None:
    common = ["data", "mnist-detect", "--train", "2", "--val", "1", "--quiet"]
    assert main([*common, "--out", str(tmp_path / "a"), "--image-size", "32"]) == 0
    with pytest.warns(FutureWarning, match="--imgsz"):
        assert main([*common, "--out", str(tmp_path / "b"), "--imgsz", "32"]) == 0
    from PIL import Image

    for run in ("a", "b"):
        image = next((tmp_path / run / "images" / "train").iterdir())
        assert Image.open(image).size == (32, 32)


def _saved(run: Path, **values: object) -> None:
    """``run/config.yaml`` as a version with a separate ``imgsz`` option saved it."""
    run.mkdir(parents=True, exist_ok=True)
    data = RunConfig(**{k: v for k, v in values.items() if k != "imgsz"}).to_dict()
    data["imgsz"] = values.get("imgsz")
    (run / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))


def test_runs_saved_with_imgsz_load_as_they_ran(tmp_path: Path) -> None:
    _saved(tmp_path / "det", command="search", task="detect", data="d.yaml", imgsz=96)
    assert load_run_config(tmp_path / "det").image_size == 96
    # an image-folder run never read imgsz: its crops stay the model's own size
    _saved(tmp_path / "img", command="search", task="imagefolder", data="imgs", imgsz=64)
    assert load_run_config(tmp_path / "img").image_size is None
    _saved(tmp_path / "img2", command="search", task="imagefolder", data="imgs", image_size=48, imgsz=None)
    assert load_run_config(tmp_path / "img2").image_size == 48


def test_a_run_saved_with_imgsz_resumes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = ["search", "--task", "digits", "--model", "smallcnn", "--model-args", "width=4,blocks=1",
            "--train-limit", "96", "--test-limit", "32", "--batch-size", "32", "--epochs", "1",
            "--retrain-epochs", "0", "--threads", "1", "--quiet", "--out", str(run)]
    assert main([*args, "--stop-after", "1"]) == 0
    saved = yaml.safe_load((run / "config.yaml").read_text())
    saved["imgsz"] = None  # every config.yaml saved before the flags merged has the key
    (run / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the user typed no --imgsz: no warning
        assert main(["search", "--resume", str(run), "--quiet"]) == 0
    assert yaml.safe_load((run / "state.json").read_text())["status"] == "done"
    assert "imgsz" not in yaml.safe_load((run / "config.yaml").read_text())
