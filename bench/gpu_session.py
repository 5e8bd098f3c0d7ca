"""Issue 29's GPU evidence in one call: the prepared benchmarks in order of what they decide, each
with its own time limit, under one deadline.

    python -m bench.gpu_session OUT [--commit HASH] [--budget-s 540]
    python -m bench.gpu_session OUT --quick     # the same steps as CPU smoke runs (tiny models)
    python -m bench.gpu_session OUT --dry-run   # print the steps and their limits

Steps (each a subprocess with ``PYTHONPATH=src:tests:bench:bench/lib``, its output under
``OUT/<step>``, its log in ``OUT/<step>.log``; a step that fails or runs out of time does not stop
the next):

1. ``train``: ``gpu_check.py`` table 1 for ViT-B/16, the SmolLM2-shaped Llama and ResNet-50 (bf16,
   the issue's batches), the new code eager, with its fold batch off (``--per-layer-folds``: does
   the batch pay on a GPU?) and under ``torch.compile(model)`` with and without CUDA graphs;
2. ``profile``: ``gpu_profile.py``: one profiled step of ViT-B and the Llama (kernels, host time
   per CUDA runtime call, where the host waited for the device);
3. ``latency``: ``latency_target.py --device cuda --bf16``: ViT-B and ResNet-50 searched at half
   their MACs and at half their measured GPU latency, each export timed against the original.

Copy what comes back into ``bench/results/`` (``gpu_check.{json,md}``, ``gpu_profile.md``,
``latency_target_cuda.{json,md}``) and say the device in the commit. Needs no baseline snapshot
(``gpu_check.py --make-baseline`` adds today's-code rows to a separate run).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["Step", "steps", "main"]


@dataclass(frozen=True)
class Step:
    """One benchmark of the session: its name (the folder and log under OUT), its arguments
    after ``python``, and the seconds it may run."""

    name: str
    argv: list[str]
    limit_s: int


def steps(out: Path, commit: str, quick: bool = False) -> list[Step]:
    """The session's steps in the order they run (the first answers the first question)."""
    if quick:
        return [
            Step("train", ["-m", "bench.gpu_check", "--quick", "--out", str(out / "train"), "--new-commit", commit,
                           "--models", "vit_b16", "--tables", "1", "--impls", "new", "--per-layer-folds"], 240),
            Step("profile", ["-m", "bench.gpu_profile", "--quick", "--models", "vit_b16", "--out",
                             str(out / "profile")], 240),
            Step("latency", ["-m", "bench.latency_target", "--quick", "--workdir", str(out / "latency")], 240),
        ]
    return [
        Step("train", ["-m", "bench.gpu_check", "--out", str(out / "train"), "--new-commit", commit,
                       "--models", "vit_b16", "llama_135m", "resnet50", "--tables", "1", "--impls", "new",
                       "--per-layer-folds", "--compile", "module", "module_cudagraphs",
                       "--budget-s", "270", "--grace-s", "30"], 320),
        Step("profile", ["-m", "bench.gpu_profile", "--models", "vit_b16", "llama_135m", "--out",
                         str(out / "profile")], 100),
        Step("latency", ["-m", "bench.latency_target", "--device", "cuda", "--bf16", "--models", "vit_base", "resnet50",
                         "--batches", "64", "--runs", "1", "--budget-s", "10", "--rounds", "15",
                         "--out", str(out / "latency")], 120),
    ]


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip() or "unknown"
    except (OSError, subprocess.CalledProcessError):
        return "unknown"  # (a copy of the tree without its git folder)


def _run(step: Step, out: Path, limit_s: float) -> str:
    """Run one step with its output logged; its outcome in words."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(ROOT / p) for p in ("src", "tests")))
    t0 = time.time()
    with open(out / f"{step.name}.log", "w") as log:
        proc = subprocess.Popen([sys.executable, *step.argv], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            return f"stopped after {limit_s:.0f} s (what it wrote so far is kept)"
    return f"exit {rc} in {time.time() - t0:.0f} s"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="folder of every step's results and log")
    ap.add_argument("--commit", default=None, help="the commit measured (default: git's HEAD, else 'unknown')")
    ap.add_argument("--budget-s", type=float, default=540.0, help="no step starts after this many seconds")
    ap.add_argument("--quick", action="store_true", help="each step's CPU smoke run")
    ap.add_argument("--dry-run", action="store_true", help="print the steps, run nothing")
    args = ap.parse_args(argv)
    plan = steps(args.out.resolve(), args.commit or _commit(), args.quick)
    if args.dry_run:
        for s in plan:
            print(f"{s.name} ({s.limit_s} s): python {' '.join(s.argv)}")
        return
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + args.budget_s
    for s in plan:
        left = deadline - time.time()
        if left <= 10:
            print(f"{s.name}: not started ({args.budget_s:.0f} s budget spent)", flush=True)
            continue
        print(f"{s.name}: {_run(s, args.out, min(s.limit_s, left))}", flush=True)


if __name__ == "__main__":
    main()
