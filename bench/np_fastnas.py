"""NVIDIA ModelOpt FastNAS as an arm of the DMS_np vs uniform-width table (issue 50, item 1):
its structure at equal MACs, retrained from scratch exactly like the table's other arms.

    python -m bench.np_fastnas [--width 4] [--targets 0.25 0.5] [--seeds 0 1 2]
        [--pretrain-epochs 10] [--retrain-epochs 20] [--threads 1]

Per seed and target (ResNet-20 of ``--width`` on the 8x8 digits, the protocol of
``bench/np_uniform.py``):

1. the network FastNAS prunes: ``dmscale pretrain`` of the ResNet-20 for ``--pretrain-epochs``
   (10: the recipe of the peers table, ``bench/peers.py``, whose pretrain runs it reproduces;
   DMS_np's search trains its weights for the same 10 epochs), on the training split;
2. FastNAS (``peers_modelopt.prune_on_task``: channel divisor 1, BatchNorm calibration on 80 %
   and ``score_func`` top-1 on the other 20 % of the *training* images, its ``flops``
   constraint bisected until ``dms.count`` MACs are within 1 % under t x the baseline's);
3. its structure (kept channels per width group, every block kept: FastNAS removes none),
   checked to be a point of DMS_np's own search space (``random_control_lib.structure_at`` at
   the same kept counts costs the same MACs), then built on the np baseline and trained from
   scratch by the same ``dmscale retrain --retrain-init scratch`` (``--retrain-epochs``, same
   seed: same initialisation and batches as the ``uniform`` and ``dms`` arms of that seed).

Rows go to the np table's cache (``bench/results/np_uniform_w4.json`` for width 4) as arm
``fastnas`` (``search_epochs`` = the pretrain epochs); the table (``np_uniform_table``, section
"Against NVIDIA ModelOpt FastNAS") is regenerated at the end, as ``np_uniform.py --table-only``
does. Needs the ``bench`` extra (``nvidia-modelopt``). Run directories under
``bench/runs/np_fastnas/``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
from bench.lib import np_uniform_runs as nu  # noqa: E402
from bench.lib import peers_runs as peers  # noqa: E402
from bench.lib import peers_lib as pl  # noqa: E402
from bench.lib import random_control_lib as rl  # noqa: E402
from bench.lib.benchlib import RUNS, command_line, git_commit, load_cache, locked, save_cache, shared_machine  # noqa: E402
from dmscale.config.run_config import RunConfig, save_config  # noqa: E402
from dmscale.errors import StructureError  # noqa: E402
from dmscale.run.pipeline import load_run_model  # noqa: E402
from dmscale.run.saved_runs import new_supernet  # noqa: E402
from dmscale.tasks.registry import build_task  # noqa: E402

__all__ = ["ARM", "in_np_space", "run_fastnas", "main"]

ARM = "fastnas"
WORK = RUNS / "np_fastnas"


def in_np_space(model: torch.nn.Module, example: torch.Tensor, structure: dict[str, Any]) -> bool:
    """Whether ``structure``'s kept counts are a point of DMS_np's search space of ``model``
    (every count in [min, size] on its gate's step) with the same exact MACs there: the two
    arms then choose from the same set of structures.

    Raises:
        StructureError: the space's width groups are not ``structure``'s, in the same order.
    """
    cfg = RunConfig(command="search", pipeline="np", **nu.MODEL, target=0.5).resolved()
    task = build_task(cfg)
    with torch.random.fork_rng(devices=[]):
        _, exclude = new_supernet(cfg, task.info, 0)
    searcher = rl.space_searcher(model, example, lambda: cfg.search_config(exclude))
    order = [w["producers"][0] for w in searcher.structure()["width"]]
    if order != [w["producers"][0] for w in structure["width"]]:  # the table reads both arms' counts in one layout
        raise StructureError(f"DMS_np's width groups {order} differ from the structure's "
                             f"{[w['producers'][0] for w in structure['width']]}: compare per layer, not per count")
    try:
        rl.structure_at(searcher, rl.counts_of(structure))
    except StructureError:
        return False
    return round(searcher.resources()["hard"]) == pl.macs(pl.apply(model, structure), example)


def run_fastnas(target: float, seed: int, pretrain_epochs: float, retrain_epochs: float, threads: int,
                base: tuple[int, Any], width: int) -> dict[str, Any]:
    """One ``fastnas`` row: pretrain, FastNAS to ``target``, its structure retrained from scratch."""
    from bench.lib import peers_modelopt as pm

    base_macs, (model, example) = base
    work = WORK / f"w{width}"
    t0 = time.perf_counter()
    pre_dir = work / f"pretrain{pretrain_epochs}" / f"seed{seed}"
    pre = peers._run(pre_dir, peers._setting({"width": width}), command="pretrain", epochs=pretrain_epochs, seed=seed, threads=threads)
    supernet, _ = load_run_model(pre_dir)
    supernet.eval()
    task = build_task(RunConfig(**nu.MODEL).resolved())
    run = work / nu.run_key(ARM, target, seed, pretrain_epochs, retrain_epochs).replace("/", "-")
    r = pm.prune_on_task(task, supernet, example, target, seed, run / "fastnas_search.pth")  # training split only
    structure = pl.structure_from_shapes(pl.template_structure(supernet, example), r["model"])
    if pl.macs(pl.apply(model, structure), example) != r["macs"]:
        raise RuntimeError(f"seed {seed}: FastNAS's sub-net counts {r['macs']} MACs, its structure on the np "
                           f"baseline {pl.macs(pl.apply(model, structure), example)}")
    prune_s = time.perf_counter() - t0
    cfg_src = nu._fresh(run / "cfg")  # the config a search run of the baseline would hold (as the uniform arm)
    cfg_src.mkdir(parents=True)
    save_config(RunConfig(command="search", pipeline="np", **nu.MODEL, seed=seed).resolved(), cfg_src / "config.yaml")
    src = pl.write_source_run(nu._fresh(run / "src"), cfg_src, structure, pl.apply(model, structure))
    ft = nu._retrain(src, run / "retrain", seed, retrain_epochs, threads, None)
    macs = ft["counts"]["found"]["macs"]
    return {"arm": ARM, "target": target, "seed": seed, "search_epochs": pretrain_epochs,
            "retrain_epochs": retrain_epochs, "structure": nu._brief(structure), "counts": rl.counts_of(structure),
            "width_groups": [w["producers"][0] for w in structure["width"]],
            "in_dms_space": in_np_space(model, example, structure),
            "macs": macs, "params": ft["counts"]["found"]["params"], "exported": macs / (target * base_macs),
            "base_macs": base_macs, "acc": ft["evals"]["final"]["acc"],
            "pretrain_acc": pre["evals"]["pretrain"]["acc"], "modelopt": pm.modelopt_version(),
            "constraint_percent": r["percent"], "bisect_runs": r["runs"], "in_window": r["in_window"],
            "score_evals": r["evals"], "tried": r["tried"], "search_seconds": round(prune_s, 1),
            "retrain_seconds": round(time.perf_counter() - t0 - prune_s, 1), "commit": git_commit(ROOT)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=4)
    p.add_argument("--targets", type=float, nargs="+", default=[0.25])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--pretrain-epochs", type=float, default=10.0)
    p.add_argument("--retrain-epochs", type=float, default=20.0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--table-only", action="store_true")
    args = p.parse_args(argv)
    nu.use(width=args.width)
    torch.set_num_threads(args.threads)
    command = command_line("-m bench.np_fastnas", argv)
    if not args.table_only:
        machine = shared_machine(f"{args.threads} thread(s)")
        base = nu.baseline()
        for target in args.targets:
            for seed in args.seeds:
                key = nu.run_key(ARM, target, seed, args.pretrain_epochs, args.retrain_epochs)
                if key in load_cache(nu.CACHE, {"runs": {}})["runs"]:
                    continue
                row = run_fastnas(target, seed, args.pretrain_epochs, args.retrain_epochs, args.threads, base,
                                  args.width)
                with locked(nu.CACHE):
                    cache = load_cache(nu.CACHE, {"runs": {}})
                    cache["runs"][key] = row
                    cache["fastnas_command"] = command
                    cache["fastnas_machine"] = machine
                    save_cache(nu.CACHE, cache)
                print(f"{key}: top-1 {100 * row['acc']:.2f} %, exported {row['exported']:.4f} x target, "
                      f"constraint {row['constraint_percent']:.2f} % ({row['bisect_runs']} runs), "
                      f"{row['structure']} ({row['search_seconds']} + {row['retrain_seconds']} s)", flush=True)
    from bench.lib.np_uniform_table import write_table

    cache = load_cache(nu.CACHE, {"runs": {}})
    print(f"wrote {write_table(cache, cache.get('last_command', command), name=nu.CACHE.stem, width=args.width)}")


if __name__ == "__main__":
    main()
