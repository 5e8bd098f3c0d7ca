"""Element importance metrics of DMS_np, retrained from scratch (issue 10; paper Table 8, Sec. 5.1).

    python -m bench.importance [--seeds 0 1 ... 9] [--quick] [--table-only]

The paper's ablation: the same DMS_np search with another element importance (its Eq. 4
moving average of a per-element score), then the found structure retrained from scratch. Here
on the setting where the budget binds (``bench/np_uniform.py --width 4``: ResNet-20 of width 4
on the 8x8 digits, 0.25 x its MACs), each arm the same search (10 epochs, the library's
defaults: settle phase with the hold) and the same retraining (20 epochs from scratch) as
that table's ``dms@hold`` rows, one pipeline per (metric, seed):

* ``taylor``: (m g)^2, moving average with decay 0.99 (the default, Molchanov et al.);
* ``taylor_step``: (m g)^2 of the current batch alone (decay 0: the paper's "Taylor w/o moving
  average"), through ``SearchConfig.gate_factory``;
* ``snip``: abs(m g) (Lee et al.); ``fisher``: g^2 (Liu et al.), both moving averages;
* ``index``: static, earlier elements more important, never updated.

Reported per metric: top-1 of the export before retraining (BatchNorm recalibrated) and after
it, the exact MACs / target where the search ended (the loss alone) and of the export, paired
95 % intervals against ``taylor``; uniform width at the same MACs from ``np_uniform_w4.json``
(same retraining, same seeds) as the reference line. The ``taylor`` rows repeat that table's
``dms@hold`` runs, and the table says whether they reproduce them. Cached per run in
``bench/results/importance.json``; table ``importance.md``, plot ``importance.png``. ``--quick``
(one seed, half an epoch of search and of retraining) writes only under ``WORKDIR/quick/``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
from bench.lib import np_uniform_runs as np_uniform  # noqa: E402
from bench.lib.benchlib import (add_quick_flags, hand_reading, load_cache, locked, paired_ci, pyplot, quick_mode,  # noqa: E402
                      save_cache, save_figure, write_md)
from dmscale.core.topk import DifferentiableTopK  # noqa: E402

__all__ = ["METRICS", "search_overrides", "run", "write_table", "main"]

RESULTS = ROOT / "bench" / "results"
CACHE = RESULTS / "importance.json"
REFERENCE = RESULTS / "np_uniform_w4.json"  # its uniform and dms@hold rows, same protocol
METRICS = ("taylor", "taylor_step", "snip", "fisher", "index")
LABELS = {"taylor": "Taylor (m g)^2, moving average (default)",
          "taylor_step": "Taylor w/o moving average (decay 0)",
          "snip": "SNIP abs(m g), moving average", "fisher": "Fisher g^2, moving average",
          "index": "index (static)"}
WIDTH, TARGET, SEARCH_EPOCHS, RETRAIN_EPOCHS = 4, 0.25, 10.0, 20.0


def search_overrides(metric: str) -> dict[str, Any]:
    """The :class:`dmscale.SearchConfig` fields that make the search use ``metric``.

    Example:
        >>> search_overrides("snip")
        {'importance': 'snip'}
        >>> search_overrides("taylor_step")["gate_factory"].keywords
        {'decay': 0.0}
    """
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}: expected one of {METRICS}")
    if metric == "taylor_step":
        return {"gate_factory": functools.partial(DifferentiableTopK, decay=0.0)}
    return {} if metric == "taylor" else {"importance": metric}


def _key(metric: str, seed: int, search_epochs: float, retrain_epochs: float) -> str:
    return f"{metric}/s{seed}/S{search_epochs}/R{retrain_epochs}"


def run(metric: str, seed: int, search_epochs: float, retrain_epochs: float, threads: int,
        base: tuple[int, Any], workdir: Path) -> dict[str, Any]:
    """One DMS_np search with ``metric`` and its retraining (np_uniform's ``dms`` arm)."""
    np_uniform.WORK = workdir / metric
    row = np_uniform.run_arm("dms", TARGET, seed, search_epochs, retrain_epochs, threads, base,
                             settle=0.4, settle_hold=True, search_overrides=search_overrides(metric))
    row.update(metric=metric, importance_decay=0.0 if metric == "taylor_step" else
               (None if metric == "index" else 0.99))
    for bulky in ("during", "stability", "kept_search_end", "kept_after_finish", "ratios_search_end"):
        row.pop(bulky, None)  # np_uniform's diagnostics; the structure and counts stay
    return row


def _reference(seeds: list[int], search_epochs: float, retrain_epochs: float) -> dict[str, dict[int, dict]]:
    """np_uniform_w4.json's uniform and dms@hold rows at this protocol, by seed."""
    if not REFERENCE.is_file():
        return {}
    runs = json.loads(REFERENCE.read_text())["runs"]
    out: dict[str, dict[int, dict]] = {"uniform": {}, "dms@hold": {}}
    for s in seeds:
        for arm, s_ep in (("uniform", 0.0), ("dms@hold", search_epochs)):
            r = runs.get(np_uniform.run_key(arm, TARGET, s, s_ep, retrain_epochs))
            if r is not None:
                out[arm][s] = r
    return out


def _pct(values: list[float]) -> str:
    if len(values) == 1:
        return f"{100 * values[0]:.2f}"
    return f"{100 * statistics.mean(values):.2f} ± {100 * statistics.stdev(values):.2f}"


def _paired(a: dict[int, float], b: dict[int, float]) -> str:
    seeds = sorted(set(a) & set(b))
    if len(seeds) < 2:
        return "-"
    mean, lo, hi, p = paired_ci([100 * (a[s] - b[s]) for s in seeds])
    wins = sum(a[s] > b[s] for s in seeds)
    return f"{mean:+.2f} [{lo:+.2f}, {hi:+.2f}], p = {p:.2f}, ahead on {wins}/{len(seeds)}"


def write_table(cache: dict[str, Any], out: Path) -> Path:
    """``out/importance.md`` and ``importance.png`` from every cached run."""
    rows = list(cache["runs"].values())
    s_ep, r_ep = rows[0]["search_epochs"], rows[0]["retrain_epochs"]
    by = {m: {r["seed"]: r for r in rows if r["metric"] == m} for m in METRICS}
    seeds = sorted({r["seed"] for r in rows})
    ref = _reference(seeds, s_ep, r_ep)
    lines = ["# Element importance metrics of DMS_np (paper Table 8), retrained from scratch", "",
             "Written by `bench/importance.py` (protocol in its docstring); `--table-only` rewrites it from "
             "`bench/results/importance.json`. Last command: `" + cache.get("last_command", "?") + "`.", "",
             f"Commits: {', '.join(sorted({'`' + r['commit'] + '`' for r in rows}))}; machine: "
             f"{cache.get('machine', '?')}. ResNet-20 of width {WIDTH} on the 8x8 digits (359 test images: "
             f"1 image = 0.28 pt), DMS_np at {TARGET} x its MACs, {s_ep:g} search epochs (settle phase "
             f"with the hold, the defaults), {r_ep:g} epochs of retraining from scratch; seeds "
             f"{', '.join(map(str, seeds))}.", "",
             "| importance | seeds | top-1 before retraining (%) | before, vs Taylor (pt, paired 95 % CI) | "
             "top-1 after retraining (%) | after, vs Taylor (pt, paired 95 % CI) | search end / target | "
             "in [0.98, 1.00] by the loss alone | exported / target |",
             "| --- | ---: | ---: | --- | ---: | --- | ---: | ---: | ---: |"]
    taylor = {s: r["acc"] for s, r in by["taylor"].items()}
    taylor_before = {s: r["acc_search"] for s, r in by["taylor"].items()}
    for m in METRICS:
        rs = [by[m][s] for s in sorted(by[m])]
        if not rs:
            continue
        band = sum(0.98 <= r["search_end"] <= 1.0 for r in rs)
        vs = "-" if m == "taylor" else _paired({s: r["acc"] for s, r in by[m].items()}, taylor)
        vs0 = "-" if m == "taylor" else _paired({s: r["acc_search"] for s, r in by[m].items()}, taylor_before)
        lines.append(f"| {LABELS[m]} | {len(rs)} | {_pct([r['acc_search'] for r in rs])} | {vs0} | "
                     f"**{_pct([r['acc'] for r in rs])}** | {vs} | "
                     f"{statistics.mean(r['search_end'] for r in rs):.3f} | {band}/{len(rs)} | "
                     f"{statistics.mean(r['exported'] for r in rs):.3f} |")
    if ref.get("uniform"):
        u = ref["uniform"]
        lines.append(f"| uniform width, no search (`np_uniform_w4.json`) | {len(u)} | - | - | "
                     f"{_pct([r['acc'] for r in u.values()])} | "
                     f"{_paired({s: r['acc'] for s, r in u.items()}, taylor)} | - | - | "
                     f"{statistics.mean(r['exported'] for r in u.values()):.3f} |")
    lines += ["", "Before retraining is informative for the search itself: the export with its searched "
              "weights, BatchNorm recalibrated. After retraining is the paper's protocol."]
    if ref.get("dms@hold"):
        same = [s for s, r in by["taylor"].items() if s in ref["dms@hold"]]
        equal = [s for s in same if ref["dms@hold"][s]["acc"] == by["taylor"][s]["acc"]
                 and ref["dms@hold"][s]["structure"] == by["taylor"][s]["structure"]]
        lines += ["", f"Reproduction: the `taylor` rows repeat `np_uniform_w4.json`'s `dms@hold` runs; "
                  f"{len(equal)} of {len(same)} seeds give the same structure and the same top-1 "
                  "after retraining to the last digit."]
    lines += ["", "Structures (kept widths per group | blocks per stage), seed by seed:", ""]
    for m in METRICS:
        for s in sorted(by[m]):
            lines.append(f"- {m} seed {s}: {by[m][s]['structure']}")
    reading = hand_reading(RESULTS / "importance_reading.md", strip=False)
    if reading is not None:
        lines += ["", reading]
    md = write_md(out / "importance.md", lines)
    _plot(by, ref.get("uniform", {}), out / "importance.png")
    return md


def _plot(by: dict[str, dict[int, dict]], uniform: dict[int, dict], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    names = [m for m in METRICS if by[m]]
    for i, m in enumerate(names):
        accs = [100 * r["acc"] for r in by[m].values()]
        ax.scatter([i] * len(accs), accs, s=16, alpha=0.6)
        ax.plot([i - 0.25, i + 0.25], [statistics.mean(accs)] * 2, color="black")
    if uniform:
        ax.axhline(100 * statistics.mean(r["acc"] for r in uniform.values()), ls="--", color="grey",
                   label="uniform width (mean)")
        ax.legend(fontsize=8)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([m.replace("_", "\n") for m in names], fontsize=8)
    ax.set_ylabel("top-1 after retraining (%)")
    ax.set_title(f"DMS_np importance metrics, ResNet-20 w{WIDTH}, {TARGET} x MACs (one point per seed)", fontsize=9)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    p.add_argument("--metrics", nargs="+", choices=METRICS, default=list(METRICS))
    p.add_argument("--threads", type=int, default=1)
    add_quick_flags(p, "importance", "smoke run: one seed, half an epoch each, under WORKDIR/quick", "cache, table and plot",
                    runs=True)
    p.add_argument("--table-only", action="store_true", help="only rewrite the table and plot from the cache")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    global RESULTS, CACHE
    s_ep, r_ep = (0.5, 0.5) if args.quick else (SEARCH_EPOCHS, RETRAIN_EPOCHS)
    RESULTS = quick_mode(args, RESULTS, seeds=[0])  # --quick: nothing of bench/results is written
    CACHE = RESULTS / CACHE.name
    RESULTS.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    np_uniform.use(width=WIDTH)
    if not args.table_only:
        base = np_uniform.baseline()
        machine = f"{os.cpu_count()} CPUs ({platform.machine()}), torch {torch.__version__}, {args.threads} thread(s)"
        for seed in args.seeds:
            for metric in args.metrics:
                key = _key(metric, seed, s_ep, r_ep)
                with locked(CACHE):
                    done = key in load_cache(CACHE, {"runs": {}})["runs"]
                if done:
                    continue
                row = run(metric, seed, s_ep, r_ep, args.threads, base, args.workdir)
                with locked(CACHE):  # read-modify-write: invocations with other seeds share the cache
                    cache = load_cache(CACHE, {"runs": {}})
                    cache["runs"][key] = row
                    cache["machine"], cache["last_command"] = machine, "python -m bench.importance " + " ".join(argv)
                    save_cache(CACHE, cache)
                print(f"{key}: top-1 {100 * row['acc_search']:.2f} % before, {100 * row['acc']:.2f} % after "
                      f"retraining; search end {row['search_end']:.3f} x target", flush=True)
    cache = json.loads(CACHE.read_text())
    print(write_table(cache, RESULTS).read_text())


if __name__ == "__main__":
    main()
