"""The runs of the DMS_np vs uniform-width table (``python -m bench.np_uniform``): the model and
cache it points at, one arm's search and retrain, the uniform source and the baseline's MACs.
``importance``, ``random_control``, ``scaling_claim``, ``table16`` and ``np_fastnas`` reuse them
(they set :data:`MODEL` and :data:`WORK` for their own protocol)."""

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

ROOT = Path(__file__).resolve().parents[2]
from bench.lib import np_uniform_lib as nl  # noqa: E402
from bench.lib import peers_lib as pl  # noqa: E402
from bench.lib.benchlib import RUNS, add_quick_flags, command_line, git_commit, load_cache, locked, quick_mode, save_cache  # noqa: E402
from dmscale.config.run_config import RunConfig, save_config  # noqa: E402
from dmscale.run.pipeline import Pipeline  # noqa: E402
from dmscale.run.saved_runs import new_supernet  # noqa: E402
from dmscale.tasks.registry import build_task  # noqa: E402

__all__ = ["ARMS", "DEFAULT_MODEL", "run_key", "run_arm", "uniform_source", "baseline", "use", "dataset_note", "store"]

RESULTS = ROOT / "bench" / "results"
CACHE = RESULTS / "np_uniform.json"  # CACHE, WORK, MODEL: what use() sets
WORK = RUNS / "np_uniform"
ARMS = ("uniform", "dms", "dms_expand", "dms_width")
DEFAULT_MODEL = {"task": "digits", "model": "resnet", "model_args": {"width": 8}}
MODEL = dict(DEFAULT_MODEL)
EXPAND = {"width": 1.5, "depth": 2.0}
# the budget solver's refill (rows without this field ran the earlier one: cheapest unit first)
SOLVER = "widths offset + offset-order refill"


def use(task: str = "digits", width: int = 8, train_limit: int | None = None,
        results: Path | None = None, work: Path = RUNS / "np_uniform") -> None:
    """Point the model, the cache and the run directories at a ResNet-20 of base ``width`` on
    ``task``, from the defaults (not from what an earlier call set: several scripts share this
    module in one process, ``python -m bench check``). The digits at width 8 are
    ``np_uniform.json`` in ``results`` (None: :data:`RESULTS`) and runs under ``work``; another
    task or width adds ``_TASK`` / ``_wWIDTH`` to the cache's name and ``TASK/`` / ``wWIDTH/``
    to the run directories (tests/run/test_np_uniform_lib.py)."""
    global MODEL, CACHE, WORK
    results = RESULTS if results is None else results
    MODEL, CACHE, WORK = dict(DEFAULT_MODEL), results / "np_uniform.json", work
    if task != "digits":
        MODEL.update(task=task, train_limit=train_limit)
        CACHE, WORK = results / f"np_uniform_{task}.json", work / task
    if width != 8:
        MODEL["model_args"] = {"width": width}
        CACHE, WORK = CACHE.with_name(f"{CACHE.stem}_w{width}.json"), WORK / f"w{width}"


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


def store(key: str, row: dict[str, Any], machine: str) -> None:
    """Read-modify-write of the cache (several invocations may share it: under a lock)."""
    with locked(CACHE):
        cache = load_cache(CACHE, {"runs": {}})
        cache["runs"][key] = row
        cache["machine"] = machine
        save_cache(CACHE, cache)

