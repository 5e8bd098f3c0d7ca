"""The scaling claim (issue 50): DMS_np searched from an enlarged supernet (``--expand
width=1.5,depth=2``) down to the baseline's own MACs, trained from scratch like the baseline,
against the hand-designed baseline itself.

    python -m bench.scaling_claim [--settings NAME ...] [--seeds S ...]
        [--threads 1] [--table-only] [--quick]

Per setting (:data:`SETTINGS`, fixed before any DMS run; every one is in the table) and seed:

* ``baseline``: the model as designed (``np_uniform.uniform_source`` at 1.0 x: every width
  kept), trained from scratch by ``dmscale retrain --retrain-init scratch``;
* ``dms_expand``: DMS_np (settle 0.4 with the hold, the library default) searched from the
  model enlarged by ``--expand width=1.5,depth=2`` with the baseline's exact MACs as an
  absolute target (and the baseline's parameters as a second budget where the setting says
  so), its structure trained from scratch by the same phase (same optimiser, schedule,
  epochs, batches and seed).

Images: ResNet-20 on the bundled 8x8 digits or MNIST (top-1, higher is better; the machinery
of ``bench/np_uniform.py``). Text: the causal-conv ``charcnn`` on the bundled Shakespeare
(test bits per character, lower is better), through the same ``RunConfig`` / ``Pipeline``
path. A search is shared by every setting with the same model, search length and budgets
(the retrain length is not part of it); a baseline by every setting with the same model and
retrain length. Cached per run in ``bench/results/scaling_claim.json`` (resumable: a run in
the cache is not run again); the table goes to ``bench/results/scaling_claim.md``
(``scaling_claim_table``). Run directories under ``--workdir`` (default
``bench/runs/scaling_claim/``, ignored). ``--quick``: one image and one text setting, one
seed, half an epoch each, into ``WORKDIR/quick/``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

ROOT = Path(__file__).resolve().parents[1]
from bench.lib import np_uniform_runs as nu  # noqa: E402
from bench.lib import np_uniform_lib as nl  # noqa: E402
from bench.lib.scaling_claim_settings import (SETTINGS, Setting, _quick, baseline_key, dms_key, model_id,  # noqa: E402
                                              narrow_dims, search_key)
from bench.lib.benchlib import (RUNS, add_quick_flags, command_line, environment, git_commit, load_cache, locked,  # noqa: E402
                      quick_mode, record_invocation, save_cache)

__all__ = ["Setting", "SETTINGS", "model_id", "baseline_key", "search_key", "dms_key", "narrow_dims",
           "run_setting", "main"]

RESULTS = ROOT / "bench" / "results"
CACHE = RESULTS / "scaling_claim.json"
WORK = RUNS / "scaling_claim"
SETTLE, SETTLE_HOLD = 0.4, True  # the library's default search (bench/RESULTS.md, issue table 3)


@contextlib.contextmanager
def _model(s: Setting) -> Iterator[None]:
    """np_uniform's runs build this setting's model (its module globals, restored after)."""
    saved = nu.MODEL, nu.WORK
    nu.MODEL = dict(s.model)
    nu.WORK = WORK
    try:
        yield
    finally:
        nu.MODEL, nu.WORK = saved


def _metrics(ft: dict[str, Any], base_macs: int, base_params: int | None) -> dict[str, Any]:
    found, final = ft["counts"]["found"], ft["evals"]["final"]
    row = {"macs": found["macs"], "params": found["params"], "base_macs": base_macs,
           "final": {k: v for k, v in final.items() if isinstance(v, (int, float))},
           "acc": final["acc"], "commit": git_commit(ROOT)}
    if "bpc" in final:
        row["bpc"] = final["bpc"]
    if base_params is not None:
        row["base_params"] = base_params
    return row


def _run_baseline(s: Setting, seed: int, base: tuple[int, Any], threads: int) -> dict[str, Any]:
    work = WORK / baseline_key(s, seed).replace("/", "-")
    t0 = time.perf_counter()
    src, _, mult = nu.uniform_source(work, 1.0, seed, base)
    if mult != 1.0:
        raise RuntimeError(f"the baseline keeps every width (multiplier 1.0), got {mult}")
    ft = nu._retrain(src, work / "retrain", seed, s.retrain_epochs, threads, None)
    return {**_metrics(ft, base[0], None), "seed": seed, "seconds": round(time.perf_counter() - t0, 1)}


def _search_dir(s: Setting, seed: int) -> Path:
    return WORK / search_key(s, seed).replace("/", "-") / "search"


def _run_search(s: Setting, seed: int, base: tuple[int, Any], base_params: int, threads: int) -> dict[str, Any]:
    """One traced DMS_np search from ``--expand`` at the baseline's MACs (and parameters)."""
    out = _search_dir(s, seed)
    overrides: dict[str, Any] = {}
    if s.budgets != ("macs",):
        counts = {"macs": float(base[0]), "params": float(base_params)}
        overrides["target"] = {r: counts[r] for r in s.budgets}
    if s.min_width > 1:
        overrides["min_width"] = s.min_width
    t0 = time.perf_counter()
    summary, info = nu._search("dms_expand", 1.0, seed, s.search_epochs, threads, base[0], out, SETTLE, SETTLE_HOLD,
                               config_overrides=overrides)
    structure = json.loads((out / "structure.json").read_text())
    keep = ("search_end", "after_finish", "finish_steps", "solver_ran", "supernet_macs", "acc_search")
    return {**{k: info[k] for k in keep}, "seed": seed, "shift_posthoc": info["shift_posthoc"]["mean_abs"],
            "supernet_params": summary["counts"]["supernet"]["params"], "structure": nu._brief(structure),
            "narrow": narrow_dims(structure), "seconds": round(time.perf_counter() - t0, 1),
            "commit": git_commit(ROOT)}


def _run_dms(s: Setting, seed: int, base: tuple[int, Any], base_params: int, threads: int,
             search: dict[str, Any]) -> dict[str, Any]:
    work = WORK / dms_key(s, seed).replace("/", "-")
    t0 = time.perf_counter()
    ft = nu._retrain(_search_dir(s, seed), work / "retrain", seed, s.retrain_epochs, threads, nu.EXPAND)
    return {**_metrics(ft, base[0], base_params), "seed": seed, "structure": search["structure"],
            "narrow": search["narrow"], "seconds": round(time.perf_counter() - t0, 1)}


def _store(key: str, row: dict[str, Any]) -> None:
    with locked(CACHE):
        cache = load_cache(CACHE, {"runs": {}})
        cache["runs"][key] = row
        save_cache(CACHE, cache)


def run_setting(s: Setting, seeds: list[int], threads: int) -> None:
    """Every missing run of ``s`` for ``seeds``: baseline, search (unless its directory and
    row are there), the search's structure trained from scratch."""
    with _model(s):
        base = nu.baseline()
        base_params = sum(p.numel() for p in base[1][0].parameters())
        for seed in seeds:
            runs = load_cache(CACHE, {"runs": {}})["runs"]
            if baseline_key(s, seed) not in runs:
                row = _run_baseline(s, seed, base, threads)
                _store(baseline_key(s, seed), row)
                print(f"{s.name} baseline s{seed}: {_score(s, row)} ({row['seconds']} s)", flush=True)
            if dms_key(s, seed) in runs:
                continue
            search = runs.get(search_key(s, seed))
            if search is None or not (_search_dir(s, seed) / "structure.json").is_file():
                search = _run_search(s, seed, base, base_params, threads)
                _store(search_key(s, seed), search)
                print(f"{s.name} search s{seed}: {search['structure']}, end {search['search_end']:.2f} x "
                      f"({search['seconds']} s)", flush=True)
            row = _run_dms(s, seed, base, base_params, threads, search)
            _store(dms_key(s, seed), row)
            print(f"{s.name} dms_expand s{seed}: {_score(s, row)}, MACs {row['macs'] / base[0]:.3f} x, "
                  f"params {row['params'] / base_params:.3f} x ({row['seconds']} s)", flush=True)


def _score(s: Setting, row: dict[str, Any]) -> str:
    return f"bpc {row['bpc']:.4f}" if s.kind == "text" else f"top-1 {100 * row['acc']:.2f} %"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_quick_flags(p, "scaling_claim", "smoke run: one image and one text setting, one seed, half an epoch",
                    "cache and table", runs=True)
    names = [s.name for s in SETTINGS]
    p.add_argument("--settings", nargs="+", choices=names, default=names)
    p.add_argument("--seeds", type=int, nargs="+", default=None,
                   help="run only these of each setting's seeds (the table reports what the cache holds)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--table-only", action="store_true")
    args = p.parse_args(argv)
    global RESULTS, CACHE, WORK
    WORK = args.workdir
    RESULTS = quick_mode(args, RESULTS)
    CACHE = RESULTS / CACHE.name
    settings = _quick(SETTINGS) if args.quick else tuple(s for s in SETTINGS if s.name in args.settings)
    torch.set_num_threads(args.threads)
    RESULTS.mkdir(parents=True, exist_ok=True)
    command = command_line("-m bench.scaling_claim", argv)
    if not args.table_only:
        for s in settings:
            seeds = [x for x in s.seeds if args.seeds is None or x in args.seeds]
            run_setting(s, seeds, args.threads)
            with locked(CACHE):
                cache = load_cache(CACHE, {"runs": {}})
                record_invocation(cache.setdefault("invocations", {}), s.name, command, git_commit(ROOT), seeds)
                cache["env"] = environment(args.threads)
                save_cache(CACHE, cache)
    from bench.lib import scaling_claim_table

    print(f"wrote {scaling_claim_table.write_table(load_cache(CACHE, {'runs': {}}), settings if args.quick else SETTINGS, RESULTS / 'scaling_claim.md')}")


if __name__ == "__main__":
    main()
