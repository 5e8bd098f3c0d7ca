"""bench/deploy_latency.py's bf16 device table (``--device cuda``; ``--bf16`` runs the same
path on the CPU): its own json and md, every column whatever an engine gives, onnxruntime
timers that work, and an engine or a model that fails leaves the others' numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
from bench import deploy_latency  # noqa: E402
from bench.lib import deploy_models  # noqa: E402

RESULTS = ROOT / "bench" / "results"
COLS = 15


def _rows(md: str) -> list[list[str]]:
    lines = [ln for ln in md.splitlines() if ln.startswith("| ") and not ln.startswith("| model")]
    return [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in lines]


def _quick(tmp_path: Path, *extra: str) -> list[list[str]]:
    before = {p: p.stat().st_mtime_ns for p in RESULTS.glob("deploy_latency*")}
    proc = subprocess.run([sys.executable, "-m", "bench.deploy_latency", "--quick", "--bf16",
                           "--workdir", str(tmp_path), *extra], env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {p: p.stat().st_mtime_ns for p in RESULTS.glob("deploy_latency*")} == before
    cache = json.loads((tmp_path / "quick" / "deploy_latency_cpu.json").read_text())
    assert cache["models"]["resnet18 (torchvision)"]["dtype"] == "bfloat16"
    rows = _rows((tmp_path / "quick" / "deploy_latency_cpu.md").read_text())
    assert [r[2] for r in rows] == ["1", "2"] and {len(r) for r in rows} == {COLS}
    assert all(float(r[4].split()[0]) > 0 and float(r[6]) > 0 for r in rows)  # eager orig, eager ratio
    assert all(r[10:13] == ["n/a"] * 3 for r in rows)  # no CUDA execution provider on the CPU path
    return rows


def test_quick_bf16_table_without_compile(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    rows = _quick(tmp_path, "--no-compile")  # ~10 s
    assert all(r[7:10] == ["n/a"] * 3 for r in rows)


@pytest.mark.slow
def test_quick_bf16_table_with_compile(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    rows = _quick(tmp_path)  # ~2 min on 2 shared cores: inductor compiles 4 graphs
    assert all(float(r[7].split()[0]) > 0 and float(r[9]) > 0 for r in rows)


def _net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


def test_onnxruntime_timers_run_the_exported_files(tmp_path: Path) -> None:
    """The sessions the CUDA path builds (the CPU provider stands in here) time both nets."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    torch.manual_seed(0)
    nets = {"orig": _net().eval(), "pruned": _net().eval()}
    sessions = deploy_latency._ort_cuda_sessions(nets, torch.randn(1, 3, 16, 16), [1, 2], tmp_path)
    for m in nets.values():  # as bench_one_device does: bfloat16 after the float32 ONNX export
        m.to(torch.bfloat16)
    timers = deploy_latency._device_timers(nets, {}, sessions, 2, 16, torch.device("cpu"))
    assert list(timers) == ["eager_orig", "eager_pruned", "ort_orig", "ort_pruned"]
    assert all(t() > 0 for t in timers.values())


def test_a_failing_engine_is_listed_and_left_out() -> None:
    errors: list[str] = []

    def boom() -> float:
        raise RuntimeError("no compiler")
    kept = deploy_latency._working({"eager_orig": lambda: 1.0, "compile_orig": boom}, errors, 64)
    assert list(kept) == ["eager_orig"] and errors == ["compile_orig at batch 64: RuntimeError: no compiler"]


def test_render_device_keeps_its_columns_with_missing_engines_and_failed_models() -> None:
    q = [1.0, 2.0, 3.0]
    run = {"command": "c", "commit": "abc", "machine": "m"}
    cache = {"models": {"resnet18 (torchvision)": {
        "size": 224, "macs_ratio": 0.5, "ort": "n/a (no CUDA execution provider)", "run": run,
        "errors": ["compile_pruned at batch 64: RuntimeError: x"],
        "batches": {"64": {"rounds": 5, "eager_orig": q, "eager_pruned": q, "compile_orig": q}}}},
        "failed": {"yolov8n (ultralytics)": "ImportError: no ultralytics (c)"}}
    md = deploy_latency.render_device(cache, "cuda")
    rows = _rows(md)
    assert len(rows) == 1 and len(rows[0]) == COLS
    assert rows[0][6] == "1.00" and rows[0][8:10] == ["n/a", "n/a"] and rows[0][14] == "A"
    assert "compile_pruned at batch 64" in md and "yolov8n (ultralytics): not measured" in md


def test_the_device_table_times_a_language_model_on_token_ids(tmp_path: Path) -> None:
    """The Llama row: token ids in, pruned to half the MACs, both nets timed in bfloat16; no
    ONNX for token inputs (n/a, not an error)."""
    pytest.importorskip("transformers")
    entry = deploy_latency.bench_one_device(deploy_models._llama(small=True), 16, torch.device("cpu"), {1: 1, 2: 1},
                                            tmp_path, compile_=False, vocab=256)
    assert entry["errors"] == [] and entry["ort"].startswith("n/a")
    assert 0.45 <= entry["macs_ratio"] <= 0.5
    for b in ("1", "2"):
        r = entry["batches"][b]
        assert set(r) >= {"eager_orig", "eager_pruned"} and all(v > 0 for v in r["eager_orig"])
    assert deploy_latency.example(2, 16, 256).dtype == torch.long
    assert "llama_smollm2_shape (transformers)" in deploy_latency.models(deploy_sizes=True)
