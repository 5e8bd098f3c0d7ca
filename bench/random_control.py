"""Random-architecture control (issue 50, item 3): where does DMS's structure rank among
structures drawn at random from the same search space at the same MACs, trained the same way?

    python -m bench.random_control --setting np [--width 4] [--target 0.25]
        [--seeds 0 1 2] [--structures 20] [--table-only] [--quick]
    python -m bench.random_control --setting p [--width 8] [--target 0.25] ...

Random structures (``random_control_lib.sample``): per width dim a kept count, per stage a kept
block count, each uniform over what the search may choose, accepted when ``dms.count`` puts the
model at 0.99-1.00 x the target MACs; every gate keeps its first units (the uniform-width
baselines' rule). Sampler seed 0: the same structures on every invocation.

* ``--setting np`` (the protocol of ``bench/np_uniform.py``, arm ``dms@hold``): ResNet-20 of
  ``--width`` on the 8x8 digits. ``dms`` = DMS_np searched from the baseline (10 epochs,
  ``--settle 0.4 --settle-hold``) with search seed s, retrained from scratch (``dmscale retrain
  --retrain-init scratch``, 20 epochs) with seed s; ``dms_struct/k`` = the structure search
  seed k found, retrained with every seed (its k-th row must equal ``dms`` at seed k);
  ``uniform`` = one width multiplier; ``random/j`` = random structure j, retrained with every
  seed. Every run of one seed shares initialisation seed and batches.
* ``--setting p`` (the protocol of ``bench/peers.py``, ``--settle 0.4``): per seed one supernet
  pretrained 10 epochs; ``dms_p`` = DMS_p's search (2 epochs, weights and structure) then the
  shared 4-epoch ``dmscale retrain`` finetune; ``dms_struct/k`` = DMS_p's kept counts of seed k
  with the first channels of the pretrained supernet (random's rule), finetuned the same 4
  epochs: the structure alone, without the search's trained weights; ``uniform`` and
  ``random/j`` likewise from the pretrained supernet.

Cached per run in ``bench/results/random_control.json`` (resumable: a cached run is not run
again); the tables go to ``bench/results/random_control.md`` (its ``## Reading`` is kept). Run
directories under ``--workdir`` (default ``bench/runs/random_control/``); ``--quick``'s cache and
table under ``WORKDIR/quick/``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
from bench.lib import np_uniform_runs as nu  # noqa: E402
from bench.lib import peers_runs as peers  # noqa: E402
from bench.lib import peers_lib as pl  # noqa: E402
from bench.lib import random_control_lib as rl  # noqa: E402
from bench.lib import random_control_table as rt  # noqa: E402
from bench.lib.benchlib import (RUNS, add_quick_flags, command_line, git_commit, load_cache, locked, quick_mode,  # noqa: E402
                      record_invocation, save_cache, shared_machine, widths)
from dmscale.config.run_config import RunConfig, save_config  # noqa: E402
from dmscale.run.pipeline import load_run_model  # noqa: E402
from dmscale.run.saved_runs import new_supernet  # noqa: E402
from dmscale.tasks.registry import build_task  # noqa: E402

__all__ = ["setting_key", "draw", "run_np", "run_p", "main"]

RESULTS = ROOT / "bench" / "results"
CACHE = RESULTS / "random_control.json"
SAMPLER_SEED = 0
NP = {"search_epochs": 10.0, "retrain_epochs": 20.0, "settle": 0.4, "settle_hold": True}
P = {"pretrain_epochs": 10.0, "search_epochs": 2.0, "finetune_epochs": 4.0, "settle": 0.4}


def setting_key(kind: str, width: int, target: float, protocol: dict[str, Any]) -> str:
    """Cache key of one setting (the protocol's epochs are part of it)."""
    epochs = "-".join(f"{k.split('_')[0][0]}{v:g}" for k, v in protocol.items() if k.endswith("epochs"))
    return f"{kind}-w{width}-t{target:g}-{epochs}"


def draw(kind: str, width: int, target: float, n: int) -> tuple[dict[str, Any], Any, Any]:
    """``n`` random structures of the search space of a ``kind`` ("np" / "p") search of the
    ResNet-20 of ``width`` at ``target``; returns the sampler's record, the (random-init)
    supernet and the example input."""
    cfg = RunConfig(command="search", pipeline=kind, task="digits", model="resnet", model_args={"width": width},
                    target=target).resolved()
    task = build_task(cfg)
    with torch.random.fork_rng(devices=[]):
        model, exclude = new_supernet(cfg, task.info, 0)
    example = task.example_inputs()
    searcher = rl.space_searcher(model, example, lambda: cfg.search_config(exclude))
    t0 = time.perf_counter()
    out = rl.sample(searcher, model, example, n, target, seed=SAMPLER_SEED)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    out["searcher"] = searcher
    return out, model.eval(), example


def _sampler_record(s: dict[str, Any]) -> dict[str, Any]:
    keep = ("counts", "macs", "fractions", "draws", "accepted", "acceptance", "target_macs", "base_macs",
            "window", "seconds")
    return {k: s[k] for k in keep} | {"structures": [widths(x) for x in s["structures"]],
                                      "sampler_seed": SAMPLER_SEED}


def _source(out: Path, cfg_dir: Path, structure: dict[str, Any], weights: Any) -> Path:
    """A fresh source run (``peers_lib.write_source_run``) at ``out``."""
    if out.exists():
        shutil.rmtree(out)
    return pl.write_source_run(out, cfg_dir, structure, weights)


def _row(summary: dict[str, Any], target_macs: float, seed: int, t0: float, **extra: Any) -> dict[str, Any]:
    counts = summary["counts"]["found"]
    return {"seed": seed, "acc": summary["evals"]["final"]["acc"], "macs": counts["macs"], "params": counts["params"],
            "exported": counts["macs"] / target_macs, "seconds": round(time.perf_counter() - t0, 1),
            "commit": git_commit(ROOT), **extra}


def _train_missing(runs: dict[str, Any], structures: dict[str, dict[str, Any]], seeds: list[int],
                   train: Callable[[str, dict[str, Any], int], None]) -> None:
    """``train(name, structure, seed)`` for every structure and seed without a cached run
    ``name/s{seed}`` (a cut-off invocation resumes where it stopped)."""
    for name, structure in structures.items():
        for seed in seeds:
            if f"{name}/s{seed}" not in runs:
                train(name, structure, seed)


def run_np(width: int, target: float, seeds: list[int], n_dms: int, threads: int, work: Path,
           runs: dict[str, Any], store: Callable[[str, dict[str, Any]], None], sampler: dict[str, Any]) -> None:
    """Every missing run of the np setting (each ``store``d at once)."""
    nu.use(width=width)
    nu.WORK = work / "np" / f"w{width}"
    base = nu.baseline()
    s_ep, r_ep = NP["search_epochs"], NP["retrain_epochs"]
    target_macs = target * base[0]
    cfg_dirs: dict[int, Path] = {}

    def cfg_dir(seed: int) -> Path:  # the config a search run of the baseline would hold
        if seed not in cfg_dirs:
            d = nu._fresh(nu.WORK / f"cfg-s{seed}")
            d.mkdir(parents=True)
            save_config(RunConfig(command="search", pipeline="np", **nu.MODEL, seed=seed).resolved(), d / "config.yaml")
            cfg_dirs[seed] = d
        return cfg_dirs[seed]

    def retrain(name: str, structure: dict[str, Any], seed: int, **extra: Any) -> None:
        t0 = time.perf_counter()
        d = nu.WORK / f"t{target:g}" / name.replace("/", "-") / f"s{seed}"
        src = _source(d / "src", cfg_dir(seed), structure, pl.apply(base[1][0], structure))
        ft = nu._retrain(src, d / "retrain", seed, r_ep, threads, None)
        store(f"{name}/s{seed}", _row(ft, target_macs, seed, t0, structure=widths(structure), **extra))

    def _dms_structure(seed: int) -> dict[str, Any]:
        """The structure DMS_np's search of ``seed`` found; a cached run whose directory is gone
        is run again, and must reproduce the cached accuracy."""
        path = nu.WORK / nu.run_key("dms", target, seed, s_ep, r_ep).replace("/", "-") / "search" / "structure.json"
        if not path.is_file():
            r = nu.run_arm("dms", target, seed, s_ep, r_ep, threads, base, NP["settle"], NP["settle_hold"])
            if r["acc"] != runs[f"dms/s{seed}"]["acc"]:
                raise RuntimeError(f"seed {seed}: DMS_np's search run again reached {r['acc']}, the cached row "
                                   f"{runs[f'dms/s{seed}']['acc']}: not the same structure")
        return json.loads(path.read_text())

    for seed in seeds:
        for arm in ("dms", "uniform"):
            if f"{arm}/s{seed}" not in runs:
                r = nu.run_arm(arm, target, seed, s_ep if arm == "dms" else 0.0, r_ep, threads, base,
                               NP["settle"] if arm == "dms" else 0.0, NP["settle_hold"] and arm == "dms")
                keep = ("acc", "macs", "params", "exported", "structure", "search_end", "solver_ran", "commit")
                store(f"{arm}/s{seed}", {"seed": seed, **{k: r[k] for k in keep if k in r},
                                         "seconds": r["search_seconds"] + r["retrain_seconds"]})
    dms_structures = {k: _dms_structure(k) for k in seeds[:n_dms]}
    _train_missing(runs, {f"dms_struct/{k}": st for k, st in dms_structures.items()}, seeds, retrain)
    _train_missing(runs, {f"random/{j}": st for j, st in enumerate(sampler["structures"])}, seeds, retrain)


def run_p(width: int, target: float, seeds: list[int], n_dms: int, threads: int, work: Path,
          runs: dict[str, Any], store: Callable[[str, dict[str, Any]], None], sampler: dict[str, Any]) -> None:
    """Every missing run of the p setting (each ``store``d at once)."""
    cfg = {"target": target, "pretrain_epochs": P["pretrain_epochs"], "search_epochs": P["search_epochs"],
           "finetune_epochs": P["finetune_epochs"], "settle": P["settle"], **({"width": width} if width != 8 else {})}
    pwork = work / "p"
    target_macs = sampler["target_macs"]
    searcher = sampler["searcher"]
    for seed in seeds:  # DMS_p and uniform through the peers table's own code
        done = {m: runs[f"{m}/s{seed}"] for m in ("dms_p", "uniform") if f"{m}/s{seed}" in runs}
        if len(done) < 2:
            peers.run_seed(seed, cfg, pwork, threads, done, None, ("dms_p", "uniform"))
            for m in ("dms_p", "uniform"):
                store(f"{m}/s{seed}", {**done[m], "exported": done[m]["macs"] / target_macs,
                                       "seconds": done[m]["prune_seconds"] + done[m]["finetune_seconds"]})
    pre = {s: pwork / (f"w{width}" if width != 8 else "") / f"pretrain{P['pretrain_epochs']}" / f"seed{s}" for s in seeds}
    supernets: dict[int, Any] = {}

    def finetune(name: str, structure: dict[str, Any], seed: int, **extra: Any) -> None:
        if seed not in supernets:
            supernets[seed] = load_run_model(pre[seed])[0].eval()
        t0 = time.perf_counter()
        d = pwork / peers._key(cfg) / name.replace("/", "-") / f"s{seed}"
        src = _source(d / "src", pre[seed], structure, pl.apply(supernets[seed], structure))
        out = d / "ft"
        if out.exists():
            shutil.rmtree(out)
        ft = peers._run(out, peers._setting(cfg), command="retrain", source=str(src), epochs=P["finetune_epochs"], seed=seed,
                        threads=threads)
        store(f"{name}/s{seed}", _row(ft, target_macs, seed, t0, structure=widths(structure), **extra))

    for k in seeds[:n_dms]:  # DMS_p's kept counts with the first channels of each seed's supernet
        found = json.loads((pwork / peers._key(cfg) / f"seed{k}" / "dms_p" / "structure.json").read_text())
        structure = rl.structure_at(searcher, rl.counts_of(found), [d["kept"] for d in found.get("depth", [])])
        if round(searcher.resources()["hard"]) != runs[f"dms_p/s{k}"]["macs"]:
            raise RuntimeError(f"seed {k}: DMS_p's counts with first channels cost {searcher.resources()['hard']:.0f} "
                               f"MACs, DMS_p's export {runs[f'dms_p/s{k}']['macs']}")
        _train_missing(runs, {f"dms_struct/{k}": structure}, seeds, finetune)
    _train_missing(runs, {f"random/{j}": st for j, st in enumerate(sampler["structures"])}, seeds, finetune)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_quick_flags(p, "random_control", "one seed, three structures, a fraction of an epoch", runs=True)
    p.add_argument("--setting", choices=("np", "p"), default="np",
                   help="np: DMS_np retrained from scratch (np_uniform's protocol); p: DMS_p finetuned (peers')")
    p.add_argument("--width", type=int, default=None, help="ResNet-20 base width (default: np 4, p 8)")
    p.add_argument("--target", type=float, default=0.25, help="fraction of the baseline's MACs")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--structures", type=int, default=20, help="random structures (each trained with every seed)")
    p.add_argument("--dms-structures", type=int, default=3,
                   help="the structures of the first K DMS seeds are also trained with every seed (dms_struct/k)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--table-only", action="store_true", help="only rewrite the md from the cache")
    args = p.parse_args(argv)
    global RESULTS, CACHE
    RESULTS = quick_mode(args, RESULTS, seeds=[0], structures=3, target=0.5)
    CACHE = RESULTS / CACHE.name
    if args.quick:
        NP.update(search_epochs=0.5, retrain_epochs=0.5)
        P.update(pretrain_epochs=1.0, search_epochs=0.5, finetune_epochs=0.5)
    width = args.width or (4 if args.setting == "np" else 8)
    torch.set_num_threads(args.threads)
    RESULTS.mkdir(parents=True, exist_ok=True)
    if not args.table_only:
        protocol = NP if args.setting == "np" else P
        key = setting_key(args.setting, width, args.target, protocol)
        sampler, _, _ = draw(args.setting, width, args.target, args.structures)
        record = _sampler_record(sampler)
        with locked(CACHE):
            cache = load_cache(CACHE, {"settings": {}})
            entry = cache["settings"].setdefault(key, {"runs": {}})
            old = entry.get("sampler", {}).get("counts")
            if old is not None and old != record["counts"][:len(old)] and old[:len(record["counts"])] != record["counts"]:
                raise RuntimeError(f"{key}: the sampler now draws other structures than the cached runs used; "
                                   "delete the setting from the cache to run it again")
            if old is None or len(record["counts"]) >= len(old):
                entry["sampler"] = record
            entry.update(kind=args.setting, width=width, target=args.target, protocol=dict(protocol))
            record_invocation(cache.setdefault("info", {}), key, command_line("-m bench.random_control", argv),
                              git_commit(ROOT), args.seeds)
            cache["machine"] = shared_machine(f"{args.threads} thread(s)")
            save_cache(CACHE, cache)
            runs = dict(entry["runs"])

        def store(name: str, row: dict[str, Any]) -> None:
            with locked(CACHE):
                c = load_cache(CACHE, {"settings": {}})
                c["settings"][key]["runs"][name] = row
                save_cache(CACHE, c)
            runs[name] = row
            print(f"{key} {name}: top-1 {100 * row['acc']:.2f} %, {row['exported']:.3f} x target "
                  f"({row['seconds']:.0f} s)", flush=True)

        run = run_np if args.setting == "np" else run_p
        run(width, args.target, args.seeds, args.dms_structures, args.threads, args.workdir / key, runs, store, sampler)
    print(f"wrote {rt.write_table(load_cache(CACHE, {'settings': {}}), RESULTS / 'random_control.md')}")


if __name__ == "__main__":
    main()
