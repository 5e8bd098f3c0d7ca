"""SmolLM2-135M pruned with DMS_p and distillation on the Shakespeare training split (issue 9).

    python -m bench.smollm2_prune --target 0.8 [--epochs E] [--retrain-epochs E]
        [--seq-len 128] [--batch-size 8] [--test-limit N] [--threads T] [--distill-hidden W]
        [--layer-uniform] [--out DIR]
    python -m bench.smollm2_prune --table    # rewrite the table from the cache
    python -m bench.smollm2_prune --quick    # smoke run, under bench/runs/

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
import json
import sys
from pathlib import Path
from typing import Any

from bench.lib import smollm2_runs as sr
from bench.lib.benchlib import add_quick_flags, hand_reading, quick_mode, save_cache, write_md

__all__ = ["write_markdown", "main"]

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


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
    global RESULTS
    RESULTS = quick_mode(args, RESULTS, seq_len=32, batch_size=2, test_limit=128)
    sr.CACHE = cache = RESULTS / sr.CACHE.name
    if args.quick:  # 2 search + 1 finetune steps; the run directory goes beside the cache
        spe = 1_407_001 // (args.batch_size * args.seq_len)  # steps per epoch of the training tokens
        args.epochs, args.retrain_epochs = 1.5 / spe, 0.5 / spe
        args.out = str(RESULTS / "runs")
    cache.mkdir(parents=True, exist_ok=True)
    if not args.table:
        args.argv = _without_target(_public(argv))
        res = sr.run(args)
        save_cache(cache / f"target{args.target}.json", res, sort_keys=False)
    results = [json.loads(f.read_text()) for f in sorted(cache.glob("target*.json"))]
    print(write_markdown(results).read_text())


if __name__ == "__main__":
    main()
