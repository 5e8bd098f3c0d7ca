"""DMS_p against Torch-Pruning and uniform width scaling at equal MACs (issue 10, table 4).

    python -m bench.peers [--quick] [--seeds 0 1 2] [--target 0.5] [--equal-training] [--table-only]
        [--methods dms_p tp_magnitude tp_taylor uniform unpruned modelopt_fastnas]

Per seed, one shared pretrained supernet (the project's ``pretrain`` phase; ResNet-20 of
width 8 on the bundled 8x8 digits: MNIST takes about 4 s per step on this shared machine),
then four ways to reach ``--target`` x its MACs:

* ``dms_p``: ``--pipeline p --init <pretrain run>`` search phase (weights and structure
  trained together for ``--search-epochs``; the pipeline's finish phase and budget solver run).
* ``tp_magnitude`` / ``tp_taylor``: Torch-Pruning ``MagnitudePruner``, global pruning,
  ``MagnitudeImportance(p=2)`` / ``TaylorImportance()``, stepped iteratively to the target.
* ``uniform``: one width multiplier for all dimensions, first channels of the pretrained weights.
* ``modelopt_fastnas`` (only with ``--methods``; needs the ``bench`` extra): NVIDIA ModelOpt's
  FastNAS (``modelopt.torch.prune.prune(mode="fastnas")``) with channel divisor 1, BatchNorm
  calibration and ``score_func`` on training-split batches, its ``flops`` constraint bisected
  until ``dms.count`` MACs are within 1 % under the target (``bench/lib/peers_modelopt.py``).

Every result is then finetuned by the same ``dmscale retrain`` phase (same SGD, lr, cosine
schedule, epochs and batches); ``--equal-training`` is the control that also gives the peers
DMS_p's search epochs as finetuning (the search trains the weights too). MACs and parameters are counted by ``dms.count`` for all.
Results are cached per run in ``bench/results/peers.json`` (run directories under
``bench/runs/``, not committed); the table goes to ``bench/results/peers.md``. ``--quick`` is a
smoke run (one seed, a few epochs) whose cache and table go to ``WORKDIR/quick/`` instead
(``--workdir``, default ``bench/runs/peers/``).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import torch

from bench.lib import peers_extra as pe
from bench.lib.benchlib import (add_quick_flags, ci_text, command_line, hand_reading, invocations_text, load_cache,
                                mean_std, quick_mode, record_invocation, save_merged, shared_machine, write_md)
from bench.lib.peers_runs import (ABLATIONS, EXTRA, METHODS, RANDOM, REFERENCE, STRUCT, _commit, _key,
                                  run_seed)

__all__ = ["write_table", "main"]

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
CACHE = RESULTS / "peers.json"

def _model_title(setting: dict[str, Any]) -> str:
    """The start of a section's title: the model when it is not the width-8 ResNet-20."""
    if setting.get("model"):
        limit = f" (first {setting['train_limit']:,} training images)" if setting.get("train_limit") else ""
        return f"`{setting['model']}` on {setting['task']}{limit}, "
    depth = setting.get("depth", 20)
    if setting.get("width", 8) == 8 and depth == 20:
        return ""
    return f"ResNet-{depth} of width {setting.get('width', 8)}, "


def _section(cache: dict[str, Any], key: str) -> list[str]:
    """The table of one setting: every seed that has all methods."""
    setting, runs = cache["settings"][key], cache["runs"].get(key, {})
    info = cache.get("info", {}).get(key, {})
    have = sorted(int(s) for s, r in runs.items() if all(m in r for m in METHODS))
    wanted = info.get("seeds", have)
    partial = [s for s in wanted if s not in have]
    lines = [f"## {_model_title(setting)}"
             f"target {setting['target']} x MACs; pretrain {setting['pretrain_epochs']}, DMS_p search "
             f"{setting['search_epochs']}, finetune {setting['finetune_epochs']} epochs"
             + (f" (peers: {setting['finetune_epochs'] + setting['search_epochs']}, the same total weight "
                "training as DMS_p's search + finetune)" if setting.get("equal_training") else "")
             + (f"; DMS_p with `--settle {setting['settle']}`" if setting.get("settle") else "")
             + (", `--settle-hold`" if setting.get("settle_hold") else "")
             + (f", `--structure-lr {setting['structure_lr']}`" if setting.get("structure_lr") else ""), "",
             f"- commands (each adds its seeds to the cache): {invocations_text(info)}",
             f"- seeds with every method done: {have}"
             + (f" (**partial**: seeds {partial} still to run with the command above)" if partial else "")]
    if not have:
        return lines + [""]
    first = runs[str(have[0])]["dms_p"]
    lines += [f"- supernet: {first['supernet_macs']:,} MACs, {first['supernet_params']:,} params; pretrained "
              f"top-1 {mean_std([100 * runs[str(s)]['dms_p']['pretrain_acc'] for s in have])} %", "",
              "| method | top-1 after finetune (%) | MACs | x supernet MACs | params | prune/search time (s) |",
              "| --- | ---: | ---: | ---: | ---: | ---: |"]
    by = {m: [runs[str(s)][m] for s in have] for m in METHODS}
    for m in METHODS:
        rs = by[m]
        lines.append(f"| {m} | {mean_std([100 * r['acc'] for r in rs])} | {mean_std([r['macs'] for r in rs], '{:,.0f}')} | "
                     f"{mean_std([r['macs_frac'] for r in rs], '{:.3f}')} | {mean_std([r['params'] for r in rs], '{:,.0f}')} | "
                     f"{mean_std([r['prune_seconds'] for r in rs], '{:.0f}')} |")
    ceiling = all(REFERENCE in runs[str(s)] for s in have)
    if ceiling:
        rs = [runs[str(s)][REFERENCE] for s in have]
        lines.append(f"| {REFERENCE} (reference, not pruned) | {mean_std([100 * r['acc'] for r in rs])} | "
                     f"{mean_std([r['macs'] for r in rs], '{:,.0f}')} | 1.000 | "
                     f"{mean_std([r['params'] for r in rs], '{:,.0f}')} | - |")
    mean = {m: statistics.mean(100 * r["acc"] for r in by[m]) for m in METHODS}
    best = max((m for m in METHODS if m != "dms_p"), key=mean.get)
    diffs = [100 * (runs[str(s)]["dms_p"]["acc"] - runs[str(s)][best]["acc"]) for s in have]
    lines += ["", f"dms_p minus the best peer ({best}), pt: {ci_text(diffs)} (mean [95 % t-interval], p); per seed "
              + ", ".join(f"{d:+.2f}" for d in diffs) + ("." if setting.get("model") else " (one test image is 0.28 pt).")]
    if ceiling:  # how much of the accuracy pruning lost each method gets back
        lines.append(f"Each method minus `{REFERENCE}` (the supernet finetuned the same way), pt: " + "; ".join(
            f"{m} {ci_text([100 * (runs[str(s)][m]['acc'] - runs[str(s)][REFERENCE]['acc']) for s in have])}"
            for m in METHODS) + ".")
    lines += pe.ablation_lines(runs, have, ABLATIONS)
    lines += pe.struct_lines(runs, have, STRUCT)
    lines += pe.random_lines(runs, have, RANDOM)
    extra = [runs[str(s)][m] for s in have for m in EXTRA if m in runs[str(s)]]
    lines += pe.extra_lines(runs, have, EXTRA, setting["target"], REFERENCE if ceiling else None,
                            extra[0].get("supernet_structure") if extra else None)
    lines += ["",
              "Structures (kept channels per width group in model order | removable blocks kept per stage):", ""]
    for m in METHODS:
        for r in by[m]:
            extra = f", multiplier {r['multiplier']:.3f}" if r.get("multiplier") is not None else ""
            lines.append(f"- {m}, seed {r['seed']}: {r['structure']} ({r['steps']} prune/search steps{extra})")
    return lines + [""]


def write_table(cache: dict[str, Any]) -> Path:
    """``bench/results/peers.md``: one section per cached setting (full runs first), then the
    hand-written reading in ``bench/results/peers_reading.md`` when it exists."""
    keys = sorted(cache["settings"], key=lambda k: (cache["settings"][k]["finetune_epochs"] < 1,
                                                    cache["settings"][k].get("equal_training", False),
                                                    -cache["settings"][k]["target"]))
    lines = ["# DMS_p vs Torch-Pruning vs uniform width at equal MACs (issue 10, table 4)"
             + (" -- issue 56's diagnosis" if CACHE.stem == "peers_diag" else ""), "",
             f"- machine: {cache['machine']}",
             "- task: ResNet-20 (width 8) on the 8x8 digits (1,438 train / 359 test images) unless a section "
             "names another model: MNIST costs the ResNet-20 about 4 s per step on this shared machine, too slow "
             "for many seeds; one section runs torchvision's ResNet-18 on MNIST, a model whose channels are "
             "multiples of 32, where FastNAS's own granularity fits",
             "- protocol: one pretrained supernet per seed (`dmscale pretrain`), then each method reaches the "
             "target from it and every result is finetuned by the same `dmscale retrain` phase (SGD, lr 0.05, "
             "cosine, same epochs and batches). MACs/params by `dms.count` for all.",
             "- methods: `dms_p` = `--pipeline p --init <pretrain run>` search phase (weights + structure, then "
             "the pipeline's finish phase and budget solver); `tp_magnitude` / `tp_taylor` = Torch-Pruning "
             "`MagnitudePruner`, global pruning, `MagnitudeImportance(p=2)` / `TaylorImportance()`, stepped "
             "iteratively until the MACs are under the target; `uniform` = one width multiplier, the largest "
             "that fits, first channels of the pretrained weights; `modelopt_fastnas` (where run, `--methods "
             "modelopt_fastnas`) = NVIDIA ModelOpt FastNAS (`modelopt.torch.prune.prune(mode=\"fastnas\")`, rules "
             "with channel divisor 1 instead of 32, except where a section says 32, ModelOpt's default), BatchNorm calibration and `score_func` (top-1) on a split of "
             "the *training* images (80 % calibration / 20 % scoring), its `flops` constraint bisected until "
             "`dms.count` MACs are within 1 % under the target; it trains no weights (with `--equal-training` it "
             "gets the search epochs as finetune, like the other peers).",
             "- mean ± standard deviation over seeds. Prune/search time: DMS_p's whole search phase; "
             "Torch-Pruning's iterative pruning (Taylor: incl. its gradient batches); uniform's solver. "
             "Note the DMS_p search also trains the weights for its search epochs before the shared "
             "finetune; the other methods go straight to the finetune.", ""]
    for key in keys:
        lines += _section(cache, key)
    reading = hand_reading(RESULTS / f"{CACHE.stem}_reading.md")
    if reading is not None:
        lines += [reading, ""]
    return write_md(RESULTS / f"{CACHE.stem}.md", lines, end="")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_quick_flags(p, "peers", "one seed, a few epochs", runs=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--target", type=float, default=0.5)
    p.add_argument("--pretrain-epochs", type=float, default=10.0)
    p.add_argument("--search-epochs", type=float, default=2.0)
    p.add_argument("--finetune-epochs", type=float, default=4.0)
    p.add_argument("--equal-training", action="store_true",
                   help="control: finetune the peers for the search epochs more (DMS_p's search trains weights too)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--width", type=int, default=8, help="base width of the ResNet-20 (8: the cached settings')")
    p.add_argument("--model", default=None,
                   help="another model than the ResNet-20, as `dmscale --model` takes it (tv:resnet18); needs --task")
    p.add_argument("--task", default=None, help="the task of --model (mnist)")
    p.add_argument("--train-limit", type=int, default=None, help="the first N training images of --task")
    p.add_argument("--fastnas-divisor", type=int, default=1,
                   help="FastNAS's channel divisor (1: every width; 32: ModelOpt's default rules)")
    p.add_argument("--settle", type=float, default=0.0,
                   help="DMS_p's --settle (0: the cached settings' protocol, Eq. 10 to the last step; "
                        "0.4: the library default since)")
    p.add_argument("--settle-hold", action="store_true",
                   help="DMS_p's --settle-hold (the library default since cfbead7; the cached rows ran without it)")
    p.add_argument("--structure-lr", type=float, default=None,
                   help="DMS_p's --structure-lr (default: the library's; the cached settings ran at 0.01)")
    p.add_argument("--depth", type=int, default=20, help="depth of the CIFAR ResNet (20: the cached settings')")
    p.add_argument("--methods", nargs="+", choices=(*METHODS, REFERENCE, *EXTRA, *ABLATIONS, STRUCT, "random"), default=None,
                   help="run only these (default: every method but modelopt_fastnas); a method added to "
                        "cached seeds runs on their pretrained supernets")
    p.add_argument("--table-only", action="store_true", help="only rewrite peers.md from the cache")
    p.add_argument("--name", default="peers",
                   help="the table: cache NAME.json, table NAME.md, reading NAME_reading.md under bench/results "
                        "(peers_diag: issue 56's diagnosis, rerun on one machine)")
    args = p.parse_args(argv)
    methods = tuple(args.methods) if args.methods else (*METHODS, REFERENCE)
    methods = tuple(x for m in methods for x in (RANDOM if m == "random" else (m,)))
    if "modelopt_fastnas" in methods:
        try:
            import modelopt.torch.prune  # noqa: F401
        except ImportError:
            p.error("--methods modelopt_fastnas needs NVIDIA ModelOpt: pip install -e '.[bench]'")
    global RESULTS, CACHE
    RESULTS = quick_mode(args, RESULTS, seeds=[0], pretrain_epochs=2.0, search_epochs=0.5, finetune_epochs=0.5)
    CACHE = RESULTS / f"{args.name}.json"
    torch.set_num_threads(args.threads)
    cfg = {"target": args.target, "pretrain_epochs": args.pretrain_epochs,
           "search_epochs": args.search_epochs, "finetune_epochs": args.finetune_epochs}
    if args.equal_training:
        cfg["equal_training"] = True
    if args.width != 8:
        cfg["width"] = args.width
    if args.depth != 20:
        cfg["depth"] = args.depth
    if (args.model is None) != (args.task is None):
        p.error("--model and --task go together (e.g. --task mnist --model tv:resnet18)")
    if args.model:
        cfg.update(task=args.task, model=args.model, **({"train_limit": args.train_limit} if args.train_limit else {}))
    if args.fastnas_divisor != 1:
        cfg["fastnas_divisor"] = args.fastnas_divisor
    if args.settle:
        cfg["settle"] = args.settle
    if args.structure_lr:
        cfg["structure_lr"] = args.structure_lr
    if args.settle_hold:
        if not args.settle:
            p.error("--settle-hold acts only with a settle phase: add --settle 0.4")
        cfg["settle_hold"] = True
    key = _key(cfg)
    RESULTS.mkdir(parents=True, exist_ok=True)
    cache = load_cache(CACHE)
    if args.table_only:  # the cache's machine and commit: the table is what its runs wrote
        print(f"wrote {write_table(cache)}")
        return
    cache["commit"] = _commit()
    cache["machine"] = shared_machine(f"{args.threads} thread(s)")
    command = command_line("-m bench.peers", argv)
    cache.setdefault("runs", {}).setdefault(key, {})
    cache.setdefault("settings", {})[key] = cfg
    record_invocation(cache.setdefault("info", {}), key, command, cache["commit"], args.seeds)

    def save() -> None:  # invocations of other settings may share the cache
        disk = save_merged(CACHE, cache, key, args.seeds, top=("commit", "machine"))
        cache.update({k: v for k, v in disk.items() if k != "runs"})
        cache["runs"] = {**disk["runs"], key: cache["runs"][key]}

    for seed in args.seeds:
        run_seed(seed, cfg, args.workdir, args.threads, cache["runs"][key].setdefault(str(seed), {}), save, methods)
        save()
        print(f"wrote {write_table(cache)}", flush=True)


if __name__ == "__main__":
    main()
