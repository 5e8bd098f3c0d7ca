"""The runs of the DMS_p vs Torch-Pruning vs uniform table (``python -m bench.peers``): its
methods, a setting's run fields and cache key, one pipeline run, and every method of one seed.
``random_control`` and ``np_fastnas`` reuse them."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from bench.lib import peers_lib as pl
from bench.lib.benchlib import git_commit, widths
from dmscale.config.run_config import RunConfig
from dmscale.run.pipeline import Pipeline, load_run_model
from dmscale.tasks.registry import build_task

__all__ = ["METHODS", "REFERENCE", "EXTRA", "RANDOM", "STRUCT", "ABLATIONS", "MODEL", "run_seed"]

ROOT = Path(__file__).resolve().parents[2]
METHODS = ("dms_p", "tp_magnitude", "tp_taylor", "uniform")
REFERENCE = "unpruned"  # the supernet itself, finetuned the same way: the ceiling of every method
EXTRA = ("modelopt_fastnas",)  # peers run only when --methods names them (a package outside CI's install)
# the random control (issue 56): structures drawn uniformly from DMS_p's search space at 0.99-1.00 x
# the target MACs (bench/lib/random_control_lib.py), first channels of the pretrained supernet,
# finetuned like every method; RANDOM_PER_SEED draws per seed, run with --methods random
RANDOM_PER_SEED = 5
RANDOM = tuple(f"random{j}" for j in range(RANDOM_PER_SEED))
# DMS_p's structure (its kept channels) on the pretrained supernet's weights, not on the weights its
# search trained, finetuned as long as the peers: the structure apart from the search's training
STRUCT = "dms_p_struct"
# DMS_p variants run only when --methods names them, and the RunConfig fields their search adds
ABLATIONS: dict[str, dict[str, Any]] = {
    "dms_p_width": {"search_dims": "width"},
    # issue 56's diagnosis: the residual streams held whole (every dim two or more blocks write)
    "dms_p_keep_residual": {"keep_width": ["residual"]},
    # the same search with the weights frozen (p-: structure only) from the same supernet
    "dms_pminus": {"pipeline": "p-"},
    # a search twice as long, its finetune shorter by as much (the same weight training)
    "dms_p_long": {"epochs": 4.0},
}
MODEL = {"model": "resnet", "model_args": {"width": 8}}


def _commit() -> str:
    return git_commit(ROOT)


def _model(width: int, depth: int = 20) -> dict[str, Any]:
    """The CIFAR ResNet of base ``width`` (8: every cached setting without a ``width``) and
    ``depth`` (20: every cached setting without a ``depth``)."""
    return {**MODEL, "model_args": {"width": width, **({"depth": depth} if depth != 20 else {})}}


def _setting(cfg: dict[str, Any]) -> dict[str, Any]:
    """The RunConfig fields of a setting's task and model: the ResNet-20 on the digits, or the
    ``task`` / ``model`` / ``train_limit`` it names (``--task mnist --model tv:resnet18``)."""
    if cfg.get("model"):
        return {"task": cfg["task"], "model": cfg["model"],
                **({"train_limit": cfg["train_limit"]} if cfg.get("train_limit") else {})}
    return {"task": "digits", **_model(cfg.get("width", 8), cfg.get("depth", 20))}


def _prefix(cfg: dict[str, Any]) -> str:
    """The part of a setting's key and run directory that names a task and model of its own."""
    if not cfg.get("model"):
        return (f"w{cfg['width']}-" if cfg.get("width", 8) != 8 else "") + \
            (f"d{cfg['depth']}-" if cfg.get("depth", 20) != 20 else "")
    return f"{cfg['task']}-{cfg['model'].replace(':', '_')}" + (f"-n{cfg['train_limit']}" if cfg.get("train_limit") else "") + "-"


def _run(out: Path, setting: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """One pipeline run in ``out`` (reused when it finished before)."""
    if (out / "summary.json").exists():
        return json.loads((out / "summary.json").read_text())
    if out.exists():  # an interrupted run: start it again
        import shutil
        shutil.rmtree(out)
    cfg = RunConfig(**setting, quiet=True, out=str(out), **{"settle": 0.0, "settle_hold": False, **fields})  # the cached rows' protocol (before the settle phase and its hold)
    return Pipeline(cfg.resolved()).run()


def _key(cfg: dict[str, Any]) -> str:
    """The cache key of a setting (``settle`` 0, the protocol before the settle phase, keeps the
    key its runs were stored under)."""
    key = "t{target}-pre{pretrain_epochs}-s{search_epochs}-ft{finetune_epochs}".format(**cfg)
    key = _prefix(cfg) + key
    return key + ("-eqtrain" if cfg.get("equal_training") else "") + \
        (f"-settle{cfg['settle']}" if cfg.get("settle") else "") + \
        (f"-slr{cfg['structure_lr']}" if cfg.get("structure_lr") else "") + \
        ("-hold" if cfg.get("settle_hold") else "")


def _finetune_epochs(cfg: dict[str, Any], method: str) -> float:
    """The shared finetune; with ``equal_training`` the peers also get DMS_p's search epochs
    (a control: DMS_p's search trains the weights too)."""
    trains_weights = method in ("dms_p", *ABLATIONS) and ABLATIONS.get(method, {}).get("pipeline") != "p-"
    extra = cfg["search_epochs"] if cfg.get("equal_training") and not trains_weights else 0.0
    longer = ABLATIONS.get(method, {}).get("epochs", cfg["search_epochs"]) - cfg["search_epochs"]
    return cfg["finetune_epochs"] + extra - longer


def run_seed(seed: int, cfg: dict[str, Any], work: Path, threads: int, done: dict[str, Any],
             save: Any = None, methods: tuple[str, ...] = (*METHODS, REFERENCE)) -> dict[str, Any]:
    """The ``methods`` of one seed that ``done`` lacks, each stored into ``done`` (then
    ``save()``); returns ``done``. A method added to a seed whose other rows are cached runs on
    the same pretrained supernet: the pretrain run is reproduced and checked (its accuracy must
    equal the cached rows')."""
    if all(m in done for m in methods):
        return done
    setting = _setting(cfg)
    base = work / _key(cfg) / f"seed{seed}"
    pre_dir = work / _prefix(cfg).rstrip("-") / f"pretrain{cfg['pretrain_epochs']}" / f"seed{seed}"  # every target's
    t0 = time.perf_counter()
    pre = _run(pre_dir, setting, command="pretrain", epochs=cfg["pretrain_epochs"], seed=seed, threads=threads)
    task = build_task(RunConfig(**setting).resolved())
    example = task.example_inputs()
    cached = {r["pretrain_acc"] for r in done.values()}
    if cached and cached != {pre["evals"]["pretrain"]["acc"]}:
        raise RuntimeError(f"seed {seed}: the pretrain run in {pre_dir} reached {pre['evals']['pretrain']['acc']}, "
                           f"the cached rows' supernet {sorted(cached)}: not the same supernet, so a new method "
                           "cannot be compared with them (run every method of this setting again)")
    supernet, _ = load_run_model(pre_dir)
    full = pl.macs(supernet, example)
    out = done
    for method in methods:
        if method in done:
            continue
        src = base / method
        t = time.perf_counter()
        extra_steps, search_end, method_info = 0, None, {}
        if method in ("dms_p", *ABLATIONS):
            s = _run(src, setting, **{"command": "search", "pipeline": "p", "init": str(pre_dir),
                                      "epochs": cfg["search_epochs"], "retrain_epochs": 0,
                                      "target": cfg["target"], "seed": seed, "threads": threads,
                                      "settle": cfg.get("settle", 0.0),
                                      "settle_hold": bool(cfg.get("settle_hold")),
                                      **({"structure_lr": cfg["structure_lr"]} if cfg.get("structure_lr") else {}),
                                      **ABLATIONS.get(method, {})})
            extra_steps = s["steps"]
            end = s["resources_search_end"]
            search_end = end["hard"] / end["target"]  # > 1: never landed, so the settle phase's hold never acted
            structure = json.loads((src / "structure.json").read_text())
        elif method.startswith("tp_"):
            supernet.train()

            def batches(step: int = 0):
                while True:
                    yield task.train_batch(step, 128, seed * 1000 + 7)
                    step += 1
            r = pl.tp_prune(supernet, example, cfg["target"], method[3:], batches(),
                            lambda logits, y: task.task_loss(logits, y))
            r["model"].eval()
            structure = pl.structure_from_shapes(pl.template_structure(supernet, example), r["model"])
            pl.write_source_run(src, pre_dir, structure, r["model"])
            extra_steps = r["steps"]
        elif method == "modelopt_fastnas":
            from bench.lib import peers_modelopt as pm
            supernet.eval()
            r = pm.prune_on_task(task, supernet, example, cfg["target"], seed,  # training split only
                                 base / "modelopt_fastnas_search.pth", divisor=cfg.get("fastnas_divisor", 1))
            template = pl.template_structure(supernet, example)
            structure = pl.structure_from_shapes(template, r["model"])
            pl.write_source_run(src, pre_dir, structure, r["model"])
            extra_steps = r["evals"]
            method_info = {"modelopt": pm.modelopt_version(), "divisor": cfg.get("fastnas_divisor", 1),
                           "constraint_percent": r["percent"],
                           "bisect_runs": r["runs"], "in_window": r["in_window"],
                           "width_groups": [w["producers"][0] for w in structure["width"]],
                           "supernet_structure": widths(template)}
        elif method == STRUCT:
            structure = json.loads((base / "dms_p" / "structure.json").read_text())  # needs dms_p first
            supernet.eval()
            pl.write_source_run(src, pre_dir, structure, pl.apply(supernet, structure))
        elif method in RANDOM:
            from bench.lib import random_control_lib as rl
            supernet.eval()
            draw = rl.sample(rl.space_searcher(supernet, example), supernet, example, 1, cfg["target"],
                             seed=1000 * seed + RANDOM.index(method))
            structure = draw["structures"][0]
            pl.write_source_run(src, pre_dir, structure, pl.apply(supernet, structure))
        elif method == REFERENCE:
            supernet.eval()
            structure = pl.template_structure(supernet, example)
            pl.write_source_run(src, pre_dir, structure, supernet)
        else:
            supernet.eval()
            structure, mult = pl.uniform_structure(supernet, example, cfg["target"])
            pl.write_source_run(src, pre_dir, structure, pl.apply(supernet, structure))
            structure["multiplier"] = mult
        prune_s = time.perf_counter() - t
        t = time.perf_counter()
        ft = _run(base / f"{method}_ft", setting, command="retrain", source=str(src), epochs=_finetune_epochs(cfg, method),
                  seed=seed, threads=threads)
        counts = ft["counts"]["found"]
        out[method] = {"seed": seed, "method": method, "acc": ft["evals"]["final"]["acc"],
                       "macs": counts["macs"], "params": counts["params"],
                       "macs_frac": counts["macs"] / full,
                       "target": 1.0 if method == REFERENCE else cfg["target"],
                       "prune_seconds": round(prune_s, 1), "finetune_seconds": round(time.perf_counter() - t, 1),
                       "steps": extra_steps, "structure": widths(structure),
                       "multiplier": structure.get("multiplier"),
                       "pretrain_acc": pre["evals"]["pretrain"]["acc"], "supernet_macs": full,
                       "supernet_params": pre["counts"]["supernet"]["params"],
                       **({"search_end": search_end} if search_end is not None else {}), **method_info}
        print(f"seed {seed} {method:13} acc {100 * out[method]['acc']:.2f} % at "
              f"{out[method]['macs_frac']:.3f} x MACs ({prune_s:.0f} s to prune/search)", flush=True)
        if save is not None:
            save()
    print(f"seed {seed}: {time.perf_counter() - t0:.0f} s", flush=True)
    return out

