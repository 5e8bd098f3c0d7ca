"""bench/gpu_check.py (issue 29): the snapshot of today's code, the quick smoke run on CPU of
both tables with both implementations each in its own process, and tables that keep every
row and column whatever was measured (a spent budget, a missing snapshot, a worker stopped
half-way)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
from bench import gpu_check  # noqa: E402

T1_COLS, T2_COLS = 12, 9


def _tables(md: str) -> tuple[list[list[str]], list[list[str]]]:
    """The data rows of table 1 and table 2, split into cells."""
    t1, t2 = md.split("## Table 1")[1].split("## Table 2")
    t2 = t2.split("## Notes")[0]

    def rows(text: str) -> list[list[str]]:
        lines = [ln for ln in text.splitlines() if ln.startswith("| ") and not ln.startswith("| model")]
        return [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in lines]
    return rows(t1), rows(t2)


def _git_head() -> str:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    proc = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        pytest.skip("not a git checkout")
    return proc.stdout.strip()


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """HEAD's src/dmscale, snapshotted as today's code."""
    head = _git_head()
    src = tmp_path_factory.mktemp("baseline") / "src"
    assert gpu_check.make_baseline("HEAD", src) == head
    return src


def test_make_baseline_extracts_the_package_and_names_its_commit(baseline: Path) -> None:
    assert (baseline / "dmscale" / "__init__.py").is_file()
    assert (baseline.parent / "COMMIT").read_text().strip() == _git_head()
    assert not (baseline / "dmscale" / "cli.py").is_symlink()
    info = gpu_check._impl_info(baseline, None)
    assert info["present"] and info["commit"] == _git_head()[:7]
    dirty = subprocess.run(["git", "status", "--porcelain", "src"], cwd=ROOT, capture_output=True, text=True).stdout
    if not dirty:  # the same code, wherever it lies: the same digest
        assert info["digest"] == gpu_check.src_digest(ROOT / "src")


def test_a_spent_budget_and_a_missing_snapshot_still_give_every_row(tmp_path: Path) -> None:
    gpu_check.main(["--quick", "--out", str(tmp_path), "--budget-s", "0", "--baseline-src", str(tmp_path / "none" / "src")])
    t1, t2 = _tables((tmp_path / "gpu_check.md").read_text())
    assert [r[0] for r in t1] == ["resnet50", "resnet50", "vit_b16", "vit_b16", "llama_135m", "llama_135m"]
    assert {len(r) for r in t1} == {T1_COLS} and {len(r) for r in t2} == {T2_COLS}
    assert [r[0] for r in t2] == list(gpu_check.EXPORT_MODELS)
    assert all(r[3] == "n/a" for r in t1[0::2]) and all(r[3] == "skipped" for r in t1[1::2])
    state = json.loads((tmp_path / "gpu_check.json").read_text())
    assert state["impls"]["today"]["present"] is False and state["run"]["finished"]
    assert "make it: python -m bench.gpu_check --make-baseline COMMIT" in state["jobs"]["today/resnet50"]["na"]


def test_a_worker_stopped_after_the_plain_arm_leaves_its_numbers() -> None:
    state = {"run": {"command": "c", "date": "d", "elapsed_s": 1, "budget_s": 9, "quick": False, "device": "cuda",
                     "host": "h", "models": ["resnet50"], "compile": ["module"]},
             "impls": {k: {"commit": "abc", "digest": "0", "src": "s", "present": True} for k in gpu_check.IMPLS},
             "notes": [], "jobs": {"today/resnet50": {
                 "status": "running", "env": {"gpu": "NVIDIA H100", "torch": "2.11"},
                 "train": {"input": "x", "batch": 64, "plain": {"median_ms": 50.0, "peak_gib": 10.0, "kernels": 300,
                                                              "counted": "CUDA kernels"}},
                 "export": {"exports": {"today": {"macs_ratio": 0.5, "widths_mult8": 3, "widths": 10,
                                                  "fused_attn": None}}}}}}
    md = gpu_check.render(state)
    t1, t2 = _tables(md)
    assert t1[0][3] == "50.0" and t1[0][4] == "not reached" and t1[0][6] == "10.00 -> n/a"
    assert [r[1] for r in t1] == ["today (`abc`)", "new (`abc`)", "new + torch.compile(model) (`abc`)"]
    assert {len(r) for r in t1} == {T1_COLS} and {len(r) for r in t2} == {T2_COLS}
    assert "NVIDIA H100" in md and "(running)" in md


def _quick(baseline: Path, out: Path, models: list[str], *extra: str) -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--quick", "--out", str(out),
                           "--baseline-src", str(baseline), "--models", *models, *extra],
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "gpu_check.json").read_text()), (out / "gpu_check.md").read_text()


def _check_quick(state: dict, md: str, models: list[str]) -> None:
    t1, t2 = _tables(md)
    trained = [m for m in models if m in gpu_check.TRAIN_MODELS]
    assert [r[0] for r in t1] == [m for m in trained for _ in gpu_check.IMPLS]
    assert [r[0] for r in t2] == [m for m in models for _ in ("batch 2", "batch 1")]
    assert {len(r) for r in t1} == {T1_COLS} and {len(r) for r in t2} == {T2_COLS}
    for key, job in state["jobs"].items():
        assert job["status"] == "done" and job["returncode"] == 0, key
        assert Path(job["env"]["dmscale_file"]).is_relative_to(Path(state["impls"][job["impl"]]["src"]))
        for arm in ("plain", "dms") if job["model"] in trained else ():
            assert job["train"][arm]["median_ms"] > 0 and job["train"][arm]["counted"] == "CPU aten ops (nested)"
        assert set(job["export"]["latency"]) == {"2", "1"}, key
        assert all("error" not in e for e in job["export"]["exports"].values()), key
    assert all(c != "error" for row in t1 + t2 for c in row)
    assert all(float(r[3]) > 0 and float(r[5]) > 0 for r in t1)  # plain ms, DMS / plain
    assert all("x)" in r[3] and "x)" in r[4] for r in t2)  # today and new (align 1 or the default) measured
    assert state["impls"]["today"]["commit"] == _git_head()[:7]


@pytest.mark.slow  # ~30 s on 2 cores; the plan, the worker and the table code are tested below
def test_quick_run_measures_both_tables_with_both_implementations(baseline: Path, tmp_path: Path) -> None:
    models = ["vit_b16", "llama_135m"]  # the two transformers: ~30 s on 2 shared cores
    state, md = _quick(baseline, tmp_path, models)
    _check_quick(state, md, models)
    vit = state["jobs"]["today/vit_b16"]["export"]["exports"]["today"]
    assert vit["fused_attn"][1] >= 1 and "fused attn" in md


@pytest.mark.slow
def test_quick_run_of_every_model(baseline: Path, tmp_path: Path) -> None:
    models = [m for m in gpu_check.EXPORT_MODELS if not gpu_check.SPECS[m].needs
              or importlib.util.find_spec(gpu_check.SPECS[m].needs)]
    state, md = _quick(baseline, tmp_path, models)  # ~80 s with YOLOv8n
    _check_quick(state, md, models)


def test_a_worker_that_dies_before_writing_reads_error(tmp_path: Path) -> None:
    broken = tmp_path / "broken" / "src"
    (broken / "dmscale").mkdir(parents=True)
    (broken / "dmscale" / "__init__.py").write_text("raise ImportError('broken on purpose')\n")
    gpu_check.main(["--quick", "--models", "resnet50", "--tables", "2", "--out", str(tmp_path / "out"),
                    "--baseline-src", str(broken), "--new-src", str(broken)])
    md = (tmp_path / "out" / "gpu_check.md").read_text()
    _, t2 = _tables(md)
    assert [r[3:6] for r in t2] == [["error"] * 3]
    assert "- today/resnet50: the worker exited with 1 before writing results" in md
    state = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert "broken on purpose" in state["jobs"]["new/resnet50"]["log_tail"]


@pytest.mark.slow
def test_eager_norms_and_per_layer_rows_run_the_new_code_with_that_switched_off(baseline: Path,
                                                                               tmp_path: Path) -> None:
    state, md = _quick(baseline, tmp_path, ["vit_b16"], "--tables", "1", "--eager-norms", "--per-layer-folds")
    job = state["jobs"]["new+eager_norms/vit_b16"]
    assert job["train"]["dms"]["median_ms"] > 0 and not job["train"]["fused_norms"]["compiled"]
    job = state["jobs"]["new+per_layer_folds/vit_b16"]
    assert job["train"]["dms"]["median_ms"] > 0 and job["train"]["fold_batch"] is False
    assert state["jobs"]["new/vit_b16"]["train"]["fold_batch"] is None
    t1, _ = _tables(md)
    assert len(t1) == 4 and "fuse_norms=False" in t1[2][1] and "per-layer folds" in t1[3][1]


def test_the_plan_can_leave_today_s_code_out_and_add_the_cuda_graph_rows() -> None:
    args = gpu_check._parse(["--models", "vit_b16", "--tables", "1", "--impls", "new", "--compile", "module",
                             "module_cudagraphs"])
    assert [j["key"] for j in gpu_check.plan(args)] == [
        "new/vit_b16", "new+compile_module/vit_b16", "new+compile_module_cudagraphs/vit_b16"]
    assert [j["key"] for j in gpu_check.plan(gpu_check._parse(["--models", "resnet50", "--tables", "1"]))] == [
        "today/resnet50", "new/resnet50"]
    assert gpu_check._parse(["--compile"]).compile == ["forward", "module"]
    args = gpu_check._parse(["--models", "vit_b16", "yolov8n", "--tables", "1", "--impls", "new", "--per-layer-folds"])
    assert [(j["key"], j.get("fold_batch")) for j in gpu_check.plan(args)] == [
        ("new/vit_b16", None), ("new+per_layer_folds/vit_b16", False)]
    args = gpu_check._parse(["--models", "vit_b16", "--tables", "1", "--compile", "module", "--compile-today"])
    assert [j["key"] for j in gpu_check.plan(args)] == [
        "today/vit_b16", "new/vit_b16", "today+compile_module/vit_b16", "new+compile_module/vit_b16"]


def test_compiled_rows_of_today_s_code_are_in_table_1_when_asked_for(tmp_path: Path) -> None:
    gpu_check.main(["--quick", "--out", str(tmp_path), "--budget-s", "0", "--models", "vit_b16", "--tables", "1",
                    "--compile", "module", "--compile-today", "--baseline-src", str(tmp_path / "none" / "src")])
    t1, _ = _tables((tmp_path / "gpu_check.md").read_text())
    assert [r[1].split(" (")[0] for r in t1] == ["today", "new", "today + torch.compile(model)",
                                                 "new + torch.compile(model)"]
    assert {len(r) for r in t1} == {T1_COLS}
