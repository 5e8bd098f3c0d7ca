"""Does the resource loss alone land the search on its budget? (issue 10, table 6)

    PYTHONPATH=src python bench/budget.py [--quick] [--seeds 0 1 2] [--threads 1]

Runs the DMS_np search phase (no retraining) of the built-in ResNet-20 (width 8) on the
bundled 8x8 digits for each target x ``cost_forward`` x seed, through the same pipeline the
CLI runs, and records the exported model's exact cost as a fraction of its target twice:
when the search ends (what the resource loss alone reached) and after the finish phase and
budget solver (what the run exports). ``cost_forward=soft`` is Eq. 6 as the paper writes it
(r_c from the soft masks); ``exact`` uses the hard masks' cost in the forward pass and the
soft cost's gradient (straight-through). Results are cached per run in
``bench/results/budget.json``; the table goes to ``bench/results/budget.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from benchlib import git_commit, spread  # noqa: E402
sys.path.insert(0, str(ROOT / "src"))
from dmscale.config import RunConfig  # noqa: E402
from dmscale.pipeline import Pipeline  # noqa: E402

RESULTS = ROOT / "bench" / "results"
CACHE = RESULTS / "budget.json"
TARGETS = (0.5, 0.25)
MODES = ("soft", "exact")


def _commit() -> str:
    return git_commit(ROOT)


def run_one(target: float, mode: str, seed: int, epochs: float, threads: int) -> dict[str, Any]:
    """One search; returns hard cost / target at the search's end and after the post-hoc steps."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = RunConfig(command="search", task="digits", pipeline="np", target=target,
                        cost_forward=mode, epochs=epochs, retrain_epochs=0, seed=seed,
                        threads=threads, quiet=True, out=tmp, name="run")
        t0 = time.perf_counter()
        summary = Pipeline(cfg.resolved()).run()
        seconds = time.perf_counter() - t0
    end, final = summary["resources_search_end"], summary["resources"]
    return {"target": target, "mode": mode, "seed": seed, "epochs": epochs,
            "search_end": end["hard"] / end["target"], "exported": final["hard"] / final["target"],
            "acc": summary["evals"]["search"]["acc"], "seconds": round(seconds, 1)}


def _key(target: float, mode: str, seed: int, epochs: float) -> str:
    return f"{target}/{mode}/{seed}/{epochs}"


def _reading(rows: list[dict[str, Any]]) -> str:
    """What the numbers say, computed from them (no hand-written result)."""
    ok = sum(0.98 <= r["search_end"] <= 1.0 + 1e-9 for r in rows)
    ends = [r["search_end"] for r in rows]
    mean = {m: statistics.mean([r["search_end"] for r in rows if r["mode"] == m] or [float("nan")])
            for m in MODES}
    exported = [r["exported"] for r in rows]
    return (f"The resource loss alone landed {ok} of {len(rows)} runs in [0.98, 1.00] x target: the "
            f"searches ended at {min(ends):.2f}-{max(ends):.2f} x target (mean {mean['soft']:.2f} with the "
            f"soft cost in the loss, {mean['exact']:.2f} with the exact one). The target of Eq. 10 "
            "decays to its final value only at the last step, and the loss (weight 1, structure "
            "learning rate 0.01) trails it; in searches this short, the finish phase and the budget "
            f"solver do the rest: every export landed in [{min(exported):.3f}, {max(exported):.3f}] x "
            "target. Open: longer searches, and the schedule that holds r_t at the target for the "
            "last part of the search (issue 10, table 7), before changing the default.")


def write_table(cache: dict[str, Any], epochs: float, seeds: list[int], command: str) -> Path:
    rows = [r for r in cache["runs"].values() if r["epochs"] == epochs and r["seed"] in seeds]
    lines = ["# Budget: does the resource loss alone land on the target? (issue 10, table 6)", "",
             f"- command: `{command}`",
             f"- commit: `{cache['commit']}`; machine: {cache['machine']}",
             f"- setup: DMS_np search phase of ResNet-20 (width 8) on the 8x8 digits, {epochs} epoch(s) "
             f"of search, seeds {seeds}, MACs budget; the pipeline's own finish phase and budget "
             "solver run after the search", "",
             "Exported exact MACs as a fraction of the target (mean ± std [min, max] over seeds); "
             "goal: within [0.98, 1.00] from the loss alone.", "",
             "| target | r_c in the loss | at the search's end (loss alone) | exported (after finish + solver) "
             "| runs in [0.98, 1.00] from the loss alone | accuracy before retraining |",
             "| ---: | --- | ---: | ---: | ---: | ---: |"]
    for target in TARGETS:
        for mode in MODES:
            rs = [r for r in rows if r["target"] == target and r["mode"] == mode]
            if not rs:
                continue
            ok = sum(0.98 <= r["search_end"] <= 1.0 + 1e-9 for r in rs)
            lines.append(f"| {target} | {mode} | {spread([r['search_end'] for r in rs])} | "
                         f"{spread([r['exported'] for r in rs])} | {ok}/{len(rs)} | "
                         f"{spread([100 * r['acc'] for r in rs])} % |")
    lines += ["", "## Reading", "", _reading(rows)]
    out = RESULTS / "budget.md"
    out.write_text("\n".join(lines) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one seed, a quarter epoch")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--epochs", type=float, default=2.0)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.epochs = [0], 0.25
    torch.set_num_threads(args.threads)
    RESULTS.mkdir(parents=True, exist_ok=True)
    cache = json.loads(CACHE.read_text()) if CACHE.exists() else {"runs": {}}
    cache["commit"] = _commit()
    cache["machine"] = (f"{os.cpu_count()} CPUs ({platform.machine()}), torch {torch.__version__}, "
                        f"{args.threads} thread(s)")
    for target in TARGETS:
        for mode in MODES:
            for seed in args.seeds:
                key = _key(target, mode, seed, args.epochs)
                if key in cache["runs"]:
                    continue
                r = run_one(target, mode, seed, args.epochs, args.threads)
                cache["runs"][key] = r
                CACHE.write_text(json.dumps(cache, indent=1, sort_keys=True))
                print(f"target {target} {mode:5} seed {seed}: search end {r['search_end']:.3f}, "
                      f"exported {r['exported']:.3f} x target ({r['seconds']} s)", flush=True)
    command = "python bench/budget.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"wrote {write_table(cache, args.epochs, args.seeds, command.strip())}")


if __name__ == "__main__":
    main()
