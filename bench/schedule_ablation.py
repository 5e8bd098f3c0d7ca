"""Schedule ablation: r_t decayed over the whole search (Eq. 10) vs its first 60 % then held,
with and without a width-only phase (issue 10, table 7).

    python -m bench.schedule_ablation [--quick] [--seeds 0 1 2] [--epochs 3] [--threads 1]
    python -m bench.schedule_ablation --table-only   # rewrite table and plot from the cache

The protocol of ``bench/budget.py`` (DMS_np on the bundled 8x8 digits, the built-in ResNet-20
of width 8, a 0.5 x MACs budget, the CLI's pipeline with its defaults), now with the retrain
phase (as many epochs as the search), for each arm x seed:

* ``schedule_end`` 1.0 (Eq. 10 as written: r_t reaches the target at the last step) or 0.6
  (r_t decays over the first 60 % of the search, then holds at the target);
* ``width_only_from`` None or 0.8 (depth frozen at its hard value for the last 20 % of the
  search, widths only: the extra width-only phase of A.1.2, inside the same search budget).

Every arm runs the same steps, seeds and hyper-parameters; only these two options differ.
Recorded: exact MACs / target of the hard masks when the search ends (what the loss alone
reached) and of the export (after the finish phase and budget solver), accuracy before and
after retraining. Cached per run in ``bench/results/schedule.json``; the table goes to
``bench/results/schedule.md`` and the plot to ``bench/results/schedule.png``. ``--quick`` is a
smoke run (one seed, a quarter epoch) whose cache, table and plot go to ``WORKDIR/quick/``
instead (``--workdir``, default ``bench/runs/schedule_ablation/``, not committed).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
from bench.lib.benchlib import (add_quick_flags, command_line, git_commit, load_cache, quick_mode, save_cache, spread,  # noqa: E402
                      write_md)
from dmscale.config.run_config import RunConfig  # noqa: E402
from dmscale.run.pipeline import Pipeline  # noqa: E402

__all__ = ["Arm", "ARMS", "run_one", "write_table", "plot", "main"]

RESULTS = ROOT / "bench" / "results"
CACHE = RESULTS / "schedule.json"
TARGET = 0.5


@dataclass(frozen=True)
class Arm:
    """One schedule setting: the decay's share of the search and the width-only phase's start."""

    schedule_end: float
    width_only_from: float | None

    @property
    def name(self) -> str:
        wo = "none" if self.width_only_from is None else f"{self.width_only_from}"
        return f"end={self.schedule_end}/width_only_from={wo}"


ARMS = (Arm(1.0, None), Arm(0.6, None), Arm(1.0, 0.8), Arm(0.6, 0.8))


def run_one(arm: Arm, seed: int, epochs: float, threads: int) -> dict[str, Any]:
    """One full DMS_np run (search, finish, retrain); costs as fractions of the target."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = RunConfig(command="search", task="digits", pipeline="np", target=TARGET,
                        schedule_end=arm.schedule_end, width_only_from=arm.width_only_from, settle=0.0,
                        epochs=epochs, seed=seed, threads=threads, quiet=True, out=tmp, name="run")
        t0 = time.perf_counter()
        summary = Pipeline(cfg.resolved()).run()
        seconds = time.perf_counter() - t0
    end, final = summary["resources_search_end"], summary["resources"]
    return {"arm": arm.name, "seed": seed, "epochs": epochs,
            "search_end": end["hard"] / end["target"], "exported": final["hard"] / final["target"],
            "acc_search": summary["evals"]["search"]["acc"], "acc": summary["evals"]["final"]["acc"],
            "seconds": round(seconds, 1), "commit": git_commit(ROOT)}


def _key(arm: Arm, seed: int, epochs: float) -> str:
    return f"{arm.name}/{seed}/{epochs}"


def _rows(cache: dict[str, Any], epochs: float, seeds: list[int]) -> dict[str, list[dict[str, Any]]]:
    runs = cache["runs"]
    return {a.name: [runs[_key(a, s, epochs)] for s in seeds if _key(a, s, epochs) in runs] for a in ARMS}


def _mean(rs: list[dict[str, Any]], field: str) -> float:
    return statistics.mean([r[field] for r in rs]) if rs else float("nan")


def _reading(by_arm: dict[str, list[dict[str, Any]]]) -> str:
    """The numbers' plain reading, computed from them; the hand-written caveats follow it."""
    base, held = by_arm[ARMS[0].name], by_arm[ARMS[1].name]
    if not (base and held):
        return "Not enough runs for a reading."
    gap = 100 * (_mean(held, "acc") - _mean(base, "acc"))
    pooled = [100 * r["acc"] for rs in (base, held) for r in rs]
    sd = statistics.stdev(pooled) if len(pooled) > 1 else float("nan")
    return (f"Holding r_t for the last 40 % moved the search's end from {_mean(base, 'search_end'):.2f} to "
            f"{_mean(held, 'search_end'):.2f} x target (loss alone); after the finish phase and solver both "
            f"export at {_mean(base, 'exported'):.3f} / {_mean(held, 'exported'):.3f} x target. Accuracy after "
            f"retraining differs by {gap:+.1f} points (held minus Eq. 10) against a spread of {sd:.1f} points "
            "across seeds and these two arms.")


def _commits(cache: dict[str, Any], by_arm: dict[str, list[dict[str, Any]]]) -> str:
    """The commits the table's runs ran on: each run's own, or for runs from before runs
    recorded it, the cache's ``run_commits`` note (else the last invocation's commit)."""
    commits = {r["commit"] for rs in by_arm.values() for r in rs if "commit" in r}
    said = ", ".join(f"`{c}`" for c in sorted(commits))
    if any("commit" not in r for rs in by_arm.values() for r in rs):
        said = ", ".join(x for x in (cache.get("run_commits", f"`{cache['commit']}`"), said) if x)
    return said


def write_table(cache: dict[str, Any], epochs: float, seeds: list[int], command: str) -> Path:
    by_arm = _rows(cache, epochs, seeds)
    lines = ["# Schedule ablation: r_t over the whole search vs its first 60 % then held (issue 10, table 7)", "",
             f"- command: `{command}`",
             f"- commit(s) of the runs: {_commits(cache, by_arm)}; machine: {cache['machine']}",
             f"- setup: DMS_np of ResNet-20 (width 8) on the 8x8 digits, {TARGET} x MACs, {epochs} epoch(s) of "
             f"search then {epochs} of retraining (the CLI's defaults otherwise), seeds {seeds}; the pipeline's "
             "finish phase and budget solver run after the search in every arm", "",
             "Mean ± std [min, max] over seeds. Costs are exact MACs of the hard masks / target.", "",
             "| schedule_end | width_only_from | runs | MACs / target at search end | exported MACs / target "
             "| top-1 before retrain (%) | top-1 after retrain (%) | seconds per run |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for arm in ARMS:
        rs = by_arm[arm.name]
        if not rs:
            continue
        lines.append(f"| {arm.schedule_end} | {arm.width_only_from or '-'} | {len(rs)} | "
                     f"{spread([r['search_end'] for r in rs])} | {spread([r['exported'] for r in rs])} | "
                     f"{spread([100 * r['acc_search'] for r in rs], 1)} | {spread([100 * r['acc'] for r in rs], 1)} | "
                     f"{statistics.median([r['seconds'] for r in rs]):.0f} |")
    lines += ["", "## Reading", "", _reading(by_arm)]
    return write_md(RESULTS / "schedule.md", lines)


def plot(cache: dict[str, Any]) -> Path:
    """The table's plot, drawn by bench/results_plots.py like every cached table's."""
    from bench.lib.plots import plot_schedule

    return plot_schedule(cache, RESULTS / "schedule.png")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_quick_flags(p, "schedule_ablation", "one seed, a quarter epoch (smoke test)", "cache, table and plot")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--epochs", type=float, default=3.0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--table-only", action="store_true",
                   help="run nothing: rewrite the table and plot from the cache (with the command of the "
                        "last invocation that ran something)")
    p.add_argument("--arms", type=int, nargs="+", default=list(range(len(ARMS))),
                   help="indices into ARMS to run (the table shows every cached arm)")
    args = p.parse_args(argv)
    global RESULTS, CACHE
    RESULTS = quick_mode(args, RESULTS, seeds=[0], epochs=0.25)
    CACHE = RESULTS / CACHE.name
    torch.set_num_threads(args.threads)
    RESULTS.mkdir(parents=True, exist_ok=True)
    cache = load_cache(CACHE, {"runs": {}})
    command = command_line("-m bench.schedule_ablation", argv)
    if args.table_only:
        if not cache["runs"]:
            sys.exit(f"--table-only: no cached run in {CACHE}")
        command = cache.get("last_command", command).strip()
    else:
        cache["commit"] = git_commit(ROOT)
        cache["machine"] = (f"{os.cpu_count()} CPUs ({platform.machine()}), torch {torch.__version__}, "
                            f"{args.threads} thread(s)")
        cache["last_command"] = command
    # seed-major: an interrupted run leaves whole seeds for every arm
    for seed in ([] if args.table_only else args.seeds):
        for arm in (ARMS[i] for i in args.arms):
            key = _key(arm, seed, args.epochs)
            if key in cache["runs"]:
                continue
            r = run_one(arm, seed, args.epochs, args.threads)
            cache["runs"][key] = r
            save_cache(CACHE, cache)
            print(f"{arm.name} seed {seed}: search end {r['search_end']:.3f}, exported {r['exported']:.3f} x "
                  f"target, top-1 {100 * r['acc']:.1f} % ({r['seconds']} s)", flush=True)
    if not args.table_only:
        save_cache(CACHE, cache)
    print(f"wrote {write_table(cache, args.epochs, args.seeds, command)}")
    print(f"wrote {plot(cache)}")


if __name__ == "__main__":
    main()
