"""``dmscale inspect`` (the search space before training) and ``dmscale show`` (a run's summary
again), src/dmscale/run/inspect.py."""

from __future__ import annotations

import json

import pytest

from dmscale.cli import main
from dmscale.config.run_config import RunConfig
from dmscale.run.inspect import inspect_space
from dmscale.run.pipeline import Pipeline

TINY = ["--task", "digits", "--model", "smallcnn", "--model-args", "width=4,blocks=1",
        "--train-limit", "64", "--test-limit", "32"]


def test_inspect_prints_and_writes_the_search_space(tmp_path, capsys):
    assert main(["inspect", *TINY, "--out", str(tmp_path / "space.json")]) == 0
    text = capsys.readouterr().out
    space = json.loads((tmp_path / "space.json").read_text())
    assert [d["name"] for d in space["width"]] == ["stem.0", "stage1.0.body.0", "down.0", "stage2.0.body.0", "fc1"]
    assert [d["blocks"] for d in space["depth"]] == [1, 1]
    assert space["fixed"] == {"fc2": "model output"}
    cost = space["cost"]
    assert cost["max"] == space["supernet"]["macs"] and cost["min"] < cost["target"] == pytest.approx(cost["max"] / 2)
    assert "5 width dimensions" in text and "(reachable)" in text and "fc2: model output" in text
    assert not (tmp_path / "runs").exists()


def test_inspect_says_when_the_target_is_below_the_smallest_structure(capsys):
    assert main(["inspect", *TINY, "--target", "0.001"]) == 0
    assert "NOT reachable" in capsys.readouterr().out


def test_inspect_takes_only_the_options_that_shape_the_space(capsys):
    with pytest.raises(SystemExit):
        main(["inspect", *TINY, "--epochs", "3"])
    assert "unrecognized arguments: --epochs" in capsys.readouterr().err


def test_inspect_equals_the_library_on_the_same_config():
    cfg = RunConfig(command="search", task="digits", model="smallcnn", model_args={"width": 4, "blocks": 1},
                    train_limit=64, test_limit=32, exclude=["fc1"])
    space = inspect_space(cfg)
    assert "fc1" not in [d["name"] for d in space["width"]]
    assert "fc1" in space["excluded"]


def test_show_prints_a_finished_runs_summary_and_refuses_other_directories(tmp_path, capsys):
    cfg = RunConfig(command="pretrain", task="digits", model="smallcnn", model_args={"width": 4, "blocks": 1},
                    train_limit=64, test_limit=32, batch_size=32, quiet=True, out=str(tmp_path / "run"))
    Pipeline(cfg).run()
    assert main(["show", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("dmscale pretrain finished") and str(tmp_path / "run") in out
    assert main(["show", str(tmp_path)]) == 2
    assert "has no summary.json" in capsys.readouterr().err


def test_keep_depth_from_the_command_line_pins_blocks_by_pattern(tmp_path, capsys):
    """``--keep-depth`` (declared once on ``SearchConfig.keep_depth``) takes glob patterns: the
    blocks holding the matched modules leave the search; a pattern matching nothing is refused."""
    tiny = [*TINY[:5], "width=4,blocks=2", *TINY[6:]]
    assert main(["inspect", *tiny, "--out", str(tmp_path / "all.json")]) == 0
    assert main(["inspect", *tiny, "--keep-depth", "stage1.*", "--out", str(tmp_path / "kept.json")]) == 0
    depth = {name: [d["name"] for d in json.loads((tmp_path / name).read_text())["depth"]]
             for name in ("all.json", "kept.json")}
    assert depth == {"all.json": ["stage1", "stage2"], "kept.json": ["stage2"]}
    capsys.readouterr()
    assert main(["inspect", *tiny, "--keep-depth", "nope.*"]) == 2
    assert "--keep-depth 'nope.*' matches no module" in capsys.readouterr().err
