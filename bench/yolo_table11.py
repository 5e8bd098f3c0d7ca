"""Table 11 analog (paper: YOLOv8 searched with DMS_np) on the generated MNIST detection set.

Arms, each trained from random initialisation with the same epochs, batch size, optimiser,
learning-rate schedule, augmentation and image size, over several seeds, compared on box
mAP50-95 of the val split next to their MACs / YOLOv8n's MACs:

* ``dms_np``: the supernet YOLOv8n with ``--expand width=W,depth=D`` (paper: deepen and
  widen 0.5, i.e. 1.5x) searched with DMS_np down to YOLOv8n's MACs for ``--search-epochs``,
  then the found structure retrained from scratch for ``--epochs`` (the search is extra
  cost, as in the paper; the retraining budget equals the baselines');
* ``yolov8n``: YOLOv8n trained for ``--epochs``;
* ``dms_np_hold``: ``dms_np`` at the library's default since it ran (the settle phase with its
  hold, ``--settle 0.4 --settle-hold``; the ``dms_np`` rows ran with ``--settle 0``);
* ``p3``: the hand-made design DMS_np's searches point to here: YOLOv8n with one detection
  level, stride 8 (``bench/yolov8n_p3.yaml``: no bottom-up neck path, Detect on P3), at
  YOLOv8n's depth with the one width multiple whose MACs are nearest YOLOv8n's (by
  ``--uniform-rule``, as ``uniform``);
* ``uniform``: the supernet's depth with one width multiple for every layer, the one whose
  MACs are nearest YOLOv8n's (``--uniform-rule nearest``, either side) or the largest at or
  under them (``below``). Ultralytics rounds every width up to a multiple of 8, so uniform
  width scaling only reaches a few MACs values (at 64 px: 35.2 M or 40.6 M around YOLOv8n's
  40.5 M). Mixing a depth multiple in does not help here: between YOLOv8n's depth and 1.5x it
  yields only YOLOv8n's block counts (then the width is YOLOv8n's: the ``yolov8n`` arm) or
  the supernet's.

Every run is cached as one json file under ``bench/results/yolo_table11_runs/TAG/`` (TAG: a
hash of the settings), so the table builds incrementally: run arms and seeds in separate
invocations (or processes), and ``--table-only`` rebuilds ``bench/results/yolo_table11.md``
and ``.json`` (the plot's input) from the cache. A ``## Reading`` section already in the md
is kept. The table's configuration (3-4 CPU-minutes a run on one thread; one process per
seed), then the table from the cache::

    python -m bench.yolo_table11 --train 256 --val 64 --epochs 20 --search-epochs 10 \
        --batch-size 8 --augment fliplr=0,mosaic=0 --seeds 0
    python -m bench.yolo_table11 --train 256 --val 64 --epochs 20 --search-epochs 10 \
        --batch-size 8 --augment fliplr=0,mosaic=0 --seeds 0 1 --table-only

A smoke run of every arm (8 training / 4 val images, one step per run, seed 0), whose data,
run directories, cache and table go to ``WORKDIR/quick/`` (``--workdir``, default
``bench/runs/yolo_table11/``; nothing under ``bench/results/``)::

    python -m bench.yolo_table11 --quick [--workdir DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import dmscale as dms
from dmscale.config.run_config import RunConfig
from dmscale.core.values import kv_dict
from dmscale.data import MnistDetectConfig, make_mnist_detect
from dmscale.run.pipeline import Pipeline
from dmscale.tasks.detect import DetectTask
from dmscale.tasks.registry import build_model

__all__ = ["main", "settings_of", "uniform_arm"]

ROOT = Path(__file__).resolve().parents[1]
from bench.lib.benchlib import add_quick_flags, git_commit, kept_reading, paired_diff, quick_mode, save_cache, spread  # noqa: E402

ARMS = ("dms_np", "dms_np_hold", "yolov8n", "uniform", "p3")
RESULTS = ROOT / "bench" / "results"
P3_YAML = ROOT / "bench" / "yolov8n_p3.yaml"  # YOLOv8n with Detect on the stride-8 level only
BASE_YAML = "yolov8n.yaml"


def _macs(info: dict[str, Any], imgsz: int, expand: dict[str, float] | None = None, yaml: str = BASE_YAML) -> int:
    cfg = RunConfig(task="detect", model=f"yolo:{yaml}", expand=expand).resolved()
    model, _ = build_model(cfg, info)
    return int(dms.count(model.eval(), torch.zeros(1, 3, imgsz, imgsz))["macs"])


def uniform_arm(info: dict[str, Any], imgsz: int, depth: float, target: int, rule: str,
                yaml: str = BASE_YAML) -> dict[str, Any]:
    """The uniform width multiple (on ``yaml``'s, YOLOv8n by default, at depth ``depth``) under ``rule``.

    Bisects for the largest factor whose model has at most ``target`` MACs and the smallest
    with more; ``below`` takes the first, ``nearest`` the one nearer ``target``.
    """
    lo, hi = 0.3, 1.5
    for _ in range(12):  # MACs are monotone in the width factor (steps of 8 channels)
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _macs(info, imgsz, {"width": mid, "depth": depth}, yaml) <= target else (lo, mid)
    below = _macs(info, imgsz, {"width": lo, "depth": depth}, yaml)
    above = _macs(info, imgsz, {"width": hi, "depth": depth}, yaml)
    take_hi = rule == "nearest" and above - target < target - below
    width, macs = (hi, above) if take_hi else (lo, below)
    return {"width": width, "depth": depth, "macs": macs, "below": [lo, below], "above": [hi, above]}


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    """Everything that changes a run's result (the cache key), from the parsed flags."""
    return {"data": {"train": args.train, "val": args.val, "imgsz": args.imgsz, "max_digits": args.max_digits,
                     "min_scale": args.min_scale, "max_scale": args.max_scale, "seed": 123},
            "train": {"epochs": args.epochs, "batch_size": args.batch_size, "optimizer": args.optimizer,
                      "lr": args.lr, "weight_decay": args.weight_decay, "warmup": args.warmup,
                      "augment": args.augment},
            "dms": {"expand": args.expand, "search_epochs": args.search_epochs or args.epochs,
                    "structure_lr": args.structure_lr, "resource_weight": args.resource_weight},
            "uniform_rule": args.uniform_rule}


def _tag(settings: dict[str, Any]) -> str:
    return hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]


def _dataset(d: dict[str, Any], root: Path) -> str:
    """The generated dataset of ``d`` (written once, then reused: generation is deterministic)."""
    path = root / _tag(d)
    if not (path / "data.yaml").is_file():
        tmp = Path(tempfile.mkdtemp(prefix="partial_", dir=root))
        make_mnist_detect(tmp, MnistDetectConfig(train=d["train"], val=d["val"], imgsz=d["imgsz"],
                                                 max_digits=d["max_digits"], min_scale=d["min_scale"],
                                                 max_scale=d["max_scale"], seed=d["seed"]))
        # data.yaml holds the absolute path it was written under: point it at the final one
        (tmp / "data.yaml").write_text((tmp / "data.yaml").read_text().replace(str(tmp), str(path)))
        try:
            tmp.rename(path)
        except OSError:  # another process wrote the same files first
            pass
    return str(path / "data.yaml")


def _run(common: dict[str, Any], out: Path, **kw: Any) -> dict[str, Any]:
    t0 = time.time()
    resume = (out / "checkpoint.pt").is_file()  # a run interrupted earlier continues where it stopped
    # settle 0: the cached rows' protocol (before the settle phase); dms_np_hold sets its own
    summary = Pipeline(RunConfig(**{"settle": 0.0, "settle_hold": False, **common, **kw}, out=str(out)),
                       resume=resume).run()
    ev = summary["evals"].get("final") or summary["evals"]["pretrain"]
    row = {"map50_95": ev["map50_95"], "map50": ev["map50"], "precision": ev["precision"], "recall": ev["recall"],
           "macs": summary["counts"]["found"]["macs"], "params": summary["counts"]["found"]["params"],
           "seconds": round(time.time() - t0, 1), "resumed": resume}
    if "search" in summary["evals"]:  # DMS: the searched weights before retraining, and the structure
        row["search_map50_95"] = summary["evals"]["search"]["map50_95"]
        structure = json.loads((out / "structure.json").read_text())
        row["structure"] = structure
    return row


def _arm_kwargs(arm: str, s: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    t, d = s["train"], s["dms"]
    if arm in ("dms_np", "dms_np_hold"):
        settle = dict(settle=0.4, settle_hold=True) if arm == "dms_np_hold" else {}  # the library default
        return dict(command="search", expand=kv_dict(d["expand"]), target=float(meta["base_macs"]),
                    epochs=d["search_epochs"], retrain_epochs=t["epochs"], retrain_init="scratch",
                    structure_lr=d["structure_lr"], resource_weight=d["resource_weight"], **settle)
    if arm == "yolov8n":
        return dict(command="pretrain", epochs=t["epochs"])
    if arm == "p3":
        p3 = meta["p3"]
        return dict(command="pretrain", epochs=t["epochs"], model=f"yolo:{P3_YAML}",
                    expand={"width": p3["width"], "depth": p3["depth"]})
    uniform = meta["uniform"]
    return dict(command="pretrain", epochs=t["epochs"], expand={"width": uniform["width"], "depth": uniform["depth"]})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--train", type=int, default=256, help="training images")
    ap.add_argument("--val", type=int, default=64, help="val images")
    ap.add_argument("--imgsz", type=int, default=64)
    ap.add_argument("--max-digits", type=int, default=3)
    ap.add_argument("--min-scale", type=float, default=0.25, help="a digit's smallest side / imgsz")
    ap.add_argument("--max-scale", type=float, default=0.5, help="a digit's largest side / imgsz")
    ap.add_argument("--epochs", type=float, default=20.0)
    ap.add_argument("--search-epochs", type=float, default=None,
                    help="epochs of the DMS search (default: --epochs); the found model is then "
                         "retrained from scratch for --epochs, like the baselines")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--optimizer", choices=["sgd", "adamw"], default="adamw",
                    help="SGD at dmscale's lr 0.05 collapsed to predicting no objects here")
    ap.add_argument("--lr", type=float, default=0.001)
    ap.add_argument("--weight-decay", type=float, default=None, help="default: dmscale's (AdamW 0.01)")
    ap.add_argument("--warmup", type=float, default=0.02, help="fraction of the steps with linear warm-up")
    ap.add_argument("--augment", default=None, help="Ultralytics augmentation overrides, e.g. fliplr=0,mosaic=0")
    ap.add_argument("--expand", default="width=1.5,depth=1.5")
    ap.add_argument("--structure-lr", type=float, default=0.05,
                    help="DMS structure learning rate (short searches need more than the CLI's 0.01)")
    ap.add_argument("--resource-weight", type=float, default=3.0)
    ap.add_argument("--uniform-rule", choices=["nearest", "below"], default="nearest")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    ap.add_argument("--table-only", action="store_true", help="run nothing; rebuild the table from the cache")
    ap.add_argument("--cache", default=str(RESULTS / "yolo_table11_runs"))
    ap.add_argument("--out", default=str(RESULTS / "yolo_table11"), help="the table's md/json path (no suffix)")
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "dmscale_yolo_table11"),
                    help="generated data and run directories")
    add_quick_flags(ap, "yolo_table11", "smoke run: every arm, seed 0, 8 / 4 images, one step per run, all under "
                    "WORKDIR/quick", "data, runs, cache and table")
    args = ap.parse_args(argv)
    if args.quick:  # a smoke run: nothing of bench/results is read or written
        quick = quick_mode(args, RESULTS, train=8, val=4, epochs=1.0, search_epochs=1.0, batch_size=8, seeds=[0],
                           augment="fliplr=0,mosaic=0")
        args.cache, args.out = str(quick / "yolo_table11_runs"), str(quick / "yolo_table11")
        args.work = str(quick / "work")
    torch.set_num_threads(1)
    s = settings_of(args)
    tag = _tag(s)
    cache = Path(args.cache) / tag
    cache.mkdir(parents=True, exist_ok=True)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    save_cache(cache / "settings.json", s, sort_keys=False, end="\n")
    command = "python -m bench.yolo_table11 " + shlex.join(argv if argv is not None else sys.argv[1:])
    meta_path = cache / "sizes.json"
    data = _dataset(s["data"], work)
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    if "p3" not in meta:  # sizes cached before the p3 arm existed keep their other fields
        info = DetectTask(RunConfig(task="detect", data=data, image_size=args.imgsz).resolved()).info
        expand = kv_dict(args.expand)
        if "base_macs" not in meta:
            base = _macs(info, args.imgsz)
            meta = {"base_macs": base, "supernet_macs": _macs(info, args.imgsz, expand),
                    "uniform": uniform_arm(info, args.imgsz, float(expand["depth"]), base, args.uniform_rule)}
        meta["p3"] = uniform_arm(info, args.imgsz, 1.0, meta["base_macs"], args.uniform_rule, yaml=str(P3_YAML))
        save_cache(meta_path, meta, sort_keys=False, end="\n")
    t = s["train"]
    common = dict(task="detect", data=data, image_size=args.imgsz, batch_size=t["batch_size"], quiet=True,
                  model="yolo:yolov8n.yaml", optimizer=t["optimizer"], lr=t["lr"], weight_decay=t["weight_decay"],
                  warmup=t["warmup"], augment=kv_dict(t["augment"]) if t["augment"] else None, threads=1)
    for seed in ([] if args.table_only else args.seeds):
        for arm in args.arms:
            path = cache / f"{arm}-s{seed}.json"
            if path.is_file():
                continue
            row = _run(common, work / tag / f"{arm}-s{seed}", seed=seed,
                       **_arm_kwargs(arm, s, meta))
            row.update(arm=arm, seed=seed, command=command, commit=git_commit(ROOT), date=time.strftime("%Y-%m-%d %H:%M"))
            save_cache(path, row, sort_keys=False, end="\n")
            print(json.dumps({k: v for k, v in row.items() if k != "structure"}), file=sys.stderr, flush=True)
    write_table(cache, args.seeds, Path(args.out), s, meta, command)
    return 0


def write_table(cache: Path, seeds: list[int], out: Path, s: dict[str, Any], meta: dict[str, Any],
                command: str) -> None:
    """``out``.json (rows per arm, the plot's input) and ``out``.md from the cached runs of ``seeds``."""
    rows: dict[str, list[dict[str, Any]]] = {}
    for arm in ARMS:
        runs = [json.loads(p.read_text()) for seed in seeds if (p := cache / f"{arm}-s{seed}.json").is_file()]
        if runs:
            rows[arm] = runs
    result = {"settings": s, "tag": cache.name, **meta, "rows": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    save_cache(out.with_suffix(".json"), result, sort_keys=False, end="\n")
    md = out.with_suffix(".md")
    md.write_text(_markdown(result, command, cache) + kept_reading(md, "\n## Reading"))
    print(md.read_text())


def _shown(path: Path) -> str:
    """``path`` relative to the checkout when it is inside it (the committed cache), else as given."""
    try:
        return Path(path).resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


def _paired(rows: dict[str, list[dict[str, Any]]], arm: str) -> list[float]:
    """Per-seed mAP50-95 difference ``arm - yolov8n`` (points), over the seeds both have."""
    return paired_diff(rows.get(arm, []), rows.get("yolov8n", []), "map50_95")


def _markdown(r: dict[str, Any], command: str, cache: Path) -> str:
    s, rows, base = r["settings"], r["rows"], r["base_macs"]
    d, t, dm = s["data"], s["train"], s["dms"]
    uni = r["uniform"]
    names = {"dms_np": f"DMS_np ({dm['expand']} supernet, searched to YOLOv8n's MACs, retrained)",
             "yolov8n": "YOLOv8n",
             "uniform": f"uniform width x{uni['width']:.4f} at depth x{uni['depth']:g}",
             "dms_np_hold": "DMS_np as `dms_np`, at the library default (settle phase + hold)",
             "p3": (f"YOLOv8n with Detect on P3 only (`bench/yolov8n_p3.yaml`), width x{r['p3']['width']:.4f}"
                    if "p3" in r else "YOLOv8n with Detect on P3 only")}
    commands = sorted({x["command"] for rs in rows.values() for x in rs})
    commits = sorted({x["commit"] for rs in rows.values() for x in rs})
    lines = [
        "# Table 11 analog: YOLOv8n vs DMS_np on generated MNIST detection data",
        "",
        "- runs: " + "; ".join(f"`{c}`" for c in commands),
        f"- table: `{command}`" if "--table-only" in command else "- table written by the last of these",
        f"- cache: `{_shown(cache)}/` (one json per arm and seed)",
        f"- commit(s): {', '.join(commits) or '-'}; machine: {platform.machine()}, {os.cpu_count()} CPU cores "
        f"(shared), 1 torch thread, torch {torch.__version__}, Python {platform.python_version()}",
        f"- data: {d['train']} training / {d['val']} val images of {d['imgsz']} px, 1-{d['max_digits']} MNIST "
        f"digits each, side {d['min_scale']}-{d['max_scale']} x imgsz (`make_mnist_detect`, seed {d['seed']})",
        f"- training (every arm, from random initialisation): {t['epochs']:g} epochs, batch {t['batch_size']}, "
        f"{t['optimizer']} lr {t['lr']} (weight decay {t['weight_decay'] if t['weight_decay'] is not None else 'default'}), "
        f"warm-up {t['warmup']:g} of the steps then cosine, augmentation: Ultralytics' defaults"
        + (f" with {t['augment']}" if t["augment"] else ""),
        f"- DMS_np: search of {dm['search_epochs']:g} epochs (structure lr {dm['structure_lr']}, resource weight "
        f"{dm['resource_weight']}) from the {dm['expand']} supernet ({r['supernet_macs'] / 1e6:.2f} M MACs), then "
        f"the found structure retrained from scratch for {t['epochs']:g} epochs",
        f"- uniform ({s['uniform_rule']}): width x{uni['width']:.4f} -> {uni['macs'] / 1e6:.2f} M MACs; the uniform "
        f"widths around the target give {uni['below'][1] / 1e6:.2f} M (x{uni['below'][0]:.4f}) and "
        f"{uni['above'][1] / 1e6:.2f} M (x{uni['above'][0]:.4f})",
        "",
        f"| model | MACs at {d['imgsz']} px | MACs / YOLOv8n | params | box mAP50-95 (%) | mAP50 (%) | "
        "mAP50-95 - YOLOv8n (paired, pt) | seeds | min/run |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for arm, rs in rows.items():
        macs = statistics.mean(x["macs"] for x in rs)
        diff = _paired(rows, arm) if arm != "yolov8n" else []
        lines.append(
            f"| {names[arm]} | {macs / 1e6:.2f} M | {macs / base:.3f} | {statistics.mean(x['params'] for x in rs) / 1e6:.3f} M "
            f"| {spread([100 * x['map50_95'] for x in rs], 2)} | {spread([100 * x['map50'] for x in rs], 2)} "
            f"| {spread(diff, 2) if diff else '-'} | {len(rs)} | {statistics.mean(x['seconds'] for x in rs) / 60:.1f} |")
    for arm in ("dms_np", "dms_np_hold"):
        if arm not in rows:
            continue
        lines += ["", f"`{arm}` per seed: exported MACs / YOLOv8n's, mAP50-95 of the searched weights (before "
                  "retraining) and after retraining:", ""]
        for x in rows[arm]:
            lines.append(f"- seed {x['seed']}: {x['macs'] / base:.3f}, {100 * x.get('search_map50_95', float('nan')):.2f} "
                         f"-> {100 * x['map50_95']:.2f}")
    best = max((x["map50_95"] for rs in rows.values() for x in rs), default=0.0)
    if best < 0.02:
        lines += ["", f"**No conclusion**: every arm is below 2 mAP50-95 (best {100 * best:.2f}): the "
                      "detectors have barely started to learn, so the differences are noise."]
    lines += ["", "mean ± std [min, max] over seeds; the paired difference is per seed, against the YOLOv8n "
              "run of the same seed.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
