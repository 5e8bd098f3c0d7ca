"""The tables of ``bench/results/np_uniform.md`` from the cache of ``bench/np_uniform.py``.

Everything above ``## Findings`` is regenerated from ``bench/results/np_uniform.json``; the
hand-written findings below that heading are kept as they are.

Example:
    >>> [round(g, 6) for g in paired_gap([{"seed": 0, "acc": 0.9}, {"seed": 1, "acc": 0.8}],
    ...                                  [{"seed": 0, "acc": 0.85}, {"seed": 1, "acc": 0.8}])]
    [5.0, 0.0]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
from bench.lib.benchlib import ci_text, kept_reading, paired_diff, pyplot, save_figure, spread, write_md  # noqa: E402
from bench.lib.np_fastnas_table import fastnas_lines  # noqa: E402

__all__ = ["paired_gap", "write_table", "plot", "FINDINGS"]

RESULTS = ROOT / "bench" / "results"
FINDINGS = "## Findings"


def paired_gap(rows: list[dict[str, Any]], base: list[dict[str, Any]]) -> list[float]:
    """Top-1 points of ``rows`` minus ``base`` for each seed both have (seed order)."""
    return paired_diff(rows, base, "acc")


def _sel(runs: list[dict[str, Any]], **kw: Any) -> list[dict[str, Any]]:
    return sorted([r for r in runs if all(r.get(k) == v for k, v in kw.items())], key=lambda r: r["seed"])


def _stage_means(row: dict[str, Any], field: str) -> str:
    """Mean effective kept fraction of the width dims, and the blocks kept per stage."""
    kept, nw = row[field], row["n_width"]
    widths = [k for k in kept[:nw] if k > 0]  # dims that exist in the export
    return f"{statistics.mean(widths):.2f} / " + "-".join(f"{k:.2f}" for k in kept[nw:])


def _width_spread(row: dict[str, Any], field: str) -> float:
    """Std of the kept fractions of the width dims that exist in the export (uniform: ~0)."""
    return statistics.pstdev([k for k in row[field][:row["n_width"]] if k > 0])


def _searched(row: dict[str, Any]) -> bool:
    """Whether a row comes from a traced DMS search (uniform and FastNAS rows do not)."""
    return "search_end" in row


def _cell(structure: str) -> str:
    return structure.replace(" | ", "; ")


def _main_table(runs: list[dict[str, Any]], s_ep: float, r_ep: float) -> list[str]:
    lines = ["| target | arm | seeds | exported MACs / target | top-1 after retrain (%) | vs uniform, paired (pt): mean [95 % t-interval], p "
             "| MACs / target at search end | finish steps | solver ran | post-hoc shift of kept fractions |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for target in sorted({r["target"] for r in runs}, reverse=True):
        uni = _sel(runs, arm="uniform", target=target, retrain_epochs=r_ep)
        for arm in ("uniform", *sorted({r["arm"] for r in runs} - {"uniform"})):
            rs = uni if arm == "uniform" else _sel(runs, arm=arm, target=target, search_epochs=s_ep,
                                                   retrain_epochs=r_ep)
            if not rs:
                continue
            gap = paired_gap(rs, uni) if arm != "uniform" else []
            plain = not _searched(rs[0])  # uniform, or a peer's structure (no DMS search to trace)
            search = "-" if plain else spread([r["search_end"] for r in rs], 2)
            fin = "-" if plain else spread([float(r["finish_steps"]) for r in rs], 0)
            sol = "-" if plain else f"{sum(r['solver_ran'] for r in rs)}/{len(rs)}"
            shift = "-" if plain else spread([r["shift_posthoc"]["mean_abs"] for r in rs], 3)
            lines.append(f"| {target} | {arm} | {len(rs)} | {spread([r['exported'] for r in rs])} | "
                         f"{spread([100 * r['acc'] for r in rs], 2)} | {ci_text(gap) if gap else '-'} | "
                         f"{search} | {fin} | {sol} | {shift} |")
    return lines


def _sweep_table(runs: list[dict[str, Any]], r_ep: float) -> list[str]:
    arms = sorted({r["arm"] for r in runs if r["arm"] == "dms" or r["arm"].startswith("dms@")})
    lines = ["| target | arm | search epochs (steps) | seeds | MACs / target at search end | finish steps "
             "| shift by finish | shift by solver | importance Spearman at 50 % vs end | top-1 after retrain (%) "
             "| vs uniform, paired (pt): mean [95 % t-interval], p |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for target in sorted({r["target"] for r in runs}, reverse=True):
        uni = _sel(runs, arm="uniform", target=target, retrain_epochs=r_ep)
        for arm in arms:
            for s_ep in sorted({r["search_epochs"] for r in runs if r["arm"] == arm}):
                rs = _sel(runs, arm=arm, target=target, search_epochs=s_ep, retrain_epochs=r_ep)
                if not rs:
                    continue
                mid = [min(r["stability"], key=lambda x: abs(x["progress"] - 0.5))["spearman"] for r in rs]
                gap = paired_gap(rs, uni)
                lines.append(
                    f"| {target} | {arm} | {s_ep:g} ({rs[0]['search_steps'] - rs[0]['finish_steps']}) | {len(rs)} | "
                    f"{spread([r['search_end'] for r in rs], 2)} | "
                    f"{spread([float(r['finish_steps']) for r in rs], 0)} | "
                    f"{spread([r['shift_finish']['mean_abs'] for r in rs], 3)} | "
                    f"{spread([r['shift_solver']['mean_abs'] for r in rs], 3)} | {spread(mid, 2)} | "
                    f"{spread([100 * r['acc'] for r in rs], 2)} | {ci_text(gap) if gap else '-'} |")
    return lines


def _structures(runs: list[dict[str, Any]], s_ep: float, r_ep: float) -> list[str]:
    lines = ["| target | arm | seed | structure (kept widths per dim, blocks per stage) | mean width kept / blocks "
             "per stage: search end | after finish | exported | std of kept width fractions: search end / exported "
             "| top-1 (%) |", "| ---: | --- | ---: | --- | --- | --- | --- | --- | ---: |"]
    for r in sorted(runs, key=lambda r: (-r["target"], r["arm"], r["seed"])):
        if r["retrain_epochs"] != r_ep or (r["arm"] != "uniform" and r["search_epochs"] != s_ep):
            continue
        if r["arm"] == "uniform":
            lines.append(f"| {r['target']} | uniform (x{r['multiplier']:.3f}) | {r['seed']} | {_cell(r['structure'])} "
                         f"| - | - | - | - | {100 * r['acc']:.2f} |")
            continue
        if not _searched(r):
            lines.append(f"| {r['target']} | {r['arm']} | {r['seed']} | {_cell(r['structure'])} "
                         f"| - | - | - | - | {100 * r['acc']:.2f} |")
            continue
        lines.append(f"| {r['target']} | {r['arm']} | {r['seed']} | {_cell(r['structure'])} | "
                     f"{_stage_means(r, 'kept_search_end')} | {_stage_means(r, 'kept_after_finish')} | "
                     f"{_stage_means(r, 'kept_final')} | {_width_spread(r, 'kept_search_end'):.3f} / "
                     f"{_width_spread(r, 'kept_final'):.3f} | {100 * r['acc']:.2f} |")
    return lines


def _stability(runs: list[dict[str, Any]], r_ep: float) -> list[str]:
    rows = [r for r in runs if _searched(r) and r["retrain_epochs"] == r_ep]
    marks = (0.1, 0.3, 0.5, 0.7, 0.9)
    lines = ["Mean over seeds of the importance Spearman correlation with the search's end (averaged over "
             "gates) and, in brackets, the share of the exported model's kept units already in the top-k "
             "(at the exported counts):", "",
             "| target | arm | search epochs | " + " | ".join(f"{int(100 * m)} %" for m in marks) + " |",
             "| ---: | --- | ---: |" + " ---: |" * len(marks)]
    for key in sorted({(r["target"], r["arm"], r["search_epochs"]) for r in rows}, key=lambda k: (-k[0], k[1], k[2])):
        rs = [r for r in rows if (r["target"], r["arm"], r["search_epochs"]) == key]
        cells = []
        for m in marks:
            pts = [min(r["stability"], key=lambda x: abs(x["progress"] - m)) for r in rs]
            cells.append(f"{statistics.mean(p['spearman'] for p in pts):.2f} "
                         f"({statistics.mean(p['topk_agreement'] for p in pts):.2f})")
        lines.append(f"| {key[0]} | {key[1]} | {key[2]:g} | " + " | ".join(cells) + " |")
    return lines


DIGITS = "the 8x8 digits (359 test images: 1 image = 0.28 pt)"


def write_table(cache: dict[str, Any], command: str, s_ep: float = 10.0, r_ep: float = 20.0,
                name: str = "np_uniform", dataset: str = DIGITS, width: int = 8) -> Path:
    """Regenerate the tables of ``NAME.md`` and its plot ``NAME.png`` (keeping the md's
    hand-written findings); ``dataset`` says what the runs trained and tested on."""
    runs = list(cache["runs"].values())
    commits = sorted({r["commit"] for r in runs})
    out = RESULTS / f"{name}.md"
    findings = kept_reading(out, FINDINGS) or f"{FINDINGS}\n\n(not written yet)\n"
    lines = ["# DMS_np vs uniform width at equal MACs, retrained from scratch (issue 10, table 3)", "",
             f"- command (last invocation): `{command}`; the cache holds every invocation's runs",
             f"- commit(s) of the runs: {', '.join('`' + c + '`' for c in commits)}; machine: {cache.get('machine')}",
             f"- setup: ResNet-20 (width {width}) on {dataset}. Structures at "
             "t x the baseline's exact MACs: `uniform` = one width multiplier; `dms` = DMS_np searched from the "
             "baseline (`--pipeline np --target t`); `dms_expand` = DMS_np searched from the baseline with "
             "`--expand width=1.5,depth=2` (4.6x its MACs) down to t x the baseline's MACs; `dms_width` = `dms` with "
             "`--search-dims width` (a diagnostic: depth kept whole). CLI defaults otherwise "
             f"(SGD lr 0.05, structure lr 0.01 Adam, resource weight 1, Eq. 10 schedule, soft r_c). Search {s_ep:g} "
             f"epochs unless stated; every structure then trained from scratch by the same `dmscale retrain "
             f"--retrain-init scratch` for {r_ep:g} epochs (same seed: same initialisation and batches).",
             "- exported = exact MACs (`dms.count`) of the retrained model / (t x baseline MACs). Shift = mean "
             "|difference| of the effective kept fractions (width dims, 0 when all their producers sit in removed "
             "blocks; blocks per stage) between two snapshots of one search.", "",
             f"## Table 3 analog: equal MACs, same from-scratch training (search {s_ep:g} epochs)", "",
             *_main_table(runs, s_ep, r_ep), "",
             "## Search length (DMS_np from the baseline)", "", *_sweep_table(runs, r_ep), "",
             "## Importance stability across the search", "", *_stability(runs, r_ep), "",
             *fastnas_lines(cache, s_ep, r_ep),
             f"## Structures (search {s_ep:g} epochs)", "", *_structures(runs, s_ep, r_ep), "", findings.rstrip(), ""]
    write_md(out, lines, end="")
    if runs:
        plot(runs, s_ep, r_ep, name, dataset.split(" (")[0], width)
    return out


def plot(runs: list[dict[str, Any]], s_ep: float = 10.0, r_ep: float = 20.0, name: str = "np_uniform",
         data: str = "the 8x8 digits", width: int = 8) -> Path:
    """``np_uniform.png``: top-1 after retraining against exported MACs / target, one panel per
    target; every seed a faint point, each arm's mean ± std a bold one."""
    plt = pyplot()
    targets = sorted({r["target"] for r in runs}, reverse=True)
    fig, axes = plt.subplots(1, len(targets), figsize=(5 * len(targets), 3.8), squeeze=False)
    for ax, target in zip(axes[0], targets):
        # the first four: the protocol with --settle 0; the @hold rows: the library's default now
        for i, arm in enumerate(("uniform", "dms", "dms_expand", "dms_width", "dms@hold", "dms_expand@hold",
                                 "fastnas")):
            rs = _sel(runs, arm=arm, target=target, retrain_epochs=r_ep)
            rs = [r for r in rs if arm == "uniform" or r["search_epochs"] == s_ep]
            if not rs:
                continue
            xs, ys = [r["exported"] for r in rs], [100 * r["acc"] for r in rs]
            ax.scatter(xs, ys, color=f"C{i}", alpha=0.3, s=14)
            sd = statistics.stdev(ys) if len(ys) > 1 else 0.0
            ax.errorbar(statistics.mean(xs), statistics.mean(ys), yerr=sd, color=f"C{i}", marker="o",
                         capsize=3, label=f"{arm} ({len(rs)} seeds)")
        ax.set_title(f"{target} x the baseline's MACs" + (" (the baseline itself)" if target == 1.0 else ""))
        ax.set_xlabel("exported MACs / target")
        ax.set_ylabel("top-1 after retraining from scratch (%)")
        ax.legend(fontsize=8)
    fig.suptitle(f"DMS_np vs uniform width, ResNet-20 (width {width}) on {data}")
    return save_figure(fig, RESULTS / f"{name}.png")
