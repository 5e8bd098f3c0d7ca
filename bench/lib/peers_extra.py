"""Table lines of the peers and DMS_p variants that ``bench/peers.py`` runs only on request (``--methods``).

An extra peer (ModelOpt FastNAS) may cover only some of a setting's seeds, so its rows, its
paired interval against DMS_p and its per-stage widths are computed over the seeds it has:
:func:`extra_lines` writes them below the setting's table. :func:`stage_widths` turns a
structure string of the cache (``"7/7/6/6/13/... | blocks 2/1/2"``, width groups in model
order) and the width groups' first producers into per-stage residual / inner widths.

Example:
    >>> groups = ["conv1", "layer1.0.conv1", "layer2.0.conv1", "layer2.0.conv2"]
    >>> stage_widths("8/6/10/15 | blocks 1/1", groups)
    {1: {'residual': 8, 'inner': [6], 'blocks': 1}, 2: {'residual': 15, 'inner': [10], 'blocks': 1}}
"""

from __future__ import annotations

import re
import statistics
from typing import Any

from bench.lib.benchlib import ci_text, mean_std

__all__ = ["stage_widths", "extra_lines", "ablation_lines"]


def _stage(producer: str) -> int:
    """The stage of a width group from its first producer (``conv1``: the stem, stage 1)."""
    m = re.match(r"layer(\d+)\.", producer)
    return int(m.group(1)) if m else 1


def stage_widths(structure: str, groups: list[str]) -> dict[int, dict[str, Any]]:
    """``{stage: {"residual", "inner", "blocks"}}`` of a ResNet structure string: the residual
    width (the group the stem or a block's ``conv2`` produces), the inner widths (the groups of
    the blocks' ``conv1``) in block order and the blocks kept (removable ones, from the string)."""
    width_part, _, block_part = structure.partition("| blocks")
    kept = [int(k) for k in width_part.strip().split("/")]
    if len(kept) != len(groups):
        raise ValueError(f"{len(kept)} widths in {structure!r} but {len(groups)} width groups")
    blocks = [int(b) for b in block_part.strip().split("/")] if block_part.strip() else []
    out: dict[int, dict[str, Any]] = {}
    for k, producer in zip(kept, groups):
        st = out.setdefault(_stage(producer), {"residual": None, "inner": [], "blocks": None})
        if producer == "conv1" or producer.endswith("conv2"):
            st["residual"] = k
        else:
            st["inner"].append(k)
    for i, st in enumerate(sorted(out)):
        out[st]["blocks"] = blocks[i] if i < len(blocks) else None
    return out


def _stage_cell(rows: list[dict[str, Any]], stage: int, groups: list[str]) -> str:
    """``residual / inner, inner, ... / blocks`` of one stage, means over ``rows``."""
    per = [stage_widths(r["structure"], groups)[stage] for r in rows]
    res = statistics.mean(p["residual"] for p in per)
    inner = [statistics.mean(p["inner"][i] for p in per) for i in range(len(per[0]["inner"]))]
    blocks = [p["blocks"] for p in per if p["blocks"] is not None]
    return (f"{res:.1f} / " + ", ".join(f"{v:.1f}" for v in inner)
            + (f" / {statistics.mean(blocks):.1f}" if blocks else ""))


def _stages_table(runs: dict[str, Any], seeds: list[int], methods: list[str], groups: list[str],
                  full: str) -> list[str]:
    stages = sorted(stage_widths(full, groups))
    lines = ["| method | " + " | ".join(f"stage {s}: residual / inner per block / removable blocks kept"
                                         for s in stages) + " |",
             "| --- |" + " ---: |" * len(stages)]
    full_row = stage_widths(full, groups)
    lines.append("| supernet | " + " | ".join(
        f"{full_row[s]['residual']} / " + ", ".join(str(v) for v in full_row[s]["inner"])
        + (f" / {full_row[s]['blocks']}" if full_row[s]["blocks"] is not None else "") for s in stages) + " |")
    for m in methods:
        rows = [runs[str(s)][m] for s in seeds]
        lines.append(f"| {m} | " + " | ".join(_stage_cell(rows, s, groups) for s in stages) + " |")
    return lines


def _ran(runs: dict[str, Any], have: list[int], method: str) -> tuple[list[int], list[dict[str, Any]]]:
    """The seeds of ``have`` that ran ``method``, and their rows."""
    seeds = [s for s in have if method in runs[str(s)]]
    return seeds, [runs[str(s)][method] for s in seeds]


def ablation_lines(runs: dict[str, Any], have: list[int], ablations: dict[str, dict[str, Any]]) -> list[str]:
    """Each DMS_p variant of ``ablations`` (name -> the RunConfig fields its search adds) over the
    seeds that ran it: its accuracy and MACs, paired against DMS_p and against uniform width, and
    its structures."""
    lines: list[str] = []
    for m, fields in ablations.items():
        seeds, rs = _ran(runs, have, m)
        if not seeds:
            continue

        def diff(other: str) -> str:
            return ci_text([100 * (runs[str(s)][m]["acc"] - runs[str(s)][other]["acc"]) for s in seeds])
        flags = " ".join(f"--{k.replace('_', '-')} {','.join(v) if isinstance(v, list) else v}"
                         for k, v in fields.items())
        fastnas = all("modelopt_fastnas" in runs[str(s)] for s in seeds)
        lines += ["", f"**{m}** (DMS_p with `{flags}`; seeds {seeds}): top-1 "
                  f"{mean_std([100 * r['acc'] for r in rs])} % at {mean_std([r['macs_frac'] for r in rs], '{:.3f}')} x "
                  f"MACs; minus dms_p, pt: {diff('dms_p')}; minus uniform, pt: {diff('uniform')}"
                  + (f"; minus modelopt_fastnas, pt: {diff('modelopt_fastnas')}" if fastnas else "") + ".", ""]
        lines += [f"- {m}, seed {r['seed']}: {r['structure']} ({r['steps']} search steps)" for r in rs]
    return lines


def extra_lines(runs: dict[str, Any], have: list[int], extra: tuple[str, ...], target: float,
                reference: str | None, full_structure: str | None) -> list[str]:
    """Rows, paired intervals against ``dms_p`` and per-stage widths of each ``extra`` method,
    over the seeds of ``have`` that ran it (nothing for a method no seed ran)."""
    lines: list[str] = []
    for m in extra:
        seeds, rs = _ran(runs, have, m)
        if not seeds:
            continue
        version = rs[0].get("modelopt", "?")
        fits = sum(1 for r in rs if 0.99 * target <= r["macs_frac"] <= target)
        diffs = [100 * (runs[str(s)]["dms_p"]["acc"] - runs[str(s)][m]["acc"]) for s in seeds]
        dms = [runs[str(s)]["dms_p"] for s in seeds]
        lines += ["", f"**{m}** (NVIDIA ModelOpt {version}, FastNAS, channel divisor {rs[0].get('divisor', 1)}"
                  f"{' (its default rules)' if rs[0].get('divisor', 1) == 32 else ''}; seeds {seeds}):", "",
                  "| method | top-1 after finetune (%) | MACs | x supernet MACs | params | prune/search time (s) |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
        for name, rows in (("dms_p (same seeds)", dms), (m, rs)):
            lines.append(f"| {name} | {mean_std([100 * r['acc'] for r in rows])} | "
                         f"{mean_std([r['macs'] for r in rows], '{:,.0f}')} | "
                         f"{mean_std([r['macs_frac'] for r in rows], '{:.3f}')} | "
                         f"{mean_std([r['params'] for r in rows], '{:,.0f}')} | "
                         f"{mean_std([r['prune_seconds'] for r in rows], '{:.0f}')} |")
        lines += ["", f"dms_p minus {m}, pt: **{ci_text(diffs)}** (mean [95 % t-interval], p); per seed "
                  + ", ".join(f"{d:+.2f}" for d in diffs) + ". "
                  f"{m}'s MACs by `dms.count` are within 1 % under the target on {fits} of {len(rs)} seeds "
                  f"(its own `flops` constraint, bisected: {mean_std([r['constraint_percent'] for r in rs], '{:.1f}')} %, "
                  f"{mean_std([r['bisect_runs'] for r in rs], '{:.1f}')} `mtp.prune` runs; "
                  f"{mean_std([r['steps'] for r in rs], '{:.0f}')} score evaluations for its sensitivity map)."]
        if reference and all(reference in runs[str(s)] for s in seeds):
            lines.append(f"{m} minus `{reference}`, pt: " + ci_text(
                [100 * (runs[str(s)][m]["acc"] - runs[str(s)][reference]["acc"]) for s in seeds]) + ".")
        groups = rs[0].get("width_groups")
        if groups and full_structure:
            lines += ["", f"Per-stage widths, means over these seeds (DMS_p beside {m}):", ""]
            lines += _stages_table(runs, seeds, ["dms_p", m], groups, full_structure)
        lines += ["", f"Structures of {m} (kept channels per width group in model order):", ""]
        lines += [f"- {m}, seed {r['seed']}: {r['structure']} (constraint {r['constraint_percent']:.2f} %, "
                  f"{r['macs_frac']:.4f} x MACs)" for r in rs]
    return lines


def random_lines(runs: dict[str, Any], have: list[int], randoms: tuple[str, ...],
                 arms: tuple[str, ...] = ("dms_p", "dms_p_struct")) -> list[str]:
    """The random control: over the seeds of ``have`` that ran every draw of ``randoms``, the
    random structures' accuracy and, for each of ``arms`` those seeds ran, where it falls among
    its seed's draws (the share below it, ties counted half) and its gap to its seed's
    75th-percentile and best draws, paired."""
    seeds = [s for s in have if all(m in runs[str(s)] for m in randoms)]
    if not seeds:
        return []
    accs = {s: sorted(100 * runs[str(s)][m]["acc"] for m in randoms) for s in seeds}
    pooled = [a for s in seeds for a in accs[s]]
    macs = [runs[str(s)][m]["macs_frac"] for s in seeds for m in randoms]
    lines = ["", f"**Random structures** ({len(randoms)} per seed, drawn uniformly from DMS_p's search space at "
             f"{min(macs):.3f}-{max(macs):.3f} x the target MACs, first channels of the supernet, finetuned the same "
             f"way; seeds {seeds}): top-1 {mean_std(pooled)} %; best draw per seed {mean_std([accs[s][-1] for s in seeds])} %."]
    for arm in arms:
        if not all(arm in runs[str(s)] for s in seeds):
            continue
        acc = {s: 100 * runs[str(s)][arm]["acc"] for s in seeds}
        below = [sum(1.0 if a < acc[s] else 0.5 if a == acc[s] else 0.0 for a in accs[s]) / len(randoms) for s in seeds]
        q75 = {s: statistics.quantiles(accs[s], n=4, method="inclusive")[2] for s in seeds}
        name = "DMS_p" if arm == "dms_p" else arm
        lines[-1] += (f" {name} is above {100 * statistics.mean(below):.0f} % of its seed's draws (per seed "
                      + ", ".join(f"{100 * b:.0f}" for b in below) + f"); {name} minus its seed's 75th-percentile draw, pt: "
                      + ci_text([acc[s] - q75[s] for s in seeds]) + "; minus its seed's best draw: "
                      + ci_text([acc[s] - accs[s][-1] for s in seeds]) + ".")
    return lines


def struct_lines(runs: dict[str, Any], have: list[int], struct: str) -> list[str]:
    """DMS_p's structure on the pretrained supernet's weights (``struct``) against DMS_p (its
    search-trained weights) and FastNAS, over the seeds that ran it."""
    seeds, rs = _ran(runs, have, struct)
    if not seeds:
        return []

    def diff(other: str) -> str:
        return ci_text([100 * (runs[str(s)][struct]["acc"] - runs[str(s)][other]["acc"]) for s in seeds])
    fastnas = all("modelopt_fastnas" in runs[str(s)] for s in seeds)
    return ["", f"**{struct}** (DMS_p's kept channels on the pretrained supernet's weights, finetuned as long as "
            f"the peers; seeds {seeds}): top-1 {mean_std([100 * r['acc'] for r in rs])} %; minus dms_p, pt: "
            f"{diff('dms_p')}" + (f"; minus modelopt_fastnas, pt: {diff('modelopt_fastnas')}" if fastnas else "") + "."]
