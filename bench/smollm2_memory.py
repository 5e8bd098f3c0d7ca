"""Peak memory of a short SmolLM2-135M search, with and without the distillation teacher.

    python -m bench.smollm2_memory [--quick] [--seq-len 128] [--batch-size 4]
        [--steps 3] [--test-limit 1024] [--threads 1] [--only teacher|no-teacher]

Each configuration runs in a fresh Python process (``resource.getrusage(RUSAGE_SELF)
.ru_maxrss`` is the high-water mark of the whole process, so two runs in one process would
report the larger of both): ``dmscale search --pipeline p`` on the bundled Shakespeare with
``--retrain-epochs 0`` (search, finish, export, evaluation, ``RUN/hf``), once with the frozen
original as the teacher (the default of ``hf:`` models) and once with ``--distill-weight 0``.
The per-run numbers are cached as json in ``bench/results/smollm2_memory/``; the table in
``bench/results/smollm2_memory.md`` is written from the cache (``--table`` rewrites it without
running anything). ``--quick`` is a smoke run (the teacher configuration unless ``--only`` says
otherwise, two search steps of 2 x 32 tokens, 128 held-out tokens) whose run directories, cache
and table go to ``WORKDIR/quick/`` (``--workdir``, default ``bench/runs/smollm2_memory/``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
from bench.lib.benchlib import add_quick_flags, git_commit, host, quick_mode, save_cache, write_md  # noqa: E402

RESULTS = ROOT / "bench" / "results"
CACHE = RESULTS / "smollm2_memory"
CONFIGS = {"teacher": 1.0, "no-teacher": 0.0}  # name -> --distill-weight

__all__ = ["measure", "main"]


def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run one configuration in this process (called in a fresh child) and return its numbers."""
    from bench.lib.smollm2_runs import smollm2_path

    from dmscale.config.run_config import RunConfig
    from dmscale.run.pipeline import Pipeline

    out = Path(args.run_dir or tempfile.mkdtemp(prefix="smollm2-mem-")) / name
    probe = RunConfig(command="search", task="text", model=f"hf:{smollm2_path()}", pipeline="p",
                      seq_len=args.seq_len,
                      batch_size=args.batch_size).resolved()
    from dmscale.tasks.registry import build_task

    spe = build_task(probe).steps_per_epoch(args.batch_size)
    cfg = RunConfig(command="search", task="text", model=f"hf:{smollm2_path()}", pipeline="p",
                    resource="params", target=0.8, exclude=["lm.model.embed_tokens"],
                    seq_len=args.seq_len, batch_size=args.batch_size, epochs=args.steps / spe,
                    retrain_epochs=0.0, test_limit=args.test_limit, optimizer="adamw",
                    structure_lr=0.1, resource_weight=50.0, distill_weight=CONFIGS[name],
                    threads=args.threads, quiet=True, out=str(out))
    t0 = time.perf_counter()
    summary = Pipeline(cfg).run()
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB (Linux)
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    times = [r["time"] for r in steps if r.get("phase") == "search" and "time" in r]
    per_step = (times[-1] - times[0]) / max(1, len(times) - 1) if len(times) > 1 else None
    return {"name": name, "distill_weight": CONFIGS[name], "peak_rss_mib": round(peak),
            "wall_s": round(wall, 1), "search_steps": summary["steps"], "s_per_step": per_step,
            "seq_len": args.seq_len, "batch_size": args.batch_size, "threads": args.threads,
            "test_limit": args.test_limit, "params": summary["counts"]["supernet"]["params"]}


def _child(name: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "bench.smollm2_memory", "--child", name, "--seq-len", str(args.seq_len), "--batch-size",
           str(args.batch_size), "--steps", str(args.steps), "--test-limit", str(args.test_limit),
           "--threads", str(args.threads)] + (["--run-dir", args.run_dir] if args.run_dir else [])
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, check=False)
    if proc.returncode != 0:
        sys.exit(f"{name}: the run failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def write_table() -> Path:
    """``smollm2_memory.md`` from the cached json files."""
    rows = [json.loads(p.read_text()) for p in sorted(CACHE.glob("*.json"))]
    lines = ["# Peak memory of a SmolLM2-135M search (issue 9)", "",
             "Command: `python -m bench.smollm2_memory`  ",
             f"Commit: `{rows[0].get('commit', git_commit(ROOT)) if rows else '?'}`; machine: "
             f"{rows[0]['host']['platform'] if rows else '?'}, {rows[0]['host']['cpus'] if rows else '?'} CPU cores "
             "(shared), float32, no GPU.", "",
             "Each row is a fresh process: `dmscale search --pipeline p --retrain-epochs 0` "
             "(load the GGUF, search, finish, export, evaluate, save `hf/`); peak = max RSS.", "",
             "| configuration | peak RSS | search steps | wall s / step (1 thread, contended) | batch x seq | test tokens |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        sps = f"{r['s_per_step']:.1f}" if r.get("s_per_step") else "-"
        lines.append(f"| {r['name']} (`--distill-weight {r['distill_weight']:g}`) | "
                     f"{r['peak_rss_mib'] / 1024:.2f} GiB | {r['search_steps']} | {sps} | "
                     f"{r['batch_size']} x {r['seq_len']} | {r['test_limit']} |")
    notes = [f"- {r['name']}: {r['note']}" for r in rows if r.get("note")]
    if notes:
        lines += ["", "Notes:", "", *notes]
    return write_md(RESULTS / "smollm2_memory.md", lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=3, help="search steps")
    p.add_argument("--test-limit", type=int, default=1024)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--only", choices=sorted(CONFIGS), default=None)
    p.add_argument("--table", action="store_true", help="only rewrite the table from the cache")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--run-dir", default=None, help="where the runs go (default: a temp dir each)")
    add_quick_flags(p, "smollm2_memory", "smoke run: the teacher configuration (or --only), 2 search steps of "
                    "2 x 32 tokens, 128 test tokens, under WORKDIR/quick", "runs, cache and table")
    args = p.parse_args(argv)
    global RESULTS, CACHE
    if args.child:
        print(json.dumps(measure(args.child, args)))
        return
    RESULTS = quick_mode(args, RESULTS, seq_len=32, batch_size=2, steps=2, test_limit=128,
                         only=args.only or "teacher")  # one fresh process: loading SmolLM2 is most of its time
    CACHE = RESULTS / CACHE.name
    if args.quick:  # the runs go beside the cache
        args.run_dir = str(RESULTS / "runs")
    if not args.table:
        CACHE.mkdir(parents=True, exist_ok=True)
        for name in [args.only] if args.only else list(CONFIGS):
            res = dict(_child(name, args), commit=git_commit(ROOT), host=host())
            save_cache(CACHE / f"{name}.json", res, sort_keys=False)
    print(write_table().read_text())


if __name__ == "__main__":
    main()
