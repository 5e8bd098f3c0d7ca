"""DMS_p- against the paper's other gradient-based gates at equal MACs (issue 10, table 1; paper Table 2 + 12).

    python -m bench.gates [--quick] [--seeds 0 1 2] [--target 0.5] [--search-epochs 36.36] [--table-only]

Per seed, one pretrained supernet (the project's ``pretrain`` phase; ResNet-20 of width 8
on the bundled 8x8 digits, the protocol of bench/peers.py), then the same ``--pipeline p-``
search (structure only: weights frozen, Adam on the structural parameters with the
pipeline's default learning rate, the exponential target schedule, the finish phase and the
budget solver, BatchNorm recalibration of the export) with a different gate each:

* ``dms``: DMS's differentiable top-k (the library default);
* ``mes`` / ``sns`` / ``get``: bench/lib/gates_lib.py's multiple element selection,
  single number selection and gradient-estimate top-k;
* ``dms_nonorm``: DMS without importance normalisation (paper Table 12);
* ``uniform``: reference without search: one width multiplier (bench/lib/peers_lib.py), the
  same BatchNorm recalibration.

Reported: top-1 of the export *without retraining*, its exact MACs / target at the search's
end (what the gate's own resource loss reached) and after the finish phase and budget solver
(what is exported), the number of structural parameters, the found structures. Results are
cached per run in ``bench/results/gates.json`` (run directories under ``bench/runs/``, not
committed); the table goes to ``bench/results/gates.md``, the plot to ``gates.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
from bench.lib import gates_lib as gl  # noqa: E402
from bench.lib import peers_lib as pl  # noqa: E402
from bench.lib.benchlib import (add_quick_flags, ci_text, command_line, git_commit, hand_reading, invocations_text,  # noqa: E402
                      load_cache, mean_std, pyplot, quick_mode, record_invocation, save_figure, save_merged,
                      shared_machine, widths, write_md)
import dmscale as dms  # noqa: E402
from dmscale.config.run_config import RunConfig  # noqa: E402
from dmscale.run.pipeline import Pipeline, calibrate_on_task, load_run_model  # noqa: E402
from dmscale.tasks.registry import build_task  # noqa: E402

__all__ = ["METHODS", "GatePipeline", "run_seed", "write_table", "plot", "main"]

RESULTS = ROOT / "bench" / "results"
CACHE = RESULTS / "gates.json"
SEARCHED = ("dms", "mes", "sns", "get", "dms_nonorm")
METHODS = SEARCHED + ("uniform",)
LABELS = {"dms": "DMS_p- (ours)", "mes": "MES", "sns": "SNS", "get": "GET",
          "dms_nonorm": "DMS_p- w/o normalisation", "uniform": "uniform width (no search)"}
SHORT = {"dms": "DMS_p-", "mes": "MES", "sns": "SNS", "get": "GET", "dms_nonorm": "DMS_p-\nno norm.",
         "uniform": "uniform\n(no search)"}
MODEL = {"model": "resnet", "model_args": {"width": 8}}


class GatePipeline(Pipeline):
    """The project's pipeline with another gate in the search (``SearchConfig.gate_factory``)."""

    def __init__(self, cfg: RunConfig, factory: Any) -> None:
        self._factory = factory
        super().__init__(cfg, search_overrides={"gate_factory": factory})


def _run(out: Path, factory: Any = None, **fields: Any) -> dict[str, Any]:
    """One pipeline run in ``out`` (reused when it finished before)."""
    if (out / "summary.json").exists():
        return json.loads((out / "summary.json").read_text())
    if out.exists():  # an interrupted run: start it again
        shutil.rmtree(out)
    cfg = RunConfig(task="digits", **MODEL, quiet=True, out=str(out), **fields).resolved()
    return (GatePipeline(cfg, factory) if factory is not None else Pipeline(cfg)).run()


def _key(cfg: dict[str, Any]) -> str:
    """The cache key of a setting; ``settle`` 0 (the protocol of the first runs, before the
    settle phase existed) keeps the key those runs were stored under."""
    key = "t{target}-pre{pretrain_epochs}-s{search_epochs}".format(**cfg)
    return key + (f"-settle{cfg['settle']}" if cfg.get("settle") else "") + ("-hold" if cfg.get("settle_hold") else "")


def _name(cfg: dict[str, Any]) -> str:
    """Base name of the setting's md / png / reading in bench/results."""
    hold = "_hold" if cfg.get("settle_hold") else ""
    return f"gates_settle{cfg['settle']}{hold}" if cfg.get("settle") else "gates"


def _n_structure(method: str, supernet: torch.nn.Module, example: torch.Tensor) -> int:
    import copy

    work = copy.deepcopy(supernet)
    s = dms.prepare(work, example, dms.SearchConfig(target=0.5, gate_factory=gl.gate_factory(method)))
    return gl.n_structure_params(s.gates)


def run_seed(seed: int, cfg: dict[str, Any], work: Path, threads: int, done: dict[str, Any],
             save: Any = None) -> dict[str, Any]:
    """Every method of one seed that ``done`` lacks, each stored into ``done`` (then ``save()``)."""
    if all(m in done for m in METHODS):
        return done
    pre_dir = work / f"pretrain{cfg['pretrain_epochs']}" / f"seed{seed}"
    pre = _run(pre_dir, command="pretrain", epochs=cfg["pretrain_epochs"], seed=seed, threads=threads)
    task = build_task(RunConfig(task="digits", **MODEL).resolved())
    example = task.example_inputs()
    supernet, _ = load_run_model(pre_dir)
    full = pl.macs(supernet, example)
    for method in METHODS:
        if method in done:
            continue
        out = work / _key(cfg) / f"seed{seed}" / method
        t = time.perf_counter()
        if method == "uniform":
            supernet.eval()
            structure, mult = pl.uniform_structure(supernet, example, cfg["target"])
            small = pl.apply(supernet, structure)
            calibrate_on_task(small, task, 128, seed * 10 + 5, torch.device("cpu"))
            acc = task.evaluate(small, device=torch.device("cpu"))["acc"]
            macs = pl.macs(small, example)
            row = {"acc": acc, "macs": macs, "params": int(dms.count(small, example)["params"]),
                   "search_end": macs / (cfg["target"] * full), "exported": macs / (cfg["target"] * full),
                   "steps": 0, "structure": widths(structure) + f" (multiplier {mult:.3f})", "n_structure": 1}
        else:
            s = _run(out, factory=gl.gate_factory(method), command="search", pipeline="p-", init=str(pre_dir),
                     epochs=cfg["search_epochs"], target=cfg["target"], seed=seed, threads=threads,
                     settle=cfg.get("settle", 0.0), settle_hold=bool(cfg.get("settle_hold", False)))
            end, final = s["resources_search_end"], s["resources"]
            structure = json.loads((out / "structure.json").read_text())
            row = {"acc": s["evals"]["search"]["acc"], "macs": s["counts"]["found"]["macs"],
                   "params": s["counts"]["found"]["params"], "search_end": end["hard"] / end["target"],
                   "exported": final["hard"] / final["target"], "steps": s["steps"],
                   "structure": widths(structure), "n_structure": _n_structure(method, supernet, example),
                   "warnings": s.get("warnings", [])}
        row.update(seed=seed, method=method, seconds=round(time.perf_counter() - t, 1),
                   macs_frac=row["macs"] / full, target=cfg["target"], supernet_macs=full,
                   pretrain_acc=pre["evals"]["pretrain"]["acc"])
        done[method] = row
        print(f"seed {seed} {method:10} acc {100 * row['acc']:6.2f} % | MACs/target at search end "
              f"{row['search_end']:.3f}, exported {row['exported']:.3f} | {row['seconds']:.0f} s", flush=True)
        if save is not None:
            save()
    return done


def _complete(cache: dict[str, Any], key: str) -> list[int]:
    runs = cache["runs"].get(key, {})
    return sorted(int(s) for s, r in runs.items() if all(m in r for m in METHODS))


def write_table(cache: dict[str, Any], key: str) -> Path:
    """``bench/results/gates.md`` for one setting, then the hand-written reading
    ``bench/results/gates_reading.md`` when it exists."""
    setting, info = cache["settings"][key], cache["info"][key]
    have = _complete(cache, key)
    partial = [s for s in info.get("seeds", have) if s not in have]
    runs = cache["runs"].get(key, {})
    lines = ["# DMS_p- vs the paper's other gradient-based gates at equal MACs (issue 10, table 1)", "",
             "The analog of the paper's Table 2 (MES / SNS / GET vs DMS_p-) and Table 12 (no importance "
             "normalisation), on this machine's scale.", "",
             f"- commands (each adds its seeds to the cache): {invocations_text(info)}",
             f"- machine: {cache['machine']}",
             "- task: ResNet-20 (width 8) on the 8x8 digits (1,438 train / 359 test images); one pretrained "
             f"supernet per seed (`dmscale pretrain`, {setting['pretrain_epochs']} epochs, as bench/peers.py)",
             f"- protocol: `--pipeline p- --init <pretrain run>`, {setting['search_epochs']} search epochs for "
             "every gate (weights frozen; Adam, structure lr 0.01; exponential target schedule to "
             f"{setting['target']} x MACs; `--settle {setting.get('settle', 0.0)}`"
             + (" (the settle phase over the last part of the search"
                + (", holding the structure while the exact cost is inside the band: `--settle-hold`)"
                   if setting.get("settle_hold") else ", annealing alone)") if setting.get("settle") else
                " (Eq. 10 to the last step)")
             + "; then the pipeline's finish phase and budget solver, BatchNorm "
             "recalibration of the export); accuracy of the export **without retraining**. Nothing is tuned "
             "per method: each gate gets the same pipeline, learning rate and steps.",
             "- gates (bench/lib/gates_lib.py): MES = one logit per channel/block, Gumbel-sigmoid straight-through, "
             "expected cost; SNS = softmax over every candidate count, mask = sum_j p_j prefix_j by Taylor "
             "importance; GET = DMS's ratio and importance, hard top-k forward, straight-through dm/da = -1; "
             "w/o normalisation = DMS with c'_i = c_i.",
             f"- seeds with every method done: {have}"
             + (f" (**partial**: seeds {partial} still to run with the command above)" if partial else ""),
             "- mean ± standard deviation over seeds; one test image is 0.28 pt", ""]
    if not have:
        return write_md(RESULTS / f"{_name(setting)}.md", lines, end="")
    by = {m: [runs[str(s)][m] for s in have] for m in METHODS}
    first = by["dms"][0]
    lines += [f"Supernet: {first['supernet_macs']:,} MACs; pretrained top-1 "
              f"{mean_std([100 * r['pretrain_acc'] for r in by['dms']])} %.", "",
              "| method | top-1 of the export, no retrain (%) | MACs / target at search end | MACs / target "
              "exported | x supernet MACs | params | N structural params | search time (s) |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for m in METHODS:
        rs = by[m]
        lines.append(f"| {LABELS[m]} | {mean_std([100 * r['acc'] for r in rs])} | {mean_std([r['search_end'] for r in rs], '{:.3f}')} | "
                     f"{mean_std([r['exported'] for r in rs], '{:.3f}')} | {mean_std([r['macs_frac'] for r in rs], '{:.3f}')} | "
                     f"{mean_std([r['params'] for r in rs], '{:,.0f}')} | {rs[0]['n_structure']:,} | "
                     f"{mean_std([r['seconds'] for r in rs], '{:.0f}')} |")
    lines += ["", "DMS_p- minus each method, pt, paired by seed: mean [95 % t-interval], p; per seed:", ""]
    for m in METHODS:
        if m == "dms":
            continue
        d = [100 * (runs[str(s)]["dms"]["acc"] - runs[str(s)][m]["acc"]) for s in have]
        lines.append(f"- vs {LABELS[m]}: {ci_text(d)}; per seed "
                     + ", ".join(f"{x:+.2f}" for x in d) + f"; ahead on {sum(x > 0 for x in d)} of {len(d)}")
    lines += ["", "Structures (kept channels per width group in model order | removable blocks kept per stage):", ""]
    for m in METHODS:
        for r in by[m]:
            lines.append(f"- {m}, seed {r['seed']}: {r['structure']}")
    warned = sorted({w for m in SEARCHED for r in by[m] for w in r.get("warnings", [])})
    if warned:
        lines += ["", "Warnings of the runs:", ""] + [f"- {w}" for w in warned]
    reading = hand_reading(RESULTS / f"{_name(setting)}_reading.md")
    if reading is not None:
        lines += ["", reading]
    return write_md(RESULTS / f"{_name(setting)}.md", lines)


def plot(cache: dict[str, Any], key: str) -> Path | None:
    """``bench/results/gates.png``: accuracy per method (mean ± std, seeds as dots) and the
    MACs / target at the search's end and exported."""
    have = _complete(cache, key)
    if not have:
        return None
    plt = pyplot()
    runs = cache["runs"][key]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    xs = range(len(METHODS))
    for i, m in enumerate(METHODS):
        accs = [100 * runs[str(s)][m]["acc"] for s in have]
        sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
        ax1.bar(i, statistics.mean(accs), yerr=sd, color="C0" if m == "dms" else "C7", capsize=3)
        ax1.plot([i] * len(accs), accs, "k.", ms=4)
        for j, (field, color) in enumerate((("search_end", "C1"), ("exported", "C2"))):
            vals = [runs[str(s)][m][field] for s in have]
            ax2.bar(i + (j - 0.5) * 0.38, statistics.mean(vals), width=0.38, color=color,
                    yerr=statistics.stdev(vals) if len(vals) > 1 else 0.0, capsize=2,
                    label=("at search end (gate's own loss)" if j == 0 else "exported (after finish + solver)")
                    if i == 0 else None)
    for ax in (ax1, ax2):
        ax.set_xticks(list(xs))
        ax.set_xticklabels([SHORT[m] for m in METHODS], fontsize=8)
    ax1.set_ylabel("top-1 of the export, no retrain (%)")
    ax1.set_title(f"Table 1 analog: {cache['settings'][key]['target']} x MACs, seeds {have}")
    ax2.axhline(1.0, color="k", lw=0.8, ls="--")
    ax2.set_ylabel("exact MACs / target")
    ax2.legend(fontsize=7)
    return save_figure(fig, RESULTS / f"{_name(cache['settings'][key])}.png")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_quick_flags(p, "gates", "smoke run: one seed, short pretrain and search", "cache, table and plot", runs=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--target", type=float, default=0.5)
    p.add_argument("--pretrain-epochs", type=float, default=10.0)
    p.add_argument("--search-epochs", type=float, default=36.36,
                   help="36.36 epochs of 11 steps: 400 search iterations (the paper: 800)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--settle", type=float, default=0.0,
                   help="--settle of every search (0: Eq. 10 to the last step, the cached table's "
                        "protocol; 0.4: the library default since; own md/png: gates_settle0.4.*)")
    p.add_argument("--settle-hold", action="store_true",
                   help="with --settle: hold the structure while the exact cost is inside the band "
                        "(SearchConfig.settle_hold, the library default since it was added; own md/png: "
                        "gates_settle0.4_hold.*); without it the settle phase anneals alone, as the "
                        "gates_settle0.4 rows ran")
    p.add_argument("--table-only", action="store_true", help="only rewrite gates.md / gates.png from the cache")
    args = p.parse_args(argv)
    global RESULTS, CACHE
    RESULTS = quick_mode(args, RESULTS, seeds=[0], pretrain_epochs=2.0, search_epochs=2.0)
    CACHE = RESULTS / CACHE.name
    torch.set_num_threads(args.threads)
    cfg = {"target": args.target, "pretrain_epochs": args.pretrain_epochs, "search_epochs": args.search_epochs}
    if args.settle:
        cfg["settle"] = args.settle
        if args.settle_hold:
            cfg["settle_hold"] = True
    elif args.settle_hold:
        p.error("--settle-hold needs --settle (the hold is part of the settle phase)")
    key = _key(cfg)
    RESULTS.mkdir(parents=True, exist_ok=True)
    cache = load_cache(CACHE)
    cache["machine"] = shared_machine(f"{args.threads} thread(s)")
    if args.table_only:
        print(f"wrote {write_table(cache, key)} and {plot(cache, key)}")
        return
    command = command_line("-m bench.gates", argv)
    cache.setdefault("runs", {}).setdefault(key, {})
    cache.setdefault("settings", {})[key] = cfg
    record_invocation(cache.setdefault("info", {}), key, command, git_commit(ROOT), args.seeds)

    def save() -> None:  # invocations with other seeds may share the cache
        cache["runs"][key].update(save_merged(CACHE, cache, key, args.seeds)["runs"][key])

    for seed in args.seeds:
        run_seed(seed, cfg, args.workdir, args.threads, cache["runs"][key].setdefault(str(seed), {}), save)
        save()
        print(f"wrote {write_table(cache, key)} and {plot(cache, key)}", flush=True)


if __name__ == "__main__":
    main()
