"""The "Against NVIDIA ModelOpt FastNAS" section of ``bench/results/np_uniform_w4.md``: the
``fastnas`` arm of ``bench/np_fastnas.py`` beside the uniform and DMS_np arms of the same seeds.

Per target: top-1 of uniform, DMS_np (:data:`REFERENCE`, the library's default search) and
FastNAS over the seeds FastNAS ran, the paired differences (``benchlib.ci_text``), the exported
MACs / target, how often FastNAS's sub-net landed within 1 % under the target and what its
bisection cost; then per-stage widths (means over the seeds, and seed 0's side by side).

A DMS_np structure string lists a kept width for every group, also for the inner widths of
blocks the search removed; :func:`stage_row` counts those as 0 channels (the block is gone),
read from the row's ``kept_final`` (0 where every producer of the dim sits in a removed block).

Example:
    >>> groups = ["conv1", "layer1.0.conv1", "layer1.1.conv1", "layer2.0.conv1", "layer2.0.conv2"]
    >>> stage_row({"structure": "4/3/2/6/8 | blocks 1/1", "kept_final": [1, 0.75, 0.0, 0.75, 1, 0.5, 1.0],
    ...            "n_width": 5}, groups)
    {1: (4.0, [3.0, 0.0], 1), 2: (8.0, [6.0], 1)}
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
from bench.lib.benchlib import ci_text, paired_diff, spread  # noqa: E402
from bench.lib.peers_extra import stage_widths  # noqa: E402

__all__ = ["ARM", "REFERENCE", "stage_row", "fastnas_lines"]

ARM = "fastnas"
REFERENCE = "dms@hold"  # DMS_np from the baseline at the library's default (settle phase with the hold)


def stage_row(row: dict[str, Any], groups: list[str]) -> dict[int, tuple[float, list[float], int | None]]:
    """``{stage: (residual, [inner width per block], removable blocks kept)}`` of one row; an
    inner width of a removed block (``kept_final`` 0, DMS rows only) counts as 0."""
    per = stage_widths(row["structure"], groups)
    alive = [k > 0 for k in row["kept_final"][:row["n_width"]]] if "kept_final" in row else [True] * len(groups)
    inner_alive = [a for a, g in zip(alive, groups) if g != "conv1" and not g.endswith("conv2")]
    out, i = {}, 0
    for stage in sorted(per):
        inner = []
        for k in per[stage]["inner"]:
            inner.append(float(k) if inner_alive[i] else 0.0)
            i += 1
        out[stage] = (float(per[stage]["residual"]), inner, per[stage]["blocks"])
    return out


def _cells(rows: list[dict[str, Any]], groups: list[str]) -> list[str]:
    per = [stage_row(r, groups) for r in rows]
    cells = []
    for stage in sorted(per[0]):
        res = statistics.mean(p[stage][0] for p in per)
        inner = [statistics.mean(p[stage][1][b] for p in per) for b in range(len(per[0][stage][1]))]
        blocks = [p[stage][2] for p in per if p[stage][2] is not None]
        cells.append(f"{res:.1f} / " + ", ".join(f"{v:.1f}" for v in inner)
                     + (f" / {statistics.mean(blocks):.1f}" if blocks else ""))
    return cells


def _by_seed(runs: list[dict[str, Any]], arm: str, target: float, seeds: list[int], r_ep: float,
             s_ep: float | None) -> list[dict[str, Any]]:
    rows = {r["seed"]: r for r in runs if r["arm"] == arm and r["target"] == target and r["retrain_epochs"] == r_ep
            and (s_ep is None or r["search_epochs"] == s_ep)}
    return [rows[s] for s in seeds if s in rows]


def fastnas_lines(cache: dict[str, Any], s_ep: float = 10.0, r_ep: float = 20.0) -> list[str]:
    """The section's lines (empty when the cache has no ``fastnas`` row)."""
    runs = list(cache["runs"].values())
    fn = [r for r in runs if r["arm"] == ARM and r["retrain_epochs"] == r_ep]
    if not fn:
        return []
    targets = sorted({r["target"] for r in fn}, reverse=True)
    commits = sorted({r["commit"] for r in fn})
    lines = ["## Against NVIDIA ModelOpt FastNAS (issue 50)", "",
             f"- command (last invocation): `{cache.get('fastnas_command', 'python -m bench.np_fastnas')}`; "
             f"commit(s) `{'`, `'.join(commits)}`; machine: {cache.get('fastnas_machine', cache.get('machine'))}; "
             f"NVIDIA ModelOpt {fn[0]['modelopt']}",
             f"- protocol: per seed, the ResNet-20 pretrained by `dmscale pretrain` for {fn[0]['search_epochs']:g} "
             "epochs on the training split (the peers table's recipe; DMS_np's search trains for as many), FastNAS "
             "(`mtp.prune(mode=\"fastnas\")`, channel divisor 1, BatchNorm calibration on 80 % and `score_func` "
             "top-1 on the other 20 % of the *training* images) with its `flops` constraint bisected until "
             "`dms.count` MACs are within 1 % under the target; its kept channel counts (every block kept) then "
             f"trained from scratch by the same `dmscale retrain --retrain-init scratch` ({r_ep:g} epochs, same "
             f"seed) as `uniform` and `{REFERENCE}` of that seed. Every FastNAS structure is checked to be a point "
             "of DMS_np's own search space at the same MACs.", "",
             f"| target | seeds | uniform | DMS_np `{REFERENCE}` | FastNAS | FastNAS - uniform (pt) | "
             f"DMS_np - FastNAS (pt) | exported MACs / target (uniform; DMS_np; FastNAS) | FastNAS within 1 % "
             "under | FastNAS constraint (%) / `mtp.prune` runs / prune s | pretrained top-1 (%) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    stage_lines: list[str] = []
    for t in targets:
        fs = sorted([r for r in fn if r["target"] == t], key=lambda r: r["seed"])
        seeds = [r["seed"] for r in fs]
        uni = _by_seed(runs, "uniform", t, seeds, r_ep, None)
        dms = _by_seed(runs, REFERENCE, t, seeds, r_ep, s_ep)
        fits = sum(0.99 <= r["exported"] <= 1.0 for r in fs)
        lines.append(
            f"| {t} | {len(fs)} | {spread([100 * r['acc'] for r in uni], 2)} | {spread([100 * r['acc'] for r in dms], 2)} | "
            f"{spread([100 * r['acc'] for r in fs], 2)} | {ci_text(paired_diff(fs, uni, 'acc'))} | "
            f"{ci_text(paired_diff(dms, fs, 'acc'))} | "
            f"{statistics.mean(r['exported'] for r in uni):.3f}; {statistics.mean(r['exported'] for r in dms):.3f}; "
            f"{statistics.mean(r['exported'] for r in fs):.3f} ({min(r['exported'] for r in fs):.3f}-"
            f"{max(r['exported'] for r in fs):.3f}) | {fits} of {len(fs)} | "
            f"{statistics.mean(r['constraint_percent'] for r in fs):.1f} / "
            f"{statistics.mean(r['bisect_runs'] for r in fs):.1f} / {statistics.mean(r['search_seconds'] for r in fs):.0f} | "
            f"{spread([100 * r['pretrain_acc'] for r in fs], 2)} |")
        groups = fs[0]["width_groups"]
        n_stages = len(stage_widths(fs[0]["structure"], groups))
        head = ["| target | arm | seeds | " + " | ".join(f"stage {s + 1}: residual / inner per block / removable blocks kept"
                                                       for s in range(n_stages)) + " |",
                "| ---: | --- | --- |" + " ---: |" * n_stages]
        stage_lines += [f"Per-stage widths at {t} x (means over the seeds; an inner width of a removed block "
                        "counts 0), then seed " f"{seeds[0]}'s structures side by side:", "", *head]
        for name, rows in (("uniform", uni), (REFERENCE, dms), (ARM, fs)):
            stage_lines.append(f"| {t} | {name} | {len(rows)} | " + " | ".join(_cells(rows, groups)) + " |")
        for name, rows in (("uniform", uni), (REFERENCE, dms), (ARM, fs)):
            first = [r for r in rows if r["seed"] == seeds[0]]
            if first:
                stage_lines.append(f"| {t} | {name}, seed {seeds[0]} ({100 * first[0]['acc']:.2f} %) | 1 | "
                                   + " | ".join(_cells(first, groups)) + " |")
        stage_lines += ["", f"FastNAS structures at {t} x (kept channels per width group in model order; constraint, "
                        "MACs / target, top-1):", ""]
        stage_lines += [f"- seed {r['seed']}: {r['structure']} ({r['constraint_percent']:.2f} %, "
                        f"{r['exported']:.4f} x, {100 * r['acc']:.2f} %)" for r in fs]
        stage_lines.append("")
    return lines + [""] + stage_lines
