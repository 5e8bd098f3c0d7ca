"""DMS_np vs uniform width scaling at equal MACs, each retrained from scratch the same way
(issue 10, table 3), with the measurements that say why DMS_np does or does not win.

    PYTHONPATH=src python bench/np_uniform.py [--quick] [--seeds 0 1 2] [--targets 0.5 0.25]
        [--arms uniform dms dms_expand] [--search-epochs 10] [--retrain-epochs 20] [--table-only]

ResNet-20 (width 8) on the bundled 8x8 digits. Per target t (fraction of the baseline's MACs)
and seed, three structures at t x the baseline's exact MACs:

* ``uniform``: one width multiplier for every dimension (``peers_lib.uniform_structure``);
* ``dms``: DMS_np searched from the baseline itself (``--pipeline np``, target t);
* ``dms_expand``: DMS_np searched from the baseline enlarged by ``--expand`` (default
  width=1.5,depth=2, the paper's protocol) down to t x the *baseline's* MACs (absolute target);
* ``dms_width``: a diagnostic, ``dms`` with ``--search-dims width`` (depth kept whole).

Every structure is then trained from scratch by the same ``dmscale retrain --retrain-init
scratch`` phase (same SGD, lr, cosine schedule, epochs, batches and initialisation seed).
Recorded per DMS search (``np_uniform_lib.TracedPipeline``): the hard cost / target when
the search ends (the loss alone), the finish phase's steps, whether the budget solver ran,
how far each post-hoc step moved the kept fractions, importance stability (Spearman
correlation and kept-set agreement of snapshots at every tenth of the search with the
search's end), and for all arms the retrained model's exact MACs / target and top-1.
Cached per run in ``bench/results/np_uniform.json``; the table goes to
``bench/results/np_uniform.md``. Run directories under ``--workdir`` (default
``bench/runs/np_uniform/``, ignored). ``--quick`` is a smoke run (one seed, target 0.5, half an
epoch of search and of retraining) whose cache, table and plot go to ``WORKDIR/quick/``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "bench" / "lib"))  # the shared helpers
sys.path.insert(0, str(ROOT / "src"))
import np_uniform_lib as nl  # noqa: E402
import peers_lib as pl  # noqa: E402
from benchlib import RUNS, add_quick_flags, command_line, git_commit, load_cache, locked, quick_mode, save_cache  # noqa: E402
from dmscale.config.run_config import RunConfig, save_config  # noqa: E402
from dmscale.run.pipeline import Pipeline  # noqa: E402
from dmscale.run.saved_runs import new_supernet  # noqa: E402
from dmscale.tasks.registry import build_task  # noqa: E402

__all__ = ["ARMS", "run_key", "run_arm", "uniform_source", "baseline", "use_width", "dataset_note", "main"]

RESULTS = ROOT / "bench" / "results"
CACHE = RESULTS / "np_uniform.json"
WORK = RUNS / "np_uniform"
ARMS = ("uniform", "dms", "dms_expand", "dms_width")
MODEL = {"task": "digits", "model": "resnet", "model_args": {"width": 8}}
EXPAND = {"width": 1.5, "depth": 2.0}
# the budget solver's refill (rows without this field ran the earlier one: cheapest unit first)
SOLVER = "widths offset + offset-order refill"


def _use_task(task: str, train_limit: int | None) -> None:
    """Point the model, cache and run directories at ``task`` (the digits keep the defaults)."""
    global MODEL, CACHE, WORK
    MODEL = {**MODEL, "task": task, "train_limit": train_limit}
    CACHE = RESULTS / f"np_uniform_{task}.json"
    WORK = WORK / task


def use_width(width: int) -> None:
    """ResNet-20 of another base width (its own cache, run directories and table)."""
    global MODEL, CACHE, WORK
    MODEL = {**MODEL, "model_args": {"width": width}}
    CACHE = CACHE.with_name(CACHE.stem + f"_w{width}.json")
    WORK = WORK / f"w{width}"


def dataset_note(task: str, train_limit: int | None) -> str:
    """How the table's data is described (the test split's size sets what one image is worth)."""
    if task == "digits":
        return "the 8x8 digits (359 test images: 1 image = 0.28 pt)"
    train = f"the first {train_limit:,} training images" if train_limit else "all 60,000 training images"
    return f"MNIST at 28x28 ({train}; all 10,000 test images: 1 image = 0.01 pt)"


def run_key(arm: str, target: float, seed: int, search_epochs: float, retrain_epochs: float) -> str:
    """Cache key of one arm's run (uniform has no search: its key still names the protocol)."""
    return f"{arm}/t{target}/s{seed}/S{search_epochs}/R{retrain_epochs}"


def baseline() -> tuple[int, Any]:
    """Exact MACs of the baseline model (per example) and the task's example input."""
    cfg = RunConfig(**MODEL).resolved()
    task = build_task(cfg)
    with torch.random.fork_rng(devices=[]):
        model, _ = new_supernet(cfg, task.info, 0)
    example = task.example_inputs()
    return pl.macs(model.eval(), example), (model, example)


def _fresh(out: Path) -> Path:
    if out.exists():
        shutil.rmtree(out)
    return out


def _retrain(src: Path, out: Path, seed: int, epochs: float, threads: int, expand: dict | None) -> dict[str, Any]:
    cfg = RunConfig(command="retrain", source=str(src), **MODEL, expand=expand, epochs=epochs,
                    retrain_init="scratch", seed=seed, threads=threads, quiet=True, out=str(_fresh(out)))
    return Pipeline(cfg.resolved()).run()


def _brief(structure: dict[str, Any]) -> str:
    """Kept widths per group and blocks per stage, in model order."""
    w = "/".join(str(g["kept"]) for g in structure.get("width", []))
    d = "/".join(str(len(g["kept"])) for g in structure.get("depth", []))
    return f"{w} | blocks {d}" if d else w


def _search(arm: str, target: float, seed: int, epochs: float, threads: int, base_macs: int,
            out: Path, settle: float = 0.0, settle_hold: bool = False,
            search_overrides: dict[str, Any] | None = None,
            config_overrides: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """One traced DMS_np search (no retrain); returns its summary and the measurements.
    ``search_overrides``: :class:`dmscale.SearchConfig` fields set on the search (e.g. another
    importance metric or gate factory: bench/importance.py); ``config_overrides``: RunConfig
    fields that replace this function's (e.g. ``target`` with several budgets, ``min_width``:
    bench/scaling_claim.py), saved in the search's config."""
    expand = EXPAND if arm == "dms_expand" else None
    absolute = float(target * base_macs) if expand else target  # > 1: an absolute count
    dims = "width" if arm == "dms_width" else "both"
    fields: dict[str, Any] = {**MODEL, "expand": expand, "target": absolute, "search_dims": dims,
                              "settle": settle, "settle_hold": settle_hold, **(config_overrides or {})}
    cfg = RunConfig(command="search", pipeline="np", **fields,
                    epochs=epochs, retrain_epochs=0, seed=seed, threads=threads, quiet=True,
                    out=str(_fresh(out)))
    pipe = nl.TracedPipeline(cfg.resolved(), search_overrides=search_overrides)
    summary = pipe.run()
    tr = pipe.trace
    end, fin, final = tr["search_end"], tr["after_finish"], tr["final"]
    curve = nl.stability(tr["during"] + [end], end, counts=final["counts"])
    info = {"search_end": end["hard_over_target"], "finish_steps": tr["finish_steps"],
            "solver_ran": tr["solver_ran"], "after_finish": fin["hard_over_target"],
            "shift_finish": nl.structure_shift(end, fin), "shift_solver": nl.structure_shift(fin, final),
            "shift_posthoc": nl.structure_shift(end, final),
            "kept_search_end": end["kept"], "kept_after_finish": fin["kept"], "kept_final": final["kept"],
            "ratios_search_end": end["ratios"], "ratios_final": final["ratios"], "n_width": end["n_width"],
            "during": [{"progress": round(s["progress"], 3), "kept": s["kept"], "ratios": s["ratios"]}
                       for s in tr["during"]],
            "stability": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}
                          for row in curve],
            "acc_search": summary["evals"]["search"]["acc"], "search_steps": summary["steps"],
            "supernet_macs": summary["counts"]["supernet"]["macs"]}
    return summary, info


def uniform_source(work: Path, target: float, seed: int, base: tuple[int, Any]) -> tuple[Path, dict[str, Any], float]:
    """The run directory ``dmscale retrain --source`` reads for one width multiplier at
    ``target`` x the baseline's MACs (1.0: the baseline itself), under ``work/src``; returns
    it, the structure and the multiplier."""
    _, (model, example) = base
    structure, mult = pl.uniform_structure(model, example, target)
    cfg_src = _fresh(work / "cfg")  # the config a search run of the baseline would hold
    cfg_src.mkdir(parents=True)
    save_config(RunConfig(command="search", pipeline="np", **MODEL, seed=seed).resolved(), cfg_src / "config.yaml")
    return pl.write_source_run(_fresh(work / "src"), cfg_src, structure, pl.apply(model, structure)), structure, mult


def run_arm(arm: str, target: float, seed: int, search_epochs: float, retrain_epochs: float,
            threads: int, base: tuple[int, Any], settle: float = 0.0, settle_hold: bool = False,
            search_overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """One arm: its structure at ``target`` x the baseline's MACs, retrained from scratch
    (``search_overrides``: SearchConfig fields of a DMS arm's search)."""
    base_macs = base[0]
    work = WORK / run_key(arm, target, seed, search_epochs, retrain_epochs).replace("/", "-")  # reused by variants
    t0 = time.perf_counter()
    row: dict[str, Any] = {"arm": arm, "target": target, "seed": seed, "search_epochs": search_epochs,
                           "retrain_epochs": retrain_epochs}
    if arm == "uniform":
        src, structure, mult = uniform_source(work, target, seed, base)
        row["multiplier"] = mult
    else:
        src = work / "search"
        summary, info = _search(arm, target, seed, search_epochs, threads, base_macs, src, settle, settle_hold,
                                search_overrides)
        row["settle"], row["settle_hold"] = settle, settle_hold
        structure = json.loads((src / "structure.json").read_text())
        row.update(info)
    search_s = time.perf_counter() - t0
    ft = _retrain(src, work / "retrain", seed, retrain_epochs, threads, EXPAND if arm == "dms_expand" else None)
    macs = ft["counts"]["found"]["macs"]
    row.update({"structure": _brief(structure), "macs": macs, "params": ft["counts"]["found"]["params"],
                "exported": macs / (target * base_macs), "base_macs": base_macs,
                "acc": ft["evals"]["final"]["acc"], "search_seconds": round(search_s, 1),
                "retrain_seconds": round(time.perf_counter() - t0 - search_s, 1), "commit": git_commit(ROOT),
                "solver": SOLVER})
    return row


def _store(key: str, row: dict[str, Any], machine: str) -> None:
    """Read-modify-write of the cache (several invocations may share it: under a lock)."""
    with locked(CACHE):
        cache = load_cache(CACHE, {"runs": {}})
        cache["runs"][key] = row
        cache["machine"] = machine
        save_cache(CACHE, cache)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_quick_flags(p, "np_uniform", "smoke run: one seed, target 0.5, tiny epochs", "cache, table and plot",
                    runs=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--targets", type=float, nargs="+", default=[0.5, 0.25])
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    p.add_argument("--search-epochs", type=float, nargs="+", default=[10.0],
                   help="one or more search lengths (a sweep); uniform runs once")
    p.add_argument("--retrain-epochs", type=float, default=20.0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--variant", default="",
                   help="a name for runs of changed code under the same protocol (kept apart in the cache "
                        "and shown as ARM@VARIANT)")
    p.add_argument("--settle", type=float, default=0.0,
                   help="--settle of the DMS searches (0: Eq. 10 to the last step, the protocol of the "
                        "arms without a variant; the @settle rows ran with 0.4); pair it with --variant")
    p.add_argument("--settle-hold", action="store_true",
                   help="hold the structure while the exact cost is inside the band (SearchConfig.settle_hold, "
                        "the library default since it was added; the @settle rows ran without it, the @hold "
                        "rows with it); pair it with --settle 0.4 and --variant")
    p.add_argument("--table-only", action="store_true")
    p.add_argument("--task", choices=("digits", "mnist"), default="digits",
                   help="digits (the default; np_uniform.json / .md) or mnist (np_uniform_mnist.json / .md)")
    p.add_argument("--width", type=int, default=8,
                   help="base width of the ResNet-20 (8: np_uniform[.json/.md]; others: np_uniform_wW)")
    p.add_argument("--train-limit", type=int, default=None,
                   help="train on the first N training images (--train-limit of every search and retrain)")
    args = p.parse_args(argv)
    global RESULTS, CACHE, WORK
    WORK = args.workdir
    RESULTS = quick_mode(args, RESULTS, seeds=[0], targets=[0.5], search_epochs=[0.5], retrain_epochs=0.5)
    CACHE = RESULTS / CACHE.name
    if args.task != "digits":
        _use_task(args.task, args.train_limit)
    elif args.train_limit is not None:
        p.error("--train-limit is for --task mnist (the digits cache holds full-split runs)")
    if args.width != 8:
        use_width(args.width)
    torch.set_num_threads(args.threads)
    RESULTS.mkdir(parents=True, exist_ok=True)
    machine = (f"{os.cpu_count()} CPUs ({platform.machine()}), torch {torch.__version__}, "
               f"{args.threads} thread(s)")
    if not args.table_only:
        base = baseline()
        for seed in args.seeds:
            for target in args.targets:
                for arm in args.arms:
                    for s_ep in (args.search_epochs[:1] if arm == "uniform" else args.search_epochs):
                        s_key = 0.0 if arm == "uniform" else s_ep
                        name = f"{arm}@{args.variant}" if args.variant else arm
                        key = run_key(name, target, seed, s_key, args.retrain_epochs)
                        if key in load_cache(CACHE, {"runs": {}})["runs"]:
                            continue
                        row = run_arm(arm, target, seed, s_key, args.retrain_epochs, args.threads, base,
                                      args.settle, args.settle_hold)
                        row["arm"] = name
                        _store(key, row, machine)
                        extra = (f", search end {row['search_end']:.2f} x, finish {row['finish_steps']} steps, "
                                 f"solver {row['solver_ran']}") if arm != "uniform" else ""
                        print(f"{key}: top-1 {100 * row['acc']:.2f} %, exported {row['exported']:.3f} x target"
                              f"{extra} ({row['search_seconds']} + {row['retrain_seconds']} s)", flush=True)
    import np_uniform_table
    from np_uniform_table import write_table

    np_uniform_table.RESULTS = RESULTS  # the table and plot go beside the cache
    command = command_line("bench/np_uniform.py", argv)
    with locked(CACHE):
        cache = load_cache(CACHE, {"runs": {}})
        if not args.table_only:  # the last invocation that ran something (--table-only keeps it)
            cache["last_command"] = command
            save_cache(CACHE, cache)
    command = cache.get("last_command", command)
    name = CACHE.stem
    print(f"wrote {write_table(cache, command, args.search_epochs[0], args.retrain_epochs, name=name, dataset=dataset_note(args.task, args.train_limit), width=args.width)}")


if __name__ == "__main__":
    main()
