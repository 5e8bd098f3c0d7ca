"""The default run: ``dmscale search`` with no flags, timed, and what it found.

    python -m bench.default_run [--quick] [--workdir DIR]

Runs the command exactly as a user would, in a fresh temporary directory (so ``runs/`` starts
empty), with this checkout's ``src`` first on ``PYTHONPATH``; the thread count is the CLI's own
choice from the machine's load, read back from the run's log. Records the wall time of the
whole command (interpreter start to exit, what ``time dmscale search`` shows), the supernet's
and the found model's MACs and parameters, the MACs target, blocks per stage, test accuracy
after the search and after retraining, and the machine, device, torch version, threads and
commit it ran with, into ``bench/results/default_run.json``. README.md's and docs/search.md's
default-run tables are generated from that cache by ``scripts/doc_numbers.py``.

``--quick`` is a smoke run (a few hundred images, a sliver of an epoch per phase: flags, so not
the default run) whose cache goes to ``WORKDIR/quick/default_run.json`` (``--workdir``, default
``bench/runs/default_run/``), never to bench/results.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
from bench.lib.benchlib import environment, git_commit, save_cache  # noqa: E402

__all__ = ["QUICK_FLAGS", "run", "record", "main"]

RESULTS = ROOT / "bench" / "results"
QUICK_FLAGS = ["--train-limit", "256", "--test-limit", "128", "--epochs", "0.25", "--retrain-epochs", "0.25"]


def run(flags: list[str], workdir: Path) -> tuple[float, str, dict[str, Any], dict[str, Any]]:
    """``dmscale search FLAGS`` in ``workdir``: wall seconds, its log, its ``summary.json`` and
    its blocks per stage (:func:`blocks`)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src")] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "dmscale", "search", *flags], cwd=workdir, env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"dmscale search failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    summaries = sorted(workdir.glob("runs/*/summary.json"))
    if len(summaries) != 1:
        raise SystemExit(f"expected one run directory under {workdir / 'runs'}, found {len(summaries)}")
    rd = summaries[0].parent
    return wall, proc.stdout + proc.stderr, json.loads(summaries[0].read_text()), blocks(rd)


def blocks(rd: Path) -> dict[str, Any]:
    """Blocks per stage of the supernet and of the found model of run directory ``rd``: the
    found model's from the block indices in its ``model.safetensors`` (``STAGE.I.`` names), the
    supernet's that plus the blocks ``structure.json`` says were removed."""
    structure = json.loads((rd / "structure.json").read_text())
    with open(rd / "model.safetensors", "rb") as f:  # the header: 8-byte length, then json
        names = list(json.loads(f.read(int.from_bytes(f.read(8), "little"))))
    out: dict[str, Any] = {"stages": [], "supernet": [], "found": [], "removed": []}
    for d in structure.get("depth", []):
        stage = d["name"]
        found = len({n[len(stage) + 1:].split(".")[0] for n in names if n.startswith(stage + ".")})
        removed = [b for b in d["blocks"] if b not in d["kept"]]
        out["stages"].append(stage)
        out["found"].append(found)
        out["supernet"].append(found + len(removed))
        out["removed"] += removed
    return out


def _threads(log: str) -> tuple[str, int | None]:
    """Device and CPU threads from the run's log line ``run directory: ... (cpu, 2 CPU threads)``."""
    m = re.search(r"run directory: .*\((\w[\w:]*)(?:, (\d+) CPU threads?)?\)", log)
    if not m:
        return "?", None
    return m.group(1), int(m.group(2)) if m.group(2) else None


def _last_eval(summary: dict[str, Any], phase: str) -> float | None:
    """The last test accuracy the summary holds for ``phase`` (``None`` if it has none)."""
    evals = summary.get("evals") or {}
    found = evals.get(phase)
    if isinstance(found, list):
        found = found[-1] if found else None
    if isinstance(found, dict):
        for key in ("acc", "accuracy", "top1"):
            if key in found:
                return float(found[key])
    return None


def record(wall: float, log: str, summary: dict[str, Any], stages: dict[str, Any], flags: list[str],
           commit: str, load: list[float] | None) -> dict[str, Any]:
    """The cache entry of one run: the numbers the documents show, and where they were measured
    (``commit`` and ``load``, the load averages, as they were when the run started)."""
    device, threads = _threads(log)
    counts = summary.get("counts") or {}
    res_end = summary.get("resources_search_end") or {}
    return {
        "command": " ".join(["dmscale", "search", *flags]),
        "date": datetime.date.today().isoformat(),
        "env": {**environment(threads, device), "commit": commit},
        "load_average": load,
        "wall_seconds": round(wall, 1),
        "pipeline_seconds": summary.get("elapsed"),
        "seed": 0 if "--seed" not in flags else int(flags[flags.index("--seed") + 1]),
        "pipeline": summary.get("pipeline"),
        "model": summary.get("model"), "model_args": summary.get("model_args"),
        "task": summary.get("task"),
        "resource": summary.get("resource"), "target": summary.get("target"),
        "counts": counts,
        "search_end": res_end,
        "blocks": stages,
        "acc_search": _last_eval(summary, "search"),
        "acc_retrain": _last_eval(summary, "retrain"),
        "summary": {k: summary.get(k) for k in ("phases", "counts", "resources", "resources_search_end",
                                                "evals", "steps", "elapsed", "warnings", "structure")},
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run with small flags; cache under --workdir")
    p.add_argument("--workdir", type=Path, default=ROOT / "bench" / "runs" / "default_run",
                   help="--quick's cache goes to WORKDIR/quick")
    args = p.parse_args(argv)
    flags = QUICK_FLAGS if args.quick else []
    out = (args.workdir / "quick" if args.quick else RESULTS) / "default_run.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    commit = git_commit(ROOT)
    load = [round(v, 2) for v in os.getloadavg()] if hasattr(os, "getloadavg") else None
    with tempfile.TemporaryDirectory(prefix="dmscale-default-run-") as tmp:
        wall, log, summary, stages = run(flags, Path(tmp))
    entry = record(wall, log, summary, stages, flags, commit, load)
    save_cache(out, entry)
    print(f"wrote {out}: {entry['wall_seconds']} s, search {entry['acc_search']}, retrain {entry['acc_retrain']}")


if __name__ == "__main__":
    main()
