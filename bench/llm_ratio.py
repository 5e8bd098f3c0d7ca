"""How far SmolLM2-135M pruned to 80 % of its parameters lands from the original finetuned with
the same budget (issue 48's bar: within 1.2x of its perplexity), under several training
protocols that each arm shares.

    python -m bench.llm_ratio            # the table from the caches below

Each row pairs a DMS arm (``dmscale search --model hf:SmolLM2 --task text --pipeline p
--resource params --target 0.8`` at the library's defaults, run in-process by
``bench/llm_table5.py --method dms --settle-hold``) with the unpruned model finetuned for as
many weight steps under the same protocol (``--method original``). The caches are
``bench/llm_table5.py``'s, one folder per ``--name``; nothing is run here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
from bench.lib.benchlib import RESULTS, git_commit, write_md  # noqa: E402

BAR = 1.2  # issue 48: the pruned model's perplexity at most 1.2x the finetuned original's

# (protocol, DMS cache folder, original cache folder and file, the table5 command's extra flags)
ROWS: list[tuple[str, str, str, str]] = [
    ("logits-KL distillation (weight 1, the default), 30 search + 40 finetune steps",
     "llm_table5_hold", "llm_table5/original_t1.0_s0.json", "--name llm_table5_hold --settle-hold"),
    ("the same, 10 search + 60 finetune steps",
     "llm_ratio_split", "llm_table5/original_t1.0_s0.json",
     "--name llm_ratio_split --settle-hold --search-steps 10 --finetune-steps 60"),
    ("no distillation (`--distill-weight 0`: the task loss alone), 30 + 40 steps",
     "llm_ratio_kd0", "llm_ratio_kd0/original_t0.8_s0.json",
     "--name llm_ratio_kd0 --settle-hold --distill-weight 0"),
    ("the default protocol, 50 search + 20 finetune steps",
     "llm_ratio_s50", "llm_table5/original_t1.0_s0.json",
     "--name llm_ratio_s50 --settle-hold --search-steps 50 --finetune-steps 20"),
    ("the default protocol at a 3x higher lr (`--lr 3e-4`), 30 + 40 steps",
     "llm_ratio_lr3", "llm_ratio_lr3/original_t0.8_s0.json",
     "--name llm_ratio_lr3 --settle-hold --lr 3e-4"),
    ("a 4x longer budget, 60 search + 240 finetune steps (DMS: the settle phase without the hold, "
     "`llm_table5_long.md`'s runs)",
     "llm_table5_long", "llm_table5_long/original_t0.8_s0.json",
     "--name llm_table5_long --search-steps 60 --finetune-steps 240"),
    ("the same 300 steps at the current default (the settle phase with the hold)",
     "llm_ratio_long_hold", "llm_table5_long/original_t0.8_s0.json",
     "--name llm_ratio_long_hold --settle-hold --search-steps 60 --finetune-steps 240"),
]


def _load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def row(protocol: str, dms_dir: str, original: str, flags: str) -> tuple[str, dict[str, Any]] | None:
    """One table row (markdown) and its numbers, or None before its runs exist."""
    orig = _load(RESULTS / original)
    runs = [r for r in (_load(p) for p in sorted((RESULTS / dms_dir).glob("dms_t0.8_s*.json"))) if r]
    if orig is None or not runs:
        return None
    base = orig["after"]["ppl"]
    ppl = [r["after"]["ppl"] for r in runs]
    ratios = [p / base for p in ppl]
    steps = {r["weight_steps"] for r in runs} | {orig.get("weight_steps") or orig.get("finetune_steps")}
    mean = statistics.mean(ratios)
    met = sum(x <= BAR for x in ratios)
    seeds = ", ".join(f"{p:.1f}" for p in ppl)
    line = (f"| {protocol} | {'/'.join(str(s) for s in sorted(steps))} | {orig['before']['ppl']:.1f} -> "
            f"{base:.1f} | {statistics.mean(ppl):.1f} ({seeds}) | {mean:.3f} x "
            f"({', '.join(f'{x:.3f}' for x in ratios)}) | {met} of {len(ratios)} |")
    return line, {"protocol": protocol, "flags": flags, "ratio": mean, "met": met, "seeds": len(ratios)}


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    rows = [r for r in (row(*spec) for spec in ROWS) if r is not None]
    lines = [
        "# SmolLM2-135M at 80 % of its parameters against the original finetuned as long (issue 48)",
        "",
        f"- table: `PYTHONPATH=src python bench/llm_ratio.py` (commit `{git_commit(ROOT)}`), from the caches of "
        "`PYTHONPATH=src python bench/llm_table5.py --method {dms,original} --target 0.8 --seed S FLAGS` "
        "(FLAGS per row below); 2 CPU cores shared with other jobs, torch 2.13, 1 thread per run.",
        "- task: the bundled Shakespeare, 128-token windows, batch 4, AdamW lr 1e-4 cosine; held-out "
        "perplexity over 8,192 tokens. Every arm of a row trains the same number of weight steps with "
        "the same loss; the DMS arm is the library's pipeline p at its defaults (settle phase with the "
        "hold) with the table-5 bench's `--resource-weight 50 --structure-lr 0.1`.",
        f"- bar: the pruned model's perplexity at most {BAR} x the original's after the same finetune.",
        "",
        "| protocol (both arms) | weight steps | original: before -> finetuned | DMS 80 %, finetuned (seeds) "
        "| ratio (per seed) | seeds within the bar |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        *[line for line, _ in rows],
        "",
        "FLAGS per row: " + "; ".join(f"{i + 1}: `{info['flags']}`" for i, (_, info) in enumerate(rows)) + ".",
        "",
    ]
    print(f"wrote {write_md(RESULTS / 'llm_ratio.md', lines)}")


if __name__ == "__main__":
    main()
