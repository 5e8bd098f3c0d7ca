"""``torchrun --nproc_per_node 2 -m dmscale search`` (issue 11): two CPU processes (gloo).

On the tiny digits config with a BatchNorm-free SmallCNN (``norm=false``: a sample's output
does not depend on the rest of its batch, so two shards of 32 compute what one batch of 64
does):

* the run completes, writes one run directory, prints one summary naming 2 processes, and
  finds the structure one process finds with the same seed and global batch size;
* ``--stop-after`` then ``--resume`` under torchrun ends with the structure and weights of
  the uninterrupted torchrun run;
* a second run into the same directory fails with one error message and no hang (``slow``);
* a stopped run exits cleanly on every rank (once here; four times under ``slow``);
* ``--shard fsdp`` (FSDP2 instead of DDP) finds the structure and weights of the DDP run, and
  (``slow``) ``--stop-after`` then ``--resume`` under it ends where the uninterrupted run does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dmscale.cli import main
from dmscale.config.run_config import RunConfig
from dmscale.core.errors import ConfigError
from torchrun_util import run_group

__all__: list[str] = []

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
ARGS = ["search", "--task", "digits", "--model", "smallcnn", "--model-args", "width=4,blocks=2,norm=false",
        "--train-limit", "256", "--test-limit", "64", "--batch-size", "64", "--threads", "1",
        "--structure-lr", "0.05", "--epochs", "2", "--retrain-epochs", "0.5", "--checkpoint-every", "2",
        "--seed", "0"]


def torchrun(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    return run_group([*TORCHRUN, "-m", "dmscale", *args], cwd=ROOT, env=env, timeout=300)


def _structure(run: Path) -> dict:
    s = json.loads((run / "structure.json").read_text())
    return {k: s[k] for k in ("width", "depth", "layers")}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    out = tmp_path_factory.mktemp("torchrun") / "run"
    return out, torchrun(*ARGS, "--out", str(out))


def test_two_processes_write_one_run_and_one_summary(two_ranks: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    out, proc = two_ranks
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in out.parent.iterdir()) == ["run"]
    assert proc.stdout.count("dmscale search finished") == 1, proc.stdout
    assert "2 processes" in proc.stdout
    assert proc.stderr.count("run directory:") == 1  # rank 0 logs, rank 1 is silent
    summary = json.loads((out / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["phases"] == ["search", "retrain"]
    assert not (out / "checkpoint.pt").exists() and (out / "report.md").is_file()
    assert summary["resources"]["hard"] <= summary["resources"]["target"] * (1 + 1e-9)


def test_depth_freezing_needs_no_find_unused_parameters(two_ranks: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    """The settle phase lands (hard cost at the target within the search) and freezes depth;
    the loop wraps the model again without depth's ``a``, so DDP never needs
    ``find_unused_parameters`` and torch's warning about it (one per rank) is gone."""
    out, proc = two_ranks
    assert proc.returncode == 0, proc.stderr[-3000:]
    end = json.loads((out / "summary.json").read_text())["resources_search_end"]
    assert end["hard"] <= end["target"], end  # landed: depth was frozen during the search
    assert "find_unused_parameters" not in proc.stderr, proc.stderr[-3000:]


def test_two_processes_find_what_one_process_finds(two_ranks: tuple[Path, subprocess.CompletedProcess[str]],
                                                    tmp_path: Path) -> None:
    out, proc = two_ranks
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = tmp_path / "one"
    assert main([*ARGS, "--quiet", "--out", str(one)]) == 0
    assert json.loads((one / "summary.json").read_text())["processes"] == 1
    assert _structure(one) == _structure(out), "2 x 32 samples found another structure than 1 x 64"


def test_stop_after_then_resume_under_torchrun(two_ranks: tuple[Path, subprocess.CompletedProcess[str]],
                                               tmp_path: Path) -> None:
    whole, _ = two_ranks
    out = tmp_path / "run"
    stopped = torchrun(*ARGS, "--quiet", "--stop-after", "5", "--out", str(out))
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert stopped.stderr.count("stopped after 5 steps") == 1
    assert "terminate called" not in stopped.stderr  # (the ranks leave together: see the next test)
    assert (out / "checkpoint.pt").is_file() and not (out / "summary.json").exists()
    resumed = torchrun("search", "--resume", str(out), "--quiet")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _structure(out) == _structure(whole), "the resumed run found another structure"
    wa, wb = load_file(str(out / "model.safetensors")), load_file(str(whole / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), "weights differ"
    assert json.loads((out / "summary.json").read_text())["processes"] == 2


@pytest.mark.slow  # four torchrun launches (~30 s); the default run stops once, in the resume test
def test_a_stopped_torchrun_exits_cleanly_on_every_rank(tmp_path: Path) -> None:
    """Regression: a rank that destroyed the gloo process group while the other still used it
    aborted at exit ("terminate called without an active exception", exit -6) on about 1 stop
    in 4; the ranks now leave together. Four stops: the old code passed all four 1 time in 3."""
    for i in range(4):
        stopped = torchrun(*ARGS, "--quiet", "--stop-after", "5", "--out", str(tmp_path / f"run{i}"))
        assert stopped.returncode == 0, f"stop {i}: " + stopped.stderr[-2000:]
        assert "terminate called" not in stopped.stderr


@pytest.mark.slow  # one more torchrun launch (~10 s of imports): keeps the default run of this file < 90 s
def test_existing_run_is_one_error_on_every_rank(two_ranks: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    out, _ = two_ranks
    proc = torchrun(*ARGS, "--quiet", "--out", str(out))
    assert proc.returncode != 0
    assert proc.stderr.count("already holds a run") == 1, proc.stderr[-3000:]


@pytest.mark.parametrize("extra", [{"precision": "fp16"}, {"compile": True}])
def test_fsdp_refuses_fp16_and_compile_with_the_fix(extra: dict) -> None:
    with pytest.raises(ConfigError, match="--shard fsdp does not run with .* or --shard none"):
        RunConfig(shard="fsdp", **extra)
    assert RunConfig(shard="fsdp", precision="bf16").shard == "fsdp"
    assert RunConfig().shard == "none"


@pytest.fixture(scope="module")
def fsdp_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    out = tmp_path_factory.mktemp("torchrun_fsdp") / "run"
    return out, torchrun(*ARGS, "--shard", "fsdp", "--quiet", "--out", str(out))


def test_fsdp_finds_the_structure_and_weights_of_ddp(two_ranks: tuple[Path, subprocess.CompletedProcess[str]],
                                                     fsdp_ranks: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    """Search (weights sharded per residual block, gates replicated), export gathered on rank
    0, retrain sharded again, checkpoints gathered: the DDP run's results, to float rounding."""
    (ddp, _), (out, proc) = two_ranks, fsdp_ranks
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["processes"] == 2
    assert _structure(out) == _structure(ddp), "FSDP found another structure than DDP"
    wa, wb = load_file(str(out / "model.safetensors")), load_file(str(ddp / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # two more torchrun launches
def test_stop_after_then_resume_under_fsdp(fsdp_ranks: tuple[Path, subprocess.CompletedProcess[str]],
                                          tmp_path: Path) -> None:
    """The checkpoint holds the full model and optimizer state gathered on rank 0; every rank
    loads its shards from it on --resume."""
    whole, _ = fsdp_ranks
    out = tmp_path / "run"
    stopped = torchrun(*ARGS, "--shard", "fsdp", "--quiet", "--stop-after", "5", "--out", str(out))
    assert stopped.returncode == 0 and (out / "checkpoint.pt").is_file(), stopped.stderr[-3000:]
    resumed = torchrun("search", "--resume", str(out), "--quiet")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _structure(out) == _structure(whole), "the resumed run found another structure"
    wa, wb = load_file(str(out / "model.safetensors")), load_file(str(whole / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), "weights differ"


def test_fewer_gpus_than_local_ranks_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from dmscale.engine.device import resolve_device

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match="local rank 1 has no GPU.*--nproc_per_node 1"):
        resolve_device("cuda")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert resolve_device("auto") == torch.device("cuda", 0)
