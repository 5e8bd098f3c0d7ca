"""The tables of ``bench/results/random_control.md`` from the cache of ``bench/random_control.py``.

Everything above ``## Reading`` is regenerated; the hand-written reading below it is kept.
Per setting: the sampler's record, the random structures' distribution of mean top-1, and for
each arm its rank among them and its gap to their median and best, with two 95 % intervals: a
percentile bootstrap over structures and seeds (``random_control_lib.bootstrap_gap``) and a
paired Student-t over seeds (``benchlib.paired_ci``) of the per-seed gap.

Example:
    >>> verdict(0.8, -0.1, 1.6)
    'not resolved (the interval holds 0)'
    >>> verdict(-0.8, -1.5, -0.1)
    'below the median of random structures'
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
from bench.lib import random_control_lib as rl  # noqa: E402
from bench.lib.benchlib import ci_text, invocations_text, kept_reading, mean_std, write_md  # noqa: E402

__all__ = ["READING", "verdict", "complete_seeds", "arms_of", "section", "write_table"]

READING = "## Reading"
ISSUE_SEEDS = 3  # the issue's protocol: 3 seeds per structure
LABEL = {"np": ("dms", "DMS_np (search seed s, retrained with seed s)"),
         "p": ("dms_p", "DMS_p as run (its search's weights, then the finetune)")}


def verdict(gap: float, low: float, high: float) -> str:
    """What an interval of a gap to the random structures' median says."""
    if low > 0:
        return "beats the median of random structures"
    if high < 0:
        return "below the median of random structures"
    return "not resolved (the interval holds 0)"


def complete_seeds(runs: dict[str, Any], n: int, arm: str) -> list[int]:
    """Seeds at which ``arm``, ``uniform`` and all ``n`` random structures have a row."""
    seeds = sorted({int(k.rsplit("/s", 1)[1]) for k in runs if k.startswith(f"{arm}/s")})
    return [s for s in seeds if f"uniform/s{s}" in runs and all(f"random/{j}/s{s}" in runs for j in range(n))]


def arms_of(setting: dict[str, Any], seeds: list[int]) -> list[tuple[str, list[float]]]:
    """``(label, top-1 per seed)`` of every arm compared with the random structures."""
    runs, kind = setting["runs"], setting["kind"]
    main, label = LABEL[kind]
    out = [(label, [runs[f"{main}/s{s}"]["acc"] for s in seeds])]
    structs = sorted({int(k.split("/")[1]) for k in runs if k.startswith("dms_struct/")})
    structs = [k for k in structs if all(f"dms_struct/{k}/s{s}" in runs for s in seeds)]
    what = "retrained with every seed" if kind == "np" else "first channels of each supernet, finetuned"
    for k in structs:
        out.append((f"DMS structure of search seed {k}, {what}", [runs[f"dms_struct/{k}/s{s}"]["acc"] for s in seeds]))
    if len(structs) > 1:
        out.append((f"DMS structures pooled (mean of the {len(structs)} per seed)",
                    [statistics.mean(runs[f"dms_struct/{k}/s{s}"]["acc"] for k in structs) for s in seeds]))
    out.append(("uniform width (one multiplier)", [runs[f"uniform/s{s}"]["acc"] for s in seeds]))
    return out


def _interval(g: tuple[float, float, float]) -> str:
    """``(gap, low, high)`` as ``+gap [low, high]``."""
    return f"{g[0]:+.2f} [{g[1]:.2f}, {g[2]:.2f}]"


def _exported(setting: dict[str, Any], prefix: str, seeds: list[int]) -> str:
    vals = [r["exported"] for k, r in setting["runs"].items() if k.startswith(prefix) and r["seed"] in seeds]
    return f"{min(vals):.3f}-{max(vals):.3f}" if vals else "-"


def _arm_table(setting: dict[str, Any], seeds: list[int], rand: list[list[float]]) -> list[str]:
    """Every arm's rank and gaps among the random structures (``rand[j][i]``: structure j, seed
    ``seeds[i]``), then the verdict on the first arm."""
    means = [statistics.mean(r) for r in rand]
    best = max(range(len(rand)), key=means.__getitem__)
    lines = [f"| arm | top-1 (%) | rank of {len(rand) + 1} | percentile | gap to the median (pt): bootstrap [95 %] | "
             "paired t over seeds [95 %] | gap to the best (pt): bootstrap [95 %] | paired t over seeds [95 %] |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    arms = arms_of(setting, seeds)
    for label, accs in arms:
        r = rl.rank_of(statistics.mean(accs), means)
        gaps = rl.per_seed_gaps(accs, rand, best)
        g_med = rl.bootstrap_gap(accs, rand, "median")
        g_best = rl.bootstrap_gap(accs, rand, "best")
        lines.append(f"| {label} | {mean_std([100 * a for a in accs])} | {r['rank']} | {r['percentile']:.0f} | "
                     f"{_interval(g_med)} | {ci_text(gaps['median'])} | {_interval(g_best)} | {ci_text(gaps['best'])} |")
    label, accs = arms[0]
    g = rl.bootstrap_gap(accs, rand, "median")
    return lines + ["", f"{label}: {verdict(*g)} ({_interval(g)} pt, bootstrap; {len(seeds)} seeds).", ""]


def section(key: str, setting: dict[str, Any], info: dict[str, Any]) -> list[str]:
    """The markdown of one setting."""
    runs, smp, kind = setting["runs"], setting["sampler"], setting["kind"]
    n = len(smp["counts"])
    seeds = complete_seeds(runs, n, LABEL[kind][0])
    proto = setting["protocol"]
    how = (f"DMS_np searched from the baseline ({proto['search_epochs']:g} epochs, `--settle {proto['settle']:g}"
           f"{' --settle-hold' if proto.get('settle_hold') else ''}`), every structure trained from scratch by "
           f"`dmscale retrain --retrain-init scratch` ({proto['retrain_epochs']:g} epochs)") if kind == "np" else \
        (f"one supernet pretrained {proto['pretrain_epochs']:g} epochs per seed; DMS_p searched "
         f"{proto['search_epochs']:g} epochs (`--settle {proto['settle']:g}`); every structure finetuned by the same "
         f"`dmscale retrain` ({proto['finetune_epochs']:g} epochs)")
    lines = [f"## {key}: ResNet-20 (width {setting['width']}), {setting['target']:g} x MACs, {how}", "",
             f"- commands: {invocations_text(info.get(key, {}))}",
             f"- sampler: {n} distinct structures in {smp['window'][0]:g}-{smp['window'][1]:g} x the target "
             f"({smp['target_macs']:,.0f} MACs of {smp['base_macs']:,}); {smp['draws']:,} uniform draws, "
             f"{smp['accepted']} in the window: acceptance {100 * smp['acceptance']:.2f} %; accepted MACs / target "
             f"{min(smp['fractions']):.3f}-{max(smp['fractions']):.3f} (sampler seed {smp['sampler_seed']})",
             f"- seeds with every run done: {seeds}"]
    if not seeds:
        return lines + [""]
    rand = [[runs[f"random/{j}/s{s}"]["acc"] for s in seeds] for j in range(n)]
    means = [statistics.mean(r) for r in rand]
    best = max(range(n), key=means.__getitem__)
    within = statistics.mean(statistics.stdev(r) for r in rand) if len(seeds) > 1 else float("nan")
    lines += [f"- random structures, mean top-1 over the seeds: median {100 * statistics.median(means):.2f} %, best "
              f"{100 * max(means):.2f} (structure {best}), worst {100 * min(means):.2f}; spread of the structure "
              f"means {100 * statistics.stdev(means):.2f} pt (std), spread of one structure over seeds "
              f"{100 * within:.2f} pt (mean std): with {len(seeds)} seeds a structure's mean is known to about "
              f"{100 * within / len(seeds) ** 0.5:.2f} pt",
              f"- MACs / target: random {_exported(setting, 'random/', seeds)}; DMS "
              f"{_exported(setting, LABEL[kind][0] + '/', seeds)}; uniform {_exported(setting, 'uniform/', seeds)}", ""]
    lines += _arm_table(setting, seeds, rand)
    if len(seeds) > ISSUE_SEEDS:  # the issue's protocol, as first run, beside the longer one
        first = seeds[:ISSUE_SEEDS]
        lines += [f"The same on the first {ISSUE_SEEDS} seeds ({first}, the issue's protocol):", ""]
        lines += _arm_table(setting, first, [r[:ISSUE_SEEDS] for r in rand])
    if kind == "np":
        same = [s for s in seeds if f"dms_struct/{s}/s{s}" in runs]
        equal = [s for s in same if runs[f"dms_struct/{s}/s{s}"]["acc"] == runs[f"dms/s{s}"]["acc"]]
        lines += [f"Check: the DMS structure of search seed k retrained with seed k reproduces the pipeline's "
                  f"row at {len(equal)} of {len(same)} seeds.", ""]
    lines += ["Rank is 1 + the number of random structures with a higher mean (ties count half in the "
              "percentile: the share of random structures below). Gap to the best: the best random structure is "
              "picked by its noisy mean, so this gap is biased against DMS (the bootstrap's interval for a maximum "
              "is also too narrow at the top); the paired t holds that structure fixed and only resamples seeds.", "",
              "Random structures by mean top-1 (kept widths per dim | blocks per stage):", "",
              "| rank | structure | MACs / target | top-1 per seed (%) | mean (%) |", "| ---: | --- | ---: | --- | ---: |"]
    for i, j in enumerate(sorted(range(n), key=lambda j: -means[j])):
        lines.append(f"| {i + 1} | {smp['structures'][j]} | {smp['fractions'][j]:.3f} | "
                     + ", ".join(f"{100 * a:.2f}" for a in rand[j]) + f" | {100 * means[j]:.2f} |")
    dms = [f"{runs[LABEL[kind][0] + f'/s{s}']['structure']}" for s in seeds]
    lines += ["", "DMS's structures per seed: " + "; ".join(f"seed {s}: {d}" for s, d in zip(seeds, dms)) + ".", ""]
    return lines


def write_table(cache: dict[str, Any], path: Path) -> Path:
    """``path`` (random_control.md): one section per cached setting, then the kept reading."""
    lines = ["# Random-architecture control: DMS's structure among random structures at equal MACs (issue 50)", "",
             f"- machine: {cache.get('machine', '?')}",
             "- task: ResNet-20 on the bundled 8x8 digits (359 test images: one image = 0.28 pt)",
             "- random structures: every width dim's kept count and every stage's kept block count drawn "
             "uniformly from what the search may choose (`random_control_lib.sample`), accepted when "
             "`dms.count` puts the model within 1 % under the target MACs; each keeps its first channels and "
             "blocks (the uniform baselines' rule); each trained with every seed exactly like DMS's structure",
             "- intervals (95 %) of a gap to the random structures' median or best mean top-1: a percentile "
             "bootstrap (10,000 draws) that resamples the structures and the seeds together (one seed draw "
             "shared by the arm and every structure), and a paired Student-t over seeds of the per-seed gap "
             "(`benchlib.paired_ci`; its best is the structure with the best mean, held fixed)", ""]
    info = cache.get("info", {})
    for key in sorted(cache.get("settings", {})):
        lines += section(key, cache["settings"][key], info)
    reading = kept_reading(path, READING)
    return write_md(path, lines + ([reading.rstrip("\n")] if reading else []))
