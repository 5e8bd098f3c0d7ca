"""The ``dmscale`` command end to end, on tiny budgets (seconds per run on 2 CPU cores).

Runs go through :func:`dmscale.cli.main` in-process (the console script's entry point);
one test runs ``python -m dmscale`` in a subprocess.
"""

from __future__ import annotations

import importlib.util

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file, load_model

import dmscale as dms
from dmscale.cli import build_parser, main
from dmscale.config.run_config import OPTIONS, RunConfig, load_run_config
from dmscale.run.report import format_summary
from dmscale.tasks.models import SmallCNN

# digits, a 4-channel SmallCNN, 4 steps per epoch
TINY = ["--task", "digits", "--model", "smallcnn", "--model-args", "width=4,blocks=2",
        "--train-limit", "256", "--test-limit", "128", "--batch-size", "64",
        "--threads", "1", "--quiet"]
SEARCH = ["search", *TINY, "--structure-lr", "0.05"]


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def structure_of(run_dir: Path) -> dict:
    s = json.loads((run_dir / "structure.json").read_text())
    return {"width": s["width"], "depth": s["depth"], "layers": s["layers"]}


@pytest.fixture(scope="module")
def searched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One finished np run (search + retrain) shared by the read-only tests."""
    out = tmp_path_factory.mktemp("runs") / "np"
    assert main([*SEARCH, "--epochs", "2", "--out", str(out)]) == 0
    return out


# ----------------------------------------------------------------------------- help and errors
def test_help_explains_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    top = capsys.readouterr().out
    for command in ("pretrain", "search", "retrain", "export", "eval", "report"):
        assert command in top
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = capsys.readouterr().out
        for opt in OPTIONS:
            if command in opt.commands:
                assert opt.flag in text, (command, opt.flag)
        if command in ("pretrain", "search", "retrain"):
            assert "--config" in text and "--resume" in text
    # every option has a help text of its own
    assert all(len(o.help) > 15 for o in OPTIONS)
    assert build_parser().prog == "dmscale"


@pytest.mark.parametrize("args", [
    ["search", "--target", "-1"],
    ["search", "--task", "cifar"],
    ["search", "--epochs", "0"],
    ["search", "--expand", "width=abc"],
    ["search", "--expand", "height=2"],
    ["search", "--model-args", "depth"],
    ["search", "--batch-size", "2.5"],
    ["search", "--pipeline", "np", "--init", "runs/nothing"],
    ["search", "--task", "mnist", "--data", "/nonexistent/mnist"],
    ["search", "--task", "imagefolder"],
    [*SEARCH, "--model", "nosuchnet"],
    [*SEARCH, "--model", "tv:resnet18", "--expand", "width=2"],
    [*SEARCH, "--model", "no_such_pkg_xyz.nets:build"],
    [*SEARCH, "--weights", "/nonexistent/weights.pt"],
    [*SEARCH, "--pretrained"],  # smallcnn: no library weights
    [*SEARCH, "--exclude", "nosuchlayer"],
    [*SEARCH, "--target", "5"],  # 5 MACs: below the smallest reachable model
    [*SEARCH, "--align", "0"],
    [*SEARCH, "--align", "eight"],
    ["eval", "/nonexistent/run"],
    ["report", "/nonexistent/run"],
    ["retrain"],
    ["frobnicate"],
])
def test_bad_values_are_one_line_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                        args: list[str]) -> None:
    try:
        rc = main(args + (["--out", str(tmp_path / "r")] if args[0] == "search" and "--quiet" in args else []))
    except SystemExit as exc:
        rc = exc.code
    out, err = capsys.readouterr()
    assert rc == 2, (args, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("dmscale") and "error:" in lines[0]
    assert "Traceback" not in err


def test_python_m_dmscale_subprocess(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    p = subprocess.run([sys.executable, "-m", "dmscale", "search", "--lr", "fast"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and "--lr" in p.stderr and "Traceback" not in p.stderr
    p = subprocess.run([sys.executable, "-m", "dmscale", "--help"], capture_output=True, text=True,
                       env=env, cwd=tmp_path, timeout=120)
    assert p.returncode == 0 and "dmscale search" in p.stdout


# ----------------------------------------------------------------------------- np pipeline and tools
def test_search_np_writes_a_complete_run(searched: Path) -> None:
    for name in ("config.yaml", "structure.json", "model.safetensors", "metrics.jsonl",
                 "report.md", "summary.json", "state.json", "plots/width.png", "plots/depth.png",
                 "plots/cost.png", "plots/training.png"):
        assert (searched / name).is_file(), name
    assert not (searched / "checkpoint.pt").exists()  # removed once the run is done
    cfg = yaml.safe_load((searched / "config.yaml").read_text())
    assert cfg["pipeline"] == "np" and cfg["model"] == "smallcnn" and cfg["lr"] == 0.05
    summary = json.loads((searched / "summary.json").read_text())
    assert summary["phases"] == ["search", "retrain"]
    res = summary["resources"]
    assert res["hard"] <= res["target"] + 1e-6  # the found model is under the budget
    assert summary["counts"]["found"]["macs"] == res["hard"]
    assert summary["counts"]["found"]["macs"] < summary["counts"]["supernet"]["macs"]
    assert 0.0 <= summary["evals"]["retrain"]["acc"] <= 1.0
    records = [json.loads(line) for line in (searched / "metrics.jsonl").read_text().splitlines()]
    search = [r for r in records if r["phase"] == "search" and "cost_soft" in r]
    assert search and all(r["cost_target"] >= r["cost_final"] - 1e-6 for r in search)
    report = (searched / "report.md").read_text()
    assert "plots/width.png" in report and "supernet" in report


def test_structure_and_weights_rebuild_with_apply_structure(searched: Path) -> None:
    cfg = yaml.safe_load((searched / "config.yaml").read_text())
    model = SmallCNN(in_channels=1, num_classes=10, **cfg["model_args"])
    structure = json.loads((searched / "structure.json").read_text())
    dms.apply_structure(model, structure)
    load_model(model, str(searched / "model.safetensors"))
    x = torch.randn(3, 1, 8, 8)
    assert model.eval()(x).shape == (3, 10)
    summary = json.loads((searched / "summary.json").read_text())
    assert dms.count(model, x[:1])["macs"] == summary["counts"]["found"]["macs"]


def test_eval_report_export(searched: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "eval", searched, "--out", tmp_path / "m.json")
    assert rc == 0 and "accuracy" in out and "MACs" in out
    metrics = json.loads((tmp_path / "m.json").read_text())
    summary = json.loads((searched / "summary.json").read_text())
    assert metrics["acc"] == pytest.approx(summary["evals"]["final"]["acc"])
    assert metrics["macs"] == summary["counts"]["found"]["macs"]

    rc, out, _ = run(capsys, "report", searched, "--out", tmp_path / "rep")
    assert rc == 0 and (tmp_path / "rep" / "report.md").is_file()
    assert (tmp_path / "rep" / "plots" / "cost.png").stat().st_size > 1000

    rc, out, _ = run(capsys, "export", searched, "--format", "pt", "--out", tmp_path / "exp")
    assert rc == 0 and "found model" in out
    assert "model.pt needs dmscale to load (dmscale.tasks.models." in out  # the task's own model classes
    module = torch.load(tmp_path / "exp" / "model.pt", weights_only=False)
    reloaded = load_file(str(tmp_path / "exp" / "model.safetensors"))
    assert torch.equal(module.state_dict()["fc2.weight"], reloaded["fc2.weight"])
    rc, out, _ = run(capsys, "eval", tmp_path / "exp")  # an export is a run directory too
    assert rc == 0 and f"{100 * metrics['acc']:.2f}%" in out


@pytest.mark.skipif(not all(importlib.util.find_spec(p) for p in ("onnx", "onnxscript", "onnxruntime")),
                    reason="onnx/onnxscript/onnxruntime not installed (pip install dmscale[deploy])")
def test_export_onnx_and_pt2(searched: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import onnxruntime as ort

    x = torch.randn(3, 1, 8, 8)  # exported from a batch of 1: the batch size is dynamic
    for fmt in ("onnx", "pt2"):
        rc, out, _ = run(capsys, "export", searched, "--format", fmt, "--out", tmp_path / fmt)
        assert rc == 0 and f"model.{fmt}: input shape (1, 1, 8, 8) (dynamic batch), checked" in out, out
    cfg = yaml.safe_load((searched / "config.yaml").read_text())
    module = SmallCNN(in_channels=1, num_classes=10, **cfg["model_args"])
    dms.load(module, searched)
    with torch.no_grad():
        ref = module.eval()(x)
    sess = ort.InferenceSession(str(tmp_path / "onnx" / "model.onnx"))
    got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    torch.testing.assert_close(torch.from_numpy(got), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.export.load(tmp_path / "pt2" / "model.pt2").module()(x), ref)


def test_retrain_subcommand_from_scratch(searched: Path, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "retrain", searched, "--epochs", "1", "--retrain-init", "scratch",
                     "--batch-size", "64", "--threads", "1", "--out", tmp_path / "rt")
    assert rc == 0 and "after retrain" in out and "report" in out
    assert structure_of(tmp_path / "rt") == structure_of(searched)
    cfg = yaml.safe_load((tmp_path / "rt" / "config.yaml").read_text())
    assert cfg["command"] == "retrain" and cfg["source"] == str(searched)
    rc, out, _ = run(capsys, "eval", tmp_path / "rt")
    assert rc == 0


# ----------------------------------------------------------------------------- p and p- pipelines
def test_pretrain_then_p_minus_trains_only_the_structure(tmp_path: Path) -> None:
    pre = tmp_path / "pre"
    assert main(["pretrain", *TINY, "--epochs", "1", "--out", str(pre)]) == 0
    assert (pre / "model.safetensors").is_file() and not (pre / "structure.json").exists()
    out = tmp_path / "pminus"
    assert main([*SEARCH, "--pipeline", "p-", "--init", str(pre), "--epochs", "1",
                 "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["phases"] == ["search"]  # no pretraining (--init), no retraining
    assert summary["resources"]["hard"] <= summary["resources"]["target"] + 1e-6
    # weights frozen: every exported conv filter is a slice of a pretrained one
    base = load_file(str(pre / "model.safetensors"))
    found = load_file(str(out / "model.safetensors"))
    structure = json.loads((out / "structure.json").read_text())
    spec = structure["layers"]["stage2.0.body.0"]
    w = base["stage2.0.body.0.weight"]
    if spec["out"] is not None:
        w = w[spec["out"]]
    if spec["in"] is not None:
        w = w[:, spec["in"]]
    assert torch.equal(found["stage2.0.body.0.weight"], w)


def test_pipeline_p_with_distillation_from_the_supernet(tmp_path: Path) -> None:
    out = tmp_path / "p"
    assert main([*SEARCH, "--pipeline", "p", "--pretrain-epochs", "1", "--epochs", "1",
                 "--retrain-epochs", "1", "--teacher", "supernet", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["phases"] == ["pretrain", "search", "retrain"]
    assert (out / "supernet.safetensors").is_file()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {r["phase"] for r in records} >= {"pretrain", "search", "retrain"}
    assert any("distill_loss" in r for r in records if r["phase"] == "search")
    assert any("distill_loss" in r for r in records if r["phase"] == "retrain")


def test_teacher_from_a_run_directory_and_expand(tmp_path: Path) -> None:
    pre = tmp_path / "pre"
    assert main(["pretrain", *TINY, "--epochs", "1", "--out", str(pre)]) == 0
    out = tmp_path / "np"
    assert main([*SEARCH, "--expand", "width=2,depth=1.5", "--teacher", str(pre),
                 "--epochs", "1", "--retrain-epochs", "1", "--out", str(out)]) == 0
    structure = json.loads((out / "structure.json").read_text())
    assert [d["size"] for d in structure["width"]][:1] == [8]  # width 4 x 2
    assert [len(d["blocks"]) for d in structure["depth"]] == [3, 3]  # 2 blocks x 1.5


# ----------------------------------------------------------------------------- --align
def test_align_auto_resolves_on_the_run_device_and_is_saved(searched: Path) -> None:
    multiple = 8 if torch.cuda.is_available() else 1  # --device auto: 1 on CPU
    assert yaml.safe_load((searched / "config.yaml").read_text())["align"] == multiple
    summary = json.loads((searched / "summary.json").read_text())
    assert summary["align"]["multiple"] == multiple
    if multiple == 1:
        assert summary["align"]["unaligned"] == []
        assert "align         off" in format_summary(summary)


def test_align_flag_reaches_the_search_and_the_summary(tmp_path: Path, monkeypatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    configs = []
    prepare = dms.prepare
    monkeypatch.setattr(dms, "prepare", lambda m, x, c=None: configs.append(c) or prepare(m, x, c))
    out = tmp_path / "a4"
    rc, _, err = run(capsys, *SEARCH, "--model-args", "width=8,blocks=2", "--align", "4",
                     "--epochs", "1", "--retrain-epochs", "0", "--out", out)
    assert rc == 0, err
    assert [c.align for c in configs] == [4]
    assert yaml.safe_load((out / "config.yaml").read_text())["align"] == 4
    structure = json.loads((out / "structure.json").read_text())
    assert structure["align"] == {"multiple": 4, "unaligned": []}
    assert all(w["kept"] % 4 == 0 for w in structure["width"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["align"] == {"multiple": 4, "unaligned": []}
    assert summary["resources"]["hard"] <= summary["resources"]["target"]  # on the budget
    assert summary["counts"]["found"]["macs"] == summary["resources"]["hard"]
    assert "align         searched widths are multiples of 4" in format_summary(summary)
    assert "- align: searched widths are multiples of 4" in (out / "report.md").read_text()
    # a resume keeps the run's multiple: another is refused, auto takes the saved one
    rc, _, err = run(capsys, "search", "--resume", out, "--align", "8")
    assert rc == 2 and "--align (run: 4, now: 8)" in err
    rc, _, err = run(capsys, "search", "--resume", out, "--align", "auto", "--quiet")
    assert rc == 0, err
    assert yaml.safe_load((out / "config.yaml").read_text())["align"] == 4


def test_a_run_saved_before_align_existed_loads_unaligned(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("command: search\ntask: digits\n")
    assert load_run_config(tmp_path).align == 1
    assert RunConfig().align is None  # auto


# ----------------------------------------------------------------------------- resume
def test_resume_after_interruption_matches_an_uninterrupted_run(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    args = [*SEARCH, "--epochs", "2", "--retrain-epochs", "2", "--checkpoint-every", "3"]
    whole = tmp_path / "whole"
    assert main(args + ["--out", str(whole)]) == 0
    part = tmp_path / "part"
    rc, _, err = run(capsys, *args, "--out", part, "--stop-after", "5")
    assert rc == 0 and "--resume" in err
    assert (part / "checkpoint.pt").is_file()
    state = json.loads((part / "state.json").read_text())
    assert state["status"] == "stopped" and state["global_step"] == 5
    # an option that would change the result cannot change on resume
    rc, _, err = run(capsys, "search", "--resume", part, "--lr", "0.3")
    assert rc == 2 and "--lr" in err
    # second interruption, in a later phase, then the rest
    rc, _, _ = run(capsys, "search", "--resume", part, "--stop-after", "11", "--quiet")
    assert rc == 0 and json.loads((part / "state.json").read_text())["global_step"] == 11
    rc, _, _ = run(capsys, "search", "--resume", part, "--quiet")
    assert rc == 0
    assert structure_of(part) == structure_of(whole)
    a, b = load_file(str(part / "model.safetensors")), load_file(str(whole / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    steps = [json.loads(line)["global_step"] for line in (part / "metrics.jsonl").read_text().splitlines()
             if "event" not in json.loads(line)]
    steps_whole = [json.loads(line)["global_step"] for line in (whole / "metrics.jsonl").read_text().splitlines()
                   if "event" not in json.loads(line)]
    assert steps == sorted(steps) and max(steps) == max(steps_whole)


def test_export_an_unfinished_search_from_its_checkpoint(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    part = tmp_path / "part"
    rc, _, _ = run(capsys, *SEARCH, "--epochs", "2", "--out", part, "--stop-after", "3")
    assert rc == 0
    rc, out, _ = run(capsys, "export", part)
    assert rc == 0 and "unfinished search" in out
    assert (part / "export" / "structure.json").is_file()
    rc, out, _ = run(capsys, "eval", part / "export")
    assert rc == 0 and "accuracy" in out
    rc, _, err = run(capsys, "eval", part)
    assert rc == 2 and "--resume" in err


# ----------------------------------------------------------------------------- config files
def test_config_file_and_flags(tmp_path: Path) -> None:
    conf = tmp_path / "c.yaml"
    conf.write_text(yaml.safe_dump({
        "task": "digits", "model": "smallcnn", "model-args": {"width": 4, "blocks": 1},
        "train_limit": 128, "test-limit": 64, "batch-size": 64, "target": 0.6, "epochs": 1,
        "structure-lr": 0.05, "quiet": True, "threads": 1,
    }))
    out = tmp_path / "run"
    assert main(["search", "--config", str(conf), "--target", "0.7", "--out", str(out)]) == 0
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert cfg["target"] == 0.7 and cfg["model_args"] == {"width": 4, "blocks": 1}
    assert cfg["train_limit"] == 128 and cfg["retrain_epochs"] == 1.0
    # the saved config reproduces the run
    js = tmp_path / "c.json"
    js.write_text(json.dumps({"task": "digits", "bogus_key": 1}))
    assert main(["search", "--config", str(js)]) == 2
    assert main(["search", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert main(["search", "--config", str(conf), "--out", str(out)]) == 2  # run exists


# ----------------------------------------------------------------------------- tasks and models
def test_mnist_from_an_idx_directory(tmp_path: Path) -> None:
    from dmscale.data import write_idx

    rng = np.random.default_rng(0)
    data = tmp_path / "idx"
    data.mkdir()
    for name, n in (("train", 96), ("t10k", 48)):
        write_idx(data / f"{name}-images-idx3-ubyte.gz", rng.integers(0, 255, (n, 28, 28), dtype=np.uint8))
        write_idx(data / f"{name}-labels-idx1-ubyte.gz", rng.integers(0, 10, (n,), dtype=np.uint8))
    out = tmp_path / "run"
    assert main(["search", "--data", str(data), "--model-args", "depth=14,width=4", "--batch-size", "32",
                 "--epochs", "1", "--structure-lr", "0.05", "--threads", "1", "--quiet",
                 "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"].startswith("mnist: 96 training / 48 test images of 1x28x28")
    assert summary["model"] == "resnet"


def test_imagefolder(tmp_path: Path) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("train", 8), ("val", 4)):
        for cls in ("cat", "dog"):
            d = tmp_path / "imgs" / split / cls
            d.mkdir(parents=True)
            for i in range(n):
                Image.fromarray(rng.integers(0, 255, (12, 10, 3), dtype=np.uint8)).save(d / f"{i}.png")
    out = tmp_path / "run"
    assert main(["search", "--task", "imagefolder", "--data", str(tmp_path / "imgs"), "--image-size", "8",
                 "--model", "smallcnn", "--model-args", "width=4,blocks=1", "--batch-size", "8",
                 "--epochs", "1", "--structure-lr", "0.05", "--threads", "1", "--quiet",
                 "--out", str(out)]) == 0
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert cfg["task_info"]["classes"] == ["cat", "dog"] and cfg["task_info"]["in_channels"] == 3


@pytest.mark.parametrize("model", ["tv:resnet18", "timm:resnet18"])
def test_torchvision_and_timm_models_by_name(tmp_path: Path, model: str) -> None:
    out = tmp_path / "run"
    assert main(["search", "--task", "digits", "--model", model, "--train-limit", "64", "--test-limit", "32",
                 "--batch-size", "32", "--epochs", "1", "--retrain-epochs", "0", "--target", "0.6",
                 "--structure-lr", "0.05", "--threads", "1", "--quiet", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["phases"] == ["search"]
    assert summary["counts"]["found"]["macs"] <= summary["resources"]["target"] + 1e-6


def test_language_task_reports_bits_per_character(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "lm"
    rc, text, _ = run(capsys, "search", "--task", "shakespeare", "--model-args", "width=16,hidden=32,blocks=2",
                      "--seq-len", "32", "--train-limit", "16384", "--test-limit", "2048",
                      "--batch-size", "16", "--epochs", "1", "--retrain-epochs", "0.5",
                      "--optimizer", "adamw", "--structure-lr", "0.05", "--threads", "1", "--out", out)
    assert rc == 0 and "bits/char" in text and "perplexity" in text
    summary = json.loads((out / "summary.json").read_text())
    final = summary["evals"]["final"]
    assert final["bpc"] == pytest.approx(final["loss"] / np.log(2))
    assert final["ppl"] == pytest.approx(np.exp(final["loss"]), rel=1e-6)
    assert final["bpc"] < np.log2(80)  # better than uniform over the vocabulary
    assert summary["resources"]["hard"] <= summary["resources"]["target"] + 1e-6
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert cfg["model"] == "charcnn" and len(cfg["task_info"]["vocab"]) > 50
    rc, text, _ = run(capsys, "eval", out)
    assert rc == 0 and "bits/char" in text


def test_language_task_with_a_llama_model(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "llama"
    assert main(["search", "--task", "shakespeare", "--model", "llama", "--model-args",
                 "hidden_size=32,intermediate_size=64,num_hidden_layers=2,num_attention_heads=2,"
                 "num_key_value_heads=2", "--resource", "params", "--target", "0.9",
                 "--seq-len", "16", "--train-limit", "4096", "--test-limit", "512", "--batch-size", "16",
                 "--epochs", "1", "--retrain-epochs", "0", "--optimizer", "adamw", "--structure-lr", "0.05",
                 "--threads", "1", "--quiet", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["counts"]["found"]["params"] <= summary["resources"]["target"] + 1e-6
    assert summary["evals"]["final"]["bpc"] > 0


def test_a_dmscale_error_is_one_line_on_stderr_and_exit_1(monkeypatch, capsys):
    import dmscale.cli as cli

    def refuse(args):
        raise dms.VerificationError("with all masks open Net no longer computes its own output")

    monkeypatch.setattr(cli, "_cmd_export", refuse)
    assert cli.main(["export", "RUN", "--out", "x"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: with all masks open" in err and "Traceback" not in err


def test_print_config_prints_yaml_that_config_takes_back(tmp_path, capsys):
    """--print-config: the resolved options as YAML, nothing trained or written; fed back with
    --config it resolves to the same configuration."""
    import yaml

    from dmscale.config.run_config import RunConfig, load_config_file

    assert main(["search", "--task", "digits", "--target", "0.4", "--structure-lr", "0.02",
                 "--budget-band", "0.95,1.0", "--out", str(tmp_path / "run"), "--print-config"]) == 0
    text = capsys.readouterr().out
    assert not (tmp_path / "run").exists()
    data = yaml.safe_load(text)
    assert data["target"] == 0.4 and data["structure-lr"] == 0.02 and data["budget-band"] == [0.95, 1.0]
    (tmp_path / "c.yaml").write_text(text)
    again = RunConfig(command="search", **load_config_file(tmp_path / "c.yaml", "search")).resolved()
    first = RunConfig(command="search", task="digits", target=0.4, structure_lr=0.02,
                      budget_band=(0.95, 1.0)).resolved()
    # fed back, the values chosen automatically are given explicitly: the same run, nothing auto
    assert {**again.to_dict(), "chosen": {}} == {**first.to_dict(), "chosen": {}} and again.chosen == {}
    assert "optimizer: sgd  # auto for digits" in text and "structure-lr: 0.02\n" in text
    assert main(["search", "--config", str(tmp_path / "c.yaml"), "--print-config"]) == 0
    assert capsys.readouterr().out == text.replace("  # auto for digits", "")


def test_on_off_options_take_x_and_no_x_and_the_old_value_spelling(capsys):
    import yaml

    def resolved(*flags):
        assert main(["search", "--task", "digits", *flags, "--print-config"]) == 0
        return yaml.safe_load(capsys.readouterr().out)

    assert resolved("--no-settle-hold")["settle-hold"] is False
    assert resolved("--settle-hold", "false")["settle-hold"] is False  # the spelling before
    assert resolved("--settle-hold")["settle-hold"] is True
    got = resolved("--layer-uniform", "--compile")
    assert got["layer-uniform"] is True and got["compile"] is True
    assert resolved("--layer-uniform", "--no-layer-uniform")["layer-uniform"] is False  # the last wins
    with pytest.raises(SystemExit):
        main(["search", "--no-compile", "yes"])
    assert "--no-compile takes no value" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["search", "--help"])
    assert "--settle-hold, --no-settle-hold" in capsys.readouterr().out
