"""bench/gpu_session.py: issue 29's GPU steps in one call, each within its limit and all within
the session's budget; its CPU smoke run writes every step's results."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
from bench import gpu_check  # noqa: E402
from bench import gpu_session  # noqa: E402


def test_the_steps_fit_the_budget_and_ask_gpu_check_for_the_fold_batch_rows(tmp_path: Path) -> None:
    plan = gpu_session.steps(tmp_path, "abc1234")
    assert [s.name for s in plan] == ["train", "profile", "latency"]
    assert sum(s.limit_s for s in plan) <= 540
    train = plan[0].argv
    assert train[:2] == ["-m", "bench.gpu_check"]
    args = gpu_check._parse(train[2:])
    keys = [j["key"] for j in gpu_check.plan(args)]
    # the batch's question first: the new code with and without it, per model, before the compiled rows
    assert keys[:6] == ["new/vit_b16", "new/llama_135m", "new/resnet50", "new+per_layer_folds/vit_b16",
                        "new+per_layer_folds/llama_135m", "new+per_layer_folds/resnet50"]
    assert args.budget_s + args.grace_s <= plan[0].limit_s
    assert "--device" in plan[2].argv and "cuda" in plan[2].argv


def test_a_dry_run_prints_the_steps(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    gpu_session.main([str(tmp_path / "out"), "--dry-run", "--commit", "abc1234"])
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split(" ")[0] for ln in lines] == ["train", "profile", "latency"]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_quick_session_runs_every_step_on_the_cpu(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    gpu_session.main([str(tmp_path), "--quick", "--commit", "abc1234"])
    said = capsys.readouterr().out
    assert said.count("exit 0") == 3, said + "".join(p.read_text()[-2000:] for p in tmp_path.glob("*.log"))
    assert (tmp_path / "train" / "gpu_check.md").is_file()
    assert (tmp_path / "profile" / "gpu_profile.md").is_file()
    assert list((tmp_path / "latency").rglob("*.md"))
