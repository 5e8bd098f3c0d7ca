"""The scaling claim (issue 50): DMS_np searched from an enlarged supernet (``--expand
width=1.5,depth=2``) down to the baseline's own MACs, trained from scratch like the baseline,
against the hand-designed baseline itself.

    PYTHONPATH=src python bench/scaling_claim.py [--settings NAME ...] [--seeds S ...]
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
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "bench" / "lib"))  # the shared helpers
sys.path.insert(0, str(ROOT / "src"))
import np_uniform as nu  # noqa: E402
import np_uniform_lib as nl  # noqa: E402
from benchlib import (RUNS, add_quick_flags, command_line, environment, git_commit, load_cache, locked,  # noqa: E402
                      quick_mode, record_invocation, save_cache)

__all__ = ["Setting", "SETTINGS", "model_id", "baseline_key", "search_key", "dms_key", "narrow_dims",
           "run_setting", "main"]

RESULTS = ROOT / "bench" / "results"
CACHE = RESULTS / "scaling_claim.json"
WORK = RUNS / "scaling_claim"
SETTLE, SETTLE_HOLD = 0.4, True  # the library's default search (bench/RESULTS.md, issue table 3)
NARROW = 2  # a width kept at this many channels or fewer counts as narrow (narrow_dims)


@dataclass(frozen=True)
class Setting:
    """One row of the table: a baseline model and the protocol both arms run under.

    Attributes:
        name: the row's name (and the cache's).
        kind: "image" (top-1, higher is better) or "text" (test bits per character, lower).
        model: the RunConfig fields that make the baseline (task, model, model_args, limits).
        search_epochs / retrain_epochs: of the DMS search / of every from-scratch training.
        seeds: fixed before any run.
        budgets: resources capped at the baseline's own count ("macs" always first).
        min_width: the search's smallest width (x_min; 1 = the default).
        tests: what the setting measures (one line of the table's notes).
        round: 1 for the settings fixed before any DMS run; 2 for one added once round 1's
            results were in; 3 once round 2's were (the table marks it and names why in ``tests``).
    """

    name: str
    kind: str
    model: dict[str, Any]
    search_epochs: float
    retrain_epochs: float
    seeds: tuple[int, ...]
    budgets: tuple[str, ...] = ("macs",)
    min_width: int = 1
    tests: str = ""
    round: int = 1


_DIGITS = {"task": "digits", "model": "resnet"}
_TEXT = {"task": "shakespeare", "model": "charcnn", "model_args": {"width": 32, "hidden": 64, "blocks": 4},
         "train_limit": 500_000, "test_limit": 100_000}
_MNIST_W4 = {"task": "mnist", "model": "resnet", "model_args": {"width": 4}, "train_limit": 5000}
_TWENTY, _EIGHT = tuple(range(20)), tuple(range(8))
SETTINGS: tuple[Setting, ...] = (
    Setting("digits-w8", "image", {**_DIGITS, "model_args": {"width": 8}}, 10.0, 20.0, _TWENTY,
            tests="the protocol of issue table 3 (ResNet-20, width 8)"),
    Setting("digits-w4", "image", {**_DIGITS, "model_args": {"width": 4}}, 10.0, 20.0, _TWENTY,
            tests="a narrower baseline, further from the digits' ceiling"),
    Setting("digits-w4-R40", "image", {**_DIGITS, "model_args": {"width": 4}}, 10.0, 40.0, _TWENTY,
            tests="longer from-scratch training (both arms 40 epochs; the searches of digits-w4)"),
    Setting("digits-w4-S30", "image", {**_DIGITS, "model_args": {"width": 4}}, 30.0, 20.0, _TWENTY,
            tests="a 3x longer search of the 4.6x supernet"),
    Setting("digits-w4-params", "image", {**_DIGITS, "model_args": {"width": 4}}, 10.0, 20.0, _TWENTY,
            budgets=("macs", "params"), tests="the baseline's parameters as a second budget"),
    Setting("digits-w4-min3", "image", {**_DIGITS, "model_args": {"width": 4}}, 10.0, 20.0, _TWENTY,
            min_width=3, tests="no width kept at one or two channels (--min-width 3)"),
    Setting("text-charcnn-R10", "text", _TEXT, 5.0, 10.0, _EIGHT,
            tests="CharCNN (width 32, hidden 64, 4 blocks), 10 epochs of 500k characters"),
    Setting("text-charcnn-R30", "text", _TEXT, 5.0, 30.0, _EIGHT,
            tests="longer from-scratch training (both arms 30 epochs; the searches of R10)"),
    Setting("digits-w2", "image", {**_DIGITS, "model_args": {"width": 2}}, 10.0, 20.0, _TWENTY, round=2,
            tests="added once digits-w8, -w4 and -w4-R40 had tied: a baseline far below the digits' "
                  "ceiling, where issue table 3 found DMS structures ahead of one width multiplier"),
    Setting("mnist-w4", "image", _MNIST_W4,
            5.0, 10.0, tuple(range(10)), round=2,
            tests="added once every digits setting had tied: MNIST's 10,000 test images (1 image = 0.01 pt; "
                  "the digits' 359: 0.28 pt), the first 5,000 training images, the protocol of np_uniform_mnist"),
    Setting("mnist-w4-rep", "image", _MNIST_W4,
            5.0, 10.0, tuple(range(10, 20)), round=3,
            tests="added once mnist-w4 had won (round 2): the same protocol on ten fresh seeds (10-19), "
                  "a replication of a result found after the fact"),
    Setting("mnist-w4-params", "image", _MNIST_W4,
            5.0, 10.0, tuple(range(20)), budgets=("macs", "params"), round=3,
            tests="added once mnist-w4 had won with 1.26-1.60x the baseline's parameters: the baseline's "
                  "parameters as a second budget, so that the win cannot come from parameters"),
)


def _quick(settings: tuple[Setting, ...]) -> tuple[Setting, ...]:
    """The smoke run's settings: the first image and text settings, one seed, half an epoch,
    and 20k training / 10k test characters."""
    image = next(s for s in settings if s.kind == "image")
    text = next(s for s in settings if s.kind == "text")
    small = {**text.model, "train_limit": 20_000, "test_limit": 10_000}
    return (dataclasses.replace(image, seeds=(0,), search_epochs=0.5, retrain_epochs=0.5),
            dataclasses.replace(text, model=small, seeds=(0,), search_epochs=0.5, retrain_epochs=0.5))


def model_id(s: Setting) -> str:
    """The baseline model and its data, as a cache-key part (settings that share it share runs).

        >>> model_id(SETTINGS[0])
        'digits/resnet/width=8'
        >>> model_id(next(s for s in SETTINGS if s.kind == "text"))
        'shakespeare/charcnn/blocks=4,hidden=64,width=32/test_limit=100000,train_limit=500000'
    """
    m = s.model
    args = ",".join(f"{k}={v}" for k, v in sorted((m.get("model_args") or {}).items()))
    data = ",".join(f"{k}={m[k]}" for k in sorted(m) if k not in ("task", "model", "model_args") and m[k] is not None)
    return "/".join(p for p in (m["task"], m["model"], args, data) if p)


def _budget_id(s: Setting) -> str:
    return "+".join(s.budgets) + (f"/min{s.min_width}" if s.min_width > 1 else "")


def baseline_key(s: Setting, seed: int) -> str:
    """Cache key of the baseline's run: model, retrain length and seed.

        >>> baseline_key(SETTINGS[2], 3)
        'baseline/digits/resnet/width=4/R40.0/s3'
    """
    return f"baseline/{model_id(s)}/R{s.retrain_epochs}/s{seed}"


def search_key(s: Setting, seed: int) -> str:
    """Cache key of one DMS_np search from ``--expand``: model, search length, budgets, seed.

        >>> search_key(SETTINGS[4], 0), search_key(SETTINGS[5], 0)
        ('search/digits/resnet/width=4/S10.0/macs+params/s0', 'search/digits/resnet/width=4/S10.0/macs/min3/s0')
    """
    return f"search/{model_id(s)}/S{s.search_epochs}/{_budget_id(s)}/s{seed}"


def dms_key(s: Setting, seed: int) -> str:
    """Cache key of a search's structure trained from scratch (the search's key and the
    retrain length).

        >>> dms_key(SETTINGS[1], 7)
        'dms_expand/digits/resnet/width=4/S10.0/macs/R20.0/s7'
    """
    return f"dms_expand/{model_id(s)}/S{s.search_epochs}/{_budget_id(s)}/R{s.retrain_epochs}/s{seed}"


def narrow_dims(structure: dict[str, Any], at_most: int = NARROW) -> int:
    """How many width dims of the export keep ``at_most`` channels or fewer (dims whose every
    producer sits in a removed block do not exist in the export and are not counted).

        >>> narrow_dims({"width": [{"size": 6, "kept": 2, "producers": ["b.0.c"]},
        ...                        {"size": 6, "kept": 1, "producers": ["b.1.c"]},
        ...                        {"size": 6, "kept": 5, "producers": ["b.2.c"]}],
        ...              "depth": [], "removed_blocks": [{"name": "b.1"}]})
        1
    """
    fractions = nl.effective_kept(structure)
    return sum(1 for w, f in zip(structure.get("width", []), fractions) if f > 0 and w["kept"] <= at_most)


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
    command = command_line("bench/scaling_claim.py", argv)
    if not args.table_only:
        for s in settings:
            seeds = [x for x in s.seeds if args.seeds is None or x in args.seeds]
            run_setting(s, seeds, args.threads)
            with locked(CACHE):
                cache = load_cache(CACHE, {"runs": {}})
                record_invocation(cache.setdefault("invocations", {}), s.name, command, git_commit(ROOT), seeds)
                cache["env"] = environment(args.threads)
                save_cache(CACHE, cache)
    import scaling_claim_table

    print(f"wrote {scaling_claim_table.write_table(load_cache(CACHE, {'runs': {}}), settings if args.quick else SETTINGS, RESULTS / 'scaling_claim.md')}")


if __name__ == "__main__":
    main()
