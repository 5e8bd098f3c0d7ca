"""report.md, its plots and the one-screen summary, from a synthetic run directory."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from dmscale.run.report import format_summary, read_metrics, write_report


def fake_run(path: Path, with_structure: bool = True) -> Path:
    path.mkdir()
    (path / "config.yaml").write_text(yaml.safe_dump({
        "command": "search", "pipeline": "np", "task": "mnist", "model": "resnet",
        "model_args": {"width": 8}, "resource": "macs",
        "task_info": {"kind": "classification", "num_classes": 10}}))
    if with_structure:
        (path / "structure.json").write_text(json.dumps({
            "width": [{"name": "conv1", "size": 8, "kept": 5, "producers": ["conv1"]},
                      {"name": "layer2.0.conv1", "size": 16, "kept": 9, "producers": []}],
            "depth": [{"name": "layer1", "blocks": ["layer1.0", "layer1.1"], "kept": ["layer1.0"]}],
            "layers": {}}))
    state = {"status": "done", "global_step": 20, "elapsed": 12.0, "warnings": [],
             "counts": {"supernet": {"macs": 8_000_000, "params": 70_000},
                        "found": {"macs": 3_900_000, "params": 30_000}},
             "evals": {"search": {"acc": 0.9, "loss": 0.3}, "retrain": {"acc": 0.97, "loss": 0.1},
                       "final": {"acc": 0.97, "loss": 0.1}},
             "resources": {"resource": "macs", "soft": 3.8e6, "hard": 3.9e6, "target": 4e6, "supernet": 8e6}}
    (path / "state.json").write_text(json.dumps(state))
    lines = []
    for step in range(1, 11):
        lines.append({"phase": "search", "step": step, "global_step": step, "task_loss": 2.0 / step,
                      "train_acc": 0.1 * step, "cost_soft": 8e6 - 4e5 * step, "cost_hard": 8e6 - 4e5 * step,
                      "cost_target": 8e6 * 0.5 ** (step / 10), "cost_final": 4e6, "cost_supernet": 8e6})
    lines.append({"phase": "search", "event": "eval", "step": 10, "global_step": 10, "acc": 0.9})
    for step in range(1, 11):
        lines.append({"phase": "retrain", "step": step, "global_step": 10 + step, "task_loss": 0.2,
                      "train_acc": 0.95})
    text = "\n".join(json.dumps(x) for x in lines) + '\n{"phase": "retr'  # a torn last line
    (path / "metrics.jsonl").write_text(text)
    return path


def test_report_with_all_plots(tmp_path: Path) -> None:
    run = fake_run(tmp_path / "run")
    assert len(read_metrics(run)) == 21
    report = write_report(run)
    text = report.read_text()
    for name in ("width", "depth", "cost", "training"):
        assert (run / "plots" / f"{name}.png").stat().st_size > 1000
        assert f"plots/{name}.png" in text
    assert "| conv1 | `conv1` | 8 | 5 |" in text and "| layer1 | 2 | 1 |" in text
    assert "97.00% test accuracy" in text and "3.90M" in text


def test_report_of_a_pretrain_run_has_no_structure_plots(tmp_path: Path) -> None:
    run = fake_run(tmp_path / "run", with_structure=False)
    out = tmp_path / "elsewhere"
    write_report(run, out)
    assert not (out / "plots" / "width.png").exists()
    assert (out / "plots" / "training.png").exists()


def test_summary_screen() -> None:
    summary = {"command": "search", "elapsed": 200.0, "steps": 936, "phases": ["search", "retrain"],
               "task": "mnist: 60,000 training / 10,000 test images", "task_kind": "classification",
               "model": "resnet", "model_args": {"width": 8}, "expand": None,
               "counts": {"supernet": {"macs": 7.8e6, "params": 7e4}, "found": {"macs": 3.8e6, "params": 3e4}},
               "resources": {"resource": "macs", "hard": 3.8e6, "target": 3.9e6},
               "evals": {"search": {"acc": 0.95}, "retrain": {"acc": 0.99}, "final": {"acc": 0.99}},
               "structure": {"width": [["conv1", 8, 5]], "depth": [["layer1", 3, 2]]},
               "warnings": [], "run_dir": "runs/x", "report": "runs/x/report.md"}
    text = format_summary(summary)
    assert "7.80M" in text and "3.80M" in text and "<= target" in text
    assert "layer1: 2/3" in text and "99.00%" in text and "runs/x/report.md" in text
    assert len(text.splitlines()) < 25  # one screen
    summary["resources"]["hard"] = 4e6
    assert "OVER target" in format_summary(summary)


def test_summary_and_report_say_how_the_masked_norms_ran(tmp_path: Path) -> None:
    summary = {"command": "search", "elapsed": 1.0, "steps": 1, "phases": ["search"], "task": "mnist",
               "task_kind": "classification", "model": "resnet", "evals": {}, "counts": {}, "warnings": [],
               "run_dir": "runs/x", "fused_norms": {"compiled": ["layer_norm"], "failure": None}}
    assert "masked norms  compiled into fused kernels (layer_norm)" in format_summary(summary)
    summary["fused_norms"] = {"compiled": [], "failure": "BackendCompilerFailed: no compiler"}
    assert "eager: compiling them failed (BackendCompilerFailed: no compiler)" in format_summary(summary)
    summary["fused_norms"] = None  # eager as always (a CPU run): nothing said
    assert "masked norms" not in format_summary(summary)
    run = fake_run(tmp_path / "run")
    (run / "summary.json").write_text(json.dumps({"fused_norms": {"compiled": ["rms_rescale"], "failure": None}}))
    assert "- masked norms: compiled into fused kernels (rms_rescale)" in write_report(run).read_text()
