"""Search cost of DMS_p- vs evolutionary search on the same pretrained supernet (issue 10, table 3).

    python -m bench.evolution [--quick] [--seeds 0 1 2] [--generations 10] [--name evolution] [--table-only]

The analog of the paper's Table 3 (search cost of DMS vs evolutionary / NAS methods). Per
seed, the pretrained supernet of bench/gates.py (ResNet-20 width 8 on the 8x8 digits,
``dmscale pretrain`` 10 epochs), and at the same 0.5 x MACs target:

* **DMS_p-**: the project's ``--pipeline p-`` search exactly as in bench/gates.py (400 steps,
  finish phase, budget solver, BatchNorm recalibration of the export), run in this process
  and timed in **process CPU seconds** (``time.process_time``: the machine is shared, wall
  time is not the cost);
* **evolution** (bench/lib/evolution_lib.py): SPOS/OFA-style constrained evolutionary search over
  the same per-gate counts (15 on ResNet-20, 33 with ``--depth 56``), population 50, top 10 parents, 25 mutation +
  25 crossover children, 10 generations (at most 550 distinct candidates, and at most 420 CPU
  seconds: each run stays under 8 minutes); elements ranked by DMS's own Taylor importance
  from a short importance-only pass at DMS's initial masks (20 batches); fitness = top-1 on a
  held-out 20 % of the *training* images of the hardened supernet after BatchNorm
  recalibration on the other 80 % (5 batches of 128 per candidate, OFA's "a few batches").
  Its clock (CPU seconds) starts before the task, supernet and searcher are built, as DMS's.

For every new best candidate of the evolution, its **test** top-1 (hardened supernet, the
pipeline's export recalibration on the training set, no retraining: DMS_p-'s protocol) is
computed after the search, off its clock. Reported: the evolution's CPU seconds to first
reach DMS_p-'s mean test top-1 (or that it never did in its budget), and the ratio to
DMS_p-'s CPU seconds. Cache: ``bench/results/evolution.json`` (per seed and method); table
``evolution.md``; plot ``evolution.png``.
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
from bench.lib import evolution_lib as el  # noqa: E402
from bench.lib.benchlib import (add_quick_flags, command_line, git_commit, hand_reading, invocations_text, load_cache,  # noqa: E402
                      locked, mean_std, pyplot, quick_mode, record_invocation, save_cache, save_figure,
                      shared_machine, widths, write_md)
import dmscale as dms  # noqa: E402
from dmscale.config.run_config import RunConfig  # noqa: E402
from dmscale.export.files import load_weights  # noqa: E402
from dmscale.run.pipeline import Pipeline, calibrate_on_task  # noqa: E402
from dmscale.run.saved_runs import make_searcher, new_supernet  # noqa: E402
from dmscale.tasks.image import ClassificationTask  # noqa: E402
from dmscale.tasks.registry import build_task  # noqa: E402

__all__ = ["BenchConfig", "run_dms", "run_evolution", "reach", "write_table", "plot", "main"]

RESULTS = ROOT / "bench" / "results"
NAME = "evolution"
CACHE = RESULTS / f"{NAME}.json"
MODEL = {"model": "resnet", "model_args": {"width": 8}}  # depth 20: the cached rows' supernet


def _model(depth: int) -> dict[str, Any]:
    """The supernet's ``RunConfig`` fields: ResNet-``depth`` of width 8 (20 keeps MODEL as it was)."""
    return MODEL if depth == 20 else {**MODEL, "model_args": {**MODEL["model_args"], "depth": depth}}


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """One setting of the table; nothing in it differs between the two methods but the search."""

    target: float = 0.5
    pretrain_epochs: float = 10.0
    search_epochs: float = 36.36  # DMS_p-: 400 steps of 128 images (as bench/gates.py)
    batch_size: int = 128
    val_fraction: float = 0.2
    importance_steps: int = 20
    fitness_bn_batches: int = 5  # the evolution's per-candidate recalibration (reported accuracy: 20, as DMS)
    evolution: el.EvolutionConfig = el.EvolutionConfig(generations=10, max_seconds=420.0)
    settle: float = 0.0  # DMS_p-'s --settle (0: the cached rows' protocol, before the settle phase)
    settle_hold: bool = False  # DMS_p-'s --settle-hold (False: the cached rows' protocol, before the hold)
    depth: int = 20  # ResNet depth of the supernet (6n + 2; 56: 33 structural dimensions instead of 15)

    def __post_init__(self) -> None:
        if not 0 < self.target <= 1:
            raise ValueError(f"target must be a fraction in (0, 1], got {self.target}")
        if self.fitness_bn_batches < 1:
            raise ValueError(f"fitness_bn_batches must be >= 1, got {self.fitness_bn_batches}")
        if self.importance_steps < 1:
            raise ValueError(f"importance_steps must be >= 1, got {self.importance_steps}")
        if self.depth < 8 or (self.depth - 2) % 6:
            raise ValueError(f"depth must be 6n + 2 with n >= 1 (20, 32, 56, ...), got {self.depth}")
        if self.settle_hold and not self.settle:
            raise ValueError("settle_hold needs settle > 0 (the hold is part of the settle phase)")

    def key(self) -> str:
        e = self.evolution
        return ((f"d{self.depth}-" if self.depth != 20 else "") + f"t{self.target}-pre{self.pretrain_epochs}-s{self.search_epochs}"
                f"-evo{e.population}x{e.generations}-imp{self.importance_steps}-bn{self.fitness_bn_batches}"
                + (f"-settle{self.settle}" if self.settle else "") + ("-hold" if self.settle_hold else "")
                + (f"-cap{e.max_seconds}" if e.max_seconds not in (None, 420.0) else ""))

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _search_cfg(bc: BenchConfig, seed: int, pre_dir: Path, out: Path) -> RunConfig:
    return RunConfig(task="digits", **_model(bc.depth), quiet=True, out=str(out), command="search", pipeline="p-",
                     init=str(pre_dir), epochs=bc.search_epochs, target=bc.target, seed=seed, threads=1,
                     batch_size=bc.batch_size, settle=bc.settle,
                     settle_hold=bc.settle_hold).resolved()


def _pretrain(bc: BenchConfig, seed: int, work: Path) -> Path:
    """The pretrained supernet of ``seed`` (bench/gates.py's protocol; reused when present)."""
    out = work / (f"pretrain{bc.pretrain_epochs}" + (f"-d{bc.depth}" if bc.depth != 20 else "")) / f"seed{seed}"
    if not (out / "summary.json").exists():
        shutil.rmtree(out, ignore_errors=True)
        Pipeline(RunConfig(task="digits", **_model(bc.depth), quiet=True, out=str(out), command="pretrain",
                           epochs=bc.pretrain_epochs, seed=seed, threads=1).resolved()).run()
    return out


def run_dms(bc: BenchConfig, seed: int, pre_dir: Path, work: Path) -> dict[str, Any]:
    """DMS_p- of bench/gates.py, timed in process CPU seconds (always a fresh run)."""
    out = work / bc.key() / f"seed{seed}" / "dms"
    shutil.rmtree(out, ignore_errors=True)
    cpu, wall = time.process_time(), time.perf_counter()
    s = Pipeline(_search_cfg(bc, seed, pre_dir, out)).run()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return {"acc": s["evals"]["search"]["acc"], "macs": s["counts"]["found"]["macs"], "steps": s["steps"],
            "cpu_s": round(cpu, 2), "wall_s": round(wall, 2),
            "structure": json.loads((out / "structure.json").read_text())}


def _fit_task(task: ClassificationTask, bc: BenchConfig, seed: int) -> ClassificationTask:
    """The training images split into a fit part (train batches) and a held-out validation part
    (its ``evaluate``); the test split is never seen by the search."""
    (xf, yf), (xv, yv) = el.hold_out(task.x_train, task.y_train, bc.val_fraction, seed)
    return ClassificationTask("digits-fit", xf, yf, xv, yv, task.num_classes)


def _searcher(bc: BenchConfig, seed: int, pre_dir: Path, task: Any) -> tuple[torch.nn.Module, dms.Searcher]:
    cfg = _search_cfg(bc, seed, pre_dir, pre_dir)  # the DMS run's search options
    model, exclude = new_supernet(cfg, task.info, seed)
    load_weights(model, pre_dir / "model.safetensors")
    return model, make_searcher(cfg, model, task.example_inputs(), exclude)


def _test_acc(space: el.SearchSpace, model: torch.nn.Module, task: Any, bc: BenchConfig, seed: int,
              counts: tuple[int, ...]) -> float:
    """Test top-1 of ``counts`` under DMS_p-'s export protocol (recalibration on the training set)."""
    space.set(counts)
    with space.searcher.hardened():
        calibrate_on_task(model, task, bc.batch_size, seed * 10 + 5)
        return float(task.evaluate(model)["acc"])


def run_evolution(bc: BenchConfig, seed: int, pre_dir: Path) -> dict[str, Any]:
    """The evolutionary search of one seed: its improvements with CPU time stamps and test top-1."""
    clock = el.CpuClock()
    task = build_task(RunConfig(task="digits", **_model(bc.depth), seed=seed).resolved())
    fit = _fit_task(task, bc, seed)
    model, searcher = _searcher(bc, seed, pre_dir, task)
    n = el.importance_pass(searcher, model, (fit.train_batch(i, bc.batch_size, seed) for i in range(bc.importance_steps)),
                           lambda m, x, y: task.task_loss(task.forward(m, x), y))
    t_importance = clock()
    space = el.SearchSpace.of(searcher)
    fitness = el.supernet_fitness(space, model, lambda m: calibrate_on_task(m, fit, bc.batch_size, seed * 10 + 5,
                                                                                  n_batches=bc.fitness_bn_batches),
                                  lambda m: fit.evaluate(m)["acc"])
    result = el.evolve(space, fitness, dataclasses.replace(bc.evolution, seed=seed), clock)
    total = clock()
    curve = [{"cpu_s": round(i.seconds, 2), "evaluations": i.evaluations, "generation": i.generation,
              "val_acc": i.candidate.fitness, "cost": i.candidate.cost, "counts": list(i.candidate.counts),
              "test_acc": _test_acc(space, model, task, bc, seed, i.candidate.counts)} for i in result.improvements]
    space.set(result.best.counts)
    small = searcher.export()  # the best candidate's export: same count, same test top-1
    calibrate_on_task(small, task, bc.batch_size, seed * 10 + 5)
    export_acc, export_macs = float(task.evaluate(small)["acc"]), int(dms.count(small, task.example_inputs())["macs"])
    return {"curve": curve, "cpu_s": round(total, 2), "importance_cpu_s": round(t_importance, 2),
            "importance_batches": n, "evaluations": len(result.evaluated), "budget": bc.evolution.budget,
            "stopped_early": result.stopped_early,
            "best_per_generation": result.best_per_generation, "export_acc": export_acc,
            "export_macs": export_macs, "best_cost": result.best.cost, "target_cost": space.target,
            "supernet_macs": searcher.supernet_cost, "max_cost": max(c.cost for c in result.evaluated),
            "structure": searcher.structure(), "n_dims": len(space.gates),
            "low": list(space.low), "high": list(space.high)}


def reach(curve: list[dict[str, Any]], acc: float) -> dict[str, Any] | None:
    """The first improvement whose test top-1 is at least ``acc`` (None: never)."""
    return next((p for p in curve if p["test_acc"] >= acc - 1e-12), None)


def _done(cache: dict[str, Any], key: str) -> list[int]:
    runs = cache.get("runs", {}).get(key, {})
    return sorted(int(s) for s, r in runs.items() if "dms" in r and "evolution" in r)


def _summary(cache: dict[str, Any], key: str) -> dict[str, Any]:
    """Per-seed reach times and the ratios (JSON-able; also written into the cache)."""
    runs, have = cache["runs"][key], _done(cache, key)
    dms_mean = statistics.mean(runs[str(s)]["dms"]["acc"] for s in have)
    rows = []
    for s in have:
        d, e = runs[str(s)]["dms"], runs[str(s)]["evolution"]
        row = {"seed": s, "dms_cpu_s": d["cpu_s"], "dms_acc": d["acc"], "evo_cpu_s": e["cpu_s"],
               "evo_final_acc": e["curve"][-1]["test_acc"], "evo_final_val": e["curve"][-1]["val_acc"]}
        for name, acc in (("mean", dms_mean), ("seed", d["acc"])):
            hit = reach(e["curve"], acc)
            row[f"reach_{name}_cpu_s"] = None if hit is None else hit["cpu_s"]
            row[f"reach_{name}_evals"] = None if hit is None else hit["evaluations"]
            row[f"ratio_{name}"] = None if hit is None else hit["cpu_s"] / d["cpu_s"]
        rows.append(row)
    return {"dms_mean_acc": dms_mean, "rows": rows}


def _dims(cache: dict[str, Any], key: str) -> str:
    """The evolution's number of dimensions as its runs recorded it ("?" before any run)."""
    dims = {r["evolution"]["n_dims"] for r in cache["runs"].get(key, {}).values() if "evolution" in r}
    return "/".join(str(d) for d in sorted(dims)) or "?"


def _cell(value: float | None, fmt: str, never: str) -> str:
    return never if value is None else fmt.format(value)


def write_table(cache: dict[str, Any], key: str) -> Path:
    """``evolution.md`` from the cache (then ``evolution_reading.md`` when it exists)."""
    setting, info = cache["settings"][key], cache["info"][key]
    have = _done(cache, key)
    e = setting["evolution"]
    lines = ["# Search cost: DMS_p- vs evolutionary search on the same supernet (issue 10, table 3)", "",
             "The analog of the paper's Table 3 (search cost of DMS vs evolutionary / NAS methods) on this "
             "machine's scale.", "",
             f"- command: {invocations_text(info)}" + (" (each adds its seeds to the cache)" if "earlier" in info else ""),
             f"- machine: {cache['machine']}",
             "- supernet: " + ("bench/gates.py's (ResNet-20" if setting.get("depth", 20) == 20 else
                                 f"a ResNet-{setting['depth']} (bench/gates.py's protocol at depth {setting['depth']}")
             + f" width 8, 8x8 digits, `dmscale pretrain` "
             f"{setting['pretrain_epochs']} epochs, one per seed); target {setting['target']} x MACs for both",
             f"- DMS_p-: `--pipeline p- --init <pretrain run>`, {setting['search_epochs']} epochs (400 steps), "
             "finish phase, budget solver, BatchNorm recalibration of the export; as bench/gates.py",
             f"- evolution (bench/lib/evolution_lib.py): population {e['population']}, {e['generations']} generations, "
             f"top {e['parents']} parents, {e['n_mutation']} mutation (p = {e['mutation_prob']}) + {e['n_crossover']} "
             f"crossover children per generation (at most {e['population'] + e['generations'] * (e['n_mutation'] + e['n_crossover'])} "
             "distinct candidates); candidates rejected unless their exact MACs (the searcher's hard cost) "
             f"are <= target; elements kept by DMS's Taylor importance after {setting['importance_steps']} "
             "importance-only batches at DMS's initial masks; fitness = top-1 of the hardened supernet on a "
             f"held-out {setting['val_fraction']:.0%} of the training images after BatchNorm recalibration on "
             f"the rest ({setting['fitness_bn_batches']} batches of {setting['batch_size']} per candidate, about one pass "
             "over them; the pipeline's 20 would cost about 1.5 CPU s per candidate)"
             + (f"; the search stops at {e['max_seconds']:.0f} CPU s if its candidate budget is not used up by then"
                if e.get("max_seconds") else "; no CPU-second cap"),
             "- accuracy: test top-1 **without retraining**, BatchNorm recalibrated as the pipeline's export "
             "(training set, 20 batches); for the evolution, of its best-by-validation candidate at each moment",
             "- cost: **process CPU seconds**, 1 torch thread (time.process_time; the machine is shared, wall "
             "time is not comparable). Both clocks include building the task, supernet and searcher; DMS's "
             "includes its export and one test evaluation, the evolution's test evaluations are off its clock",
             f"- search space: {_dims(cache, key)} structural dimensions (one count per gate: width groups, "
             "then blocks per stage)",
             f"- seeds done: {have}", ""]
    if not have:
        return write_md(RESULTS / f"{NAME}.md", lines, end="")
    summ = _summary(cache, key)
    cache["summary"] = {key: summ}
    runs, rows = cache["runs"][key], summ["rows"]
    dm = summ["dms_mean_acc"]
    lines += [f"DMS_p- mean test top-1 over seeds: **{100 * dm:.2f} %** (the accuracy the evolution must reach).", "",
              "| seed | DMS_p- CPU s | DMS_p- top-1 (%) | evolution CPU s (all) | evolution final top-1 (%) | "
              "evo CPU s to reach DMS mean | evaluations | ratio evo / DMS | evo CPU s to reach this seed's DMS | ratio |",
              "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        never = f"never (> {r['evo_cpu_s']:.0f})"
        bound = f"> {r['evo_cpu_s'] / r['dms_cpu_s']:.1f}x"  # never within the whole budget
        lines.append(
            f"| {r['seed']} | {r['dms_cpu_s']:.1f} | {100 * r['dms_acc']:.2f} | {r['evo_cpu_s']:.0f} | "
            f"{100 * r['evo_final_acc']:.2f} | {_cell(r['reach_mean_cpu_s'], '{:.1f}', never)} | "
            f"{_cell(r['reach_mean_evals'], '{:d}', '-')} | {_cell(r['ratio_mean'], '{:.2f}x', bound)} | "
            f"{_cell(r['reach_seed_cpu_s'], '{:.1f}', never)} | {_cell(r['ratio_seed'], '{:.2f}x', bound)} |")
    ratios = [r["ratio_mean"] for r in rows if r["ratio_mean"] is not None]
    lines += ["", f"- DMS_p- CPU seconds: {mean_std([r['dms_cpu_s'] for r in rows], '{:.1f}')}; test top-1 "
              f"{mean_std([100 * r['dms_acc'] for r in rows])} %",
              f"- evolution, whole budget: {mean_std([r['evo_cpu_s'] for r in rows], '{:.0f}')} CPU s, final test top-1 "
              f"{mean_std([100 * r['evo_final_acc'] for r in rows])} % (validation {mean_std([100 * r['evo_final_val'] for r in rows])} %)",
              f"- evolution reached DMS_p-'s mean top-1 on {len(ratios)} of {len(rows)} seeds"
              + (f"; CPU time ratio evolution / DMS_p- {mean_std(ratios)} (per seed: "
                 + ", ".join(f"{x:.2f}x" for x in ratios) + ")" if ratios else ""), ""]
    lines += ["Per seed: importance pass, evaluations, cost check, the best candidate's export:", ""]
    for s in have:
        ev = runs[str(s)]["evolution"]
        lines.append(f"- seed {s}: importance pass {ev['importance_cpu_s']:.1f} CPU s ({ev['importance_batches']} batches, "
                     f"includes building task/supernet/searcher); {ev['evaluations']} candidates of a budget of "
                     f"{ev['budget']}; largest evaluated MACs / target {ev['max_cost'] / ev['target_cost']:.3f}; "
                     f"best: MACs / target {ev['best_cost'] / ev['target_cost']:.3f}, its export counts "
                     f"{ev['export_macs']:,} MACs and scores {100 * ev['export_acc']:.2f} % (hardened supernet: "
                     f"{100 * ev['curve'][-1]['test_acc']:.2f} %)")
    lines += ["", "Structures (kept channels per width group | blocks per stage):", ""]
    for s in have:
        lines.append(f"- DMS_p-, seed {s}: {widths(runs[str(s)]['dms']['structure'])}")
        lines.append(f"- evolution, seed {s}: {widths(runs[str(s)]['evolution']['structure'])}")
    reading = hand_reading(RESULTS / f"{NAME}_reading.md")
    if reading is not None:
        lines += ["", reading]
    return write_md(RESULTS / f"{NAME}.md", lines)


def plot(cache: dict[str, Any], key: str) -> Path | None:
    """``evolution.png``: test top-1 vs CPU seconds, the evolution's best-so-far as steps, DMS_p- as points."""
    have = _done(cache, key)
    if not have:
        return None
    plt = pyplot()
    runs = cache["runs"][key]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, s in enumerate(have):
        ev, d = runs[str(s)]["evolution"], runs[str(s)]["dms"]
        xs = [p["cpu_s"] for p in ev["curve"]] + [ev["cpu_s"]]
        ys = [100 * p["test_acc"] for p in ev["curve"]]
        ax.step(xs, ys + ys[-1:], where="post", color=f"C{i}", label=f"evolution, seed {s} (test)")
        ax.step(xs, [100 * p["val_acc"] for p in ev["curve"]] + [100 * ev["curve"][-1]["val_acc"]], where="post",
                color=f"C{i}", ls=":", lw=0.8)
        ax.plot([d["cpu_s"]], [100 * d["acc"]], marker="*", ms=13, color=f"C{i}", mec="k",
                label=f"DMS_p-, seed {s}")
    dm = statistics.mean(runs[str(s)]["dms"]["acc"] for s in have)
    ax.axhline(100 * dm, color="k", lw=0.8, ls="--", label=f"DMS_p- mean {100 * dm:.1f} %")
    ax.set_xscale("log")
    ax.set_xlabel("search cost (process CPU seconds, 1 thread)")
    ax.set_ylabel("top-1 of the best candidate, no retrain (%)")
    setting = cache["settings"][key]
    net = f"ResNet-{setting['depth']}, " if setting.get("depth", 20) != 20 else ""
    ax.set_title(f"Table 3 analog: {net}{setting['target']} x MACs (dotted: evolution's validation fitness)",
                 fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    return save_figure(fig, RESULTS / f"{NAME}.png")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_quick_flags(p, "evolution", "smoke run: one seed, short pretrain, search and evolution", "cache, table and plot",
                    runs=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--table-only", action="store_true", help="only rewrite evolution.md / .png from the cache")
    p.add_argument("--generations", type=int, default=10, help="generations of the evolution (SPOS: 20)")
    p.add_argument("--name", default="evolution", help="stem of the results files (json, md, png)")
    p.add_argument("--depth", type=int, default=20,
                   help="ResNet depth of the supernet (20: the cached tables; 56: a larger search space, 33 dimensions)")
    p.add_argument("--settle-hold", action="store_true", help="DMS_p-'s --settle-hold (the library default since)")
    p.add_argument("--max-seconds", type=float, default=420.0,
                   help="the evolution's CPU-second guard (it stops there if its candidate budget is not used up)")
    p.add_argument("--settle", type=float, default=0.0,
                   help="DMS_p-'s --settle (0: the evolution.json protocol; 0.4, the library default "
                        "since: use with --name evolution_settle)")
    args = p.parse_args(argv)
    global RESULTS, CACHE, NAME
    NAME = args.name
    bc = BenchConfig(evolution=dataclasses.replace(BenchConfig().evolution, generations=args.generations,
                                                   max_seconds=args.max_seconds),
                     settle=args.settle, settle_hold=args.settle_hold, depth=args.depth)
    if args.quick:  # a smoke run: short pretrain, search and evolution
        bc = BenchConfig(pretrain_epochs=2.0, search_epochs=2.0, importance_steps=4, depth=args.depth,
                         evolution=el.EvolutionConfig(population=8, generations=2, parents=3, n_mutation=4, n_crossover=4))
    RESULTS = quick_mode(args, RESULTS, seeds=[0])
    CACHE = RESULTS / f"{NAME}.json"
    torch.set_num_threads(1)
    key = bc.key()
    RESULTS.mkdir(parents=True, exist_ok=True)
    if not args.table_only:  # every cache write is a read-modify-write under the lock: invocations
        with locked(CACHE):  # adding other seeds to the same cache may run at the same time
            cache = load_cache(CACHE)
            cache.setdefault("settings", {})[key] = bc.as_dict()
            record_invocation(cache.setdefault("info", {}), key, command_line("-m bench.evolution", argv),
                              git_commit(ROOT), args.seeds)
            save_cache(CACHE, cache)
        for seed in args.seeds:
            pre_dir = _pretrain(bc, seed, args.workdir)
            for method, fn in (("dms", lambda: run_dms(bc, seed, pre_dir, args.workdir)),
                               ("evolution", lambda: run_evolution(bc, seed, pre_dir))):
                if method not in load_cache(CACHE).get("runs", {}).get(key, {}).get(str(seed), {}):
                    result = fn()
                    with locked(CACHE):
                        cache = load_cache(CACHE)
                        cache.setdefault("runs", {}).setdefault(key, {}).setdefault(str(seed), {})[method] = result
                        save_cache(CACHE, cache)
            done = load_cache(CACHE)["runs"][key][str(seed)]
            d, e = done["dms"], done["evolution"]
            print(f"seed {seed}: DMS_p- {100 * d['acc']:.2f} % in {d['cpu_s']:.1f} CPU s | evolution final "
                  f"{100 * e['curve'][-1]['test_acc']:.2f} % in {e['cpu_s']:.1f} CPU s ({e['evaluations']} candidates)",
                  flush=True)
    with locked(CACHE):
        cache = load_cache(CACHE)
        cache["machine"] = shared_machine("1 thread")
        table = write_table(cache, key)
        save_cache(CACHE, cache)
    print(f"wrote {table} and {plot(cache, key)}")


if __name__ == "__main__":
    main()
