"""Image-folder loader throughput vs the training step it feeds (``--task imagefolder``).

    PYTHONPATH=src:tests python -m bench.loader_throughput [--quick] [--images 256] [--size 224]
        [--model timm:resnet50] [--batch 32] [--workers 0 W ...] [--threads T] [--rounds 3] [--steps 2]

A JPEG image folder of ``--images`` training images (``--size`` px, 2 classes; generated once
under ``--workdir``) is read by the task's loader exactly as a run reads it: the model's
transforms (timm's training transform for ``timm:`` models: random-resized crop, flip, colour
jitter, normalisation), batches of ``--batch`` from ``(seed 0, step)``.

* loader alone: images/s of ``task.train_batch`` over one epoch per round, the training
  process doing nothing else, for each ``--workers`` count (default: 0, i.e. decoding in the
  training process, and the default worker count); the first batch of each round (worker
  start-up) is timed apart. With 0 workers also at 1 torch thread: the transforms' tensor
  operations (to tensor, normalise) run on torch's intra-op threads in the training process,
  on one thread in a worker;
* training step, batch in memory: images/s of forward + backward + SGD step of ``--model``
  (random weights, 2 classes) on one batch held in memory, ``--threads`` torch threads
  (default: every core this process may use);
* training step fed by the loader: the same steps drawing their batches from the loader
  (default workers), as in a run: where loader and model share the CPU cores.

Writes ``bench/results/loader_throughput.md`` and the measured rows to
``bench/results/loader_throughput.json`` (``--table-only`` rewrites the md from it);
``--quick`` is a smoke run (32 images of 64 px, timm:resnet18 at batch 8, one round and one
step) whose files go to ``WORKDIR/quick/``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
from bench.lib.benchlib import command_line, git_commit, host, mean_std  # noqa: E402
from image_folders import make_image_folder  # noqa: E402

from dmscale.config.run_config import RunConfig  # noqa: E402
from dmscale.data.images import default_workers  # noqa: E402
from dmscale.tasks.registry import build_model, build_task  # noqa: E402

__all__ = ["measure_loader", "measure_steps", "main"]

RESULTS = ROOT / "bench" / "results"


def _task(data: Path, model: str, size: int, workers: int) -> Any:
    cfg = RunConfig(task="imagefolder", data=str(data), model=model, image_size=size, workers=workers).resolved()
    return cfg, build_task(cfg)


def measure_loader(task: Any, batch: int, rounds: int) -> dict[str, list[float]]:
    """Images/s of one epoch per round after its first batch, and the first batch's seconds."""
    spe = task.steps_per_epoch(batch)
    rates, first = [], []
    for r in range(rounds):
        task.close()  # a fresh iterator (and workers) per round
        t0 = time.perf_counter()
        task.train_batch(r * spe, batch, 0)
        t1 = time.perf_counter()
        for step in range(r * spe + 1, (r + 1) * spe):
            task.train_batch(step, batch, 0)
        rates.append((spe - 1) * batch / (time.perf_counter() - t1))
        first.append(t1 - t0)
    task.close()
    return {"rate": rates, "first": first}


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def measure_steps(cfg: RunConfig, task: Any, batch: int, steps: int, fed: bool) -> list[float]:
    """Images/s of each of ``steps`` training steps (after one warm-up step): on one batch held
    in memory, or (``fed``) on the loader's batches."""
    torch.manual_seed(0)
    model, _ = build_model(cfg, task.info)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = task.train_batch(0, batch, 0)
    _step(model, opt, x, y)  # warm-up (and the loader's start-up)
    rates = []
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        if fed:
            x, y = task.train_batch(step, batch, 0)
        _step(model, opt, x, y)
        rates.append(batch / (time.perf_counter() - t0))
    task.close()
    return rates


def _spread(values: list[float], fmt: str | None = None) -> str:
    fmt = fmt or ("{:,.1f}" if statistics.mean(values) >= 10 else "{:.2f}")
    return mean_std(values, fmt) if len(values) > 1 else fmt.format(values[0])


def _n(value: float) -> str:
    return f"{value:,.0f}" if value >= 10 else f"{value:.2f}"


def write_table(rows: list[dict[str, Any]], args: argparse.Namespace, out_dir: Path, argv: list[str] | None,
                load: float, commit: str, default: int, machine: dict[str, Any]) -> Path:
    lines = [
        "# Image-folder loader throughput vs the training step it feeds", "",
        "Written by `bench/loader_throughput.py` (see its docstring for the protocol). Images/s are",
        "mean ± std over rounds (loader: one epoch per round, its first batch timed apart) or over",
        "timed steps (training: after one warm-up step).", "",
        f"- command: `PYTHONPATH=src:tests {command_line('-m bench.loader_throughput', argv)}`",
        f"- commit: `{commit}`; machine: {machine['platform']}, {machine['cpus']} CPUs "
        f"({machine['usable']} usable, shared with other jobs: load average {load:.1f} at the "
        f"start), Python {machine['python']}, torch {machine['torch']}, {args.threads} torch "
        f"thread(s) for the training steps; default loader workers here: {default}",
        f"- data: {args.images} JPEGs generated at {args.size} x {args.size} px (quality 90, 2 classes), "
        f"read with the transforms of --model {args.model} at {args.size} px (`{rows[0]['transforms']}`); "
        f"batches of {args.batch} from (seed 0, step); {args.rounds} round(s), {args.steps} timed step(s)", "",
        "| what | loader workers | images/s | first batch (s) | load average (1 min) at its start |",
        "|---|---:|---:|---:|---:|"]
    for r in rows:
        first = _spread(r["first"], "{:.2f}") if r.get("first") else "-"
        lines.append(f"| {r['what']} | {r['workers']} | {_spread(r['rate'])} | {first} | {r['load']:.1f} |")
    loaders = {r["workers"]: statistics.mean(r["rate"]) for r in rows if r["kind"] == "loader"}
    step = statistics.mean(next(r["rate"] for r in rows if r["kind"] == "step"))
    fed = statistics.mean(next(r["rate"] for r in rows if r["kind"] == "fed"))
    best_w = max((w for w in loaders if w > 0), default=0)
    per_worker = loaders[best_w] / best_w if best_w else loaders[0]
    one_thread = next((statistics.mean(r["rate"]) for r in rows if r["kind"] == "loader1"), None)
    lines += ["", "## Reading", "",
              f"- The loader alone delivers {_n(loaders[best_w])} images/s with {best_w} worker(s) "
              f"({_n(per_worker)} per worker); {args.model} consumes {_n(step)} images/s in training steps "
              f"on this CPU, so the loader is {loaders[best_w] / step:,.0f}x faster than the model needs: "
              + ("data loading is not the bottleneck here." if loaders[best_w] > step else
                 "data loading is the bottleneck here."),
              f"- Fed by the loader, the steps run at {_n(fed)} images/s ({fed / step:.2f}x the in-memory "
              "rate): " + (f"within the noise of {args.steps} timed steps on shared cores, so loading costs the "
                           "steps nothing measurable here: the workers decode the next batches while the model "
                           "computes." if fed >= 0.9 * step
                           else "the workers decode on the cores the model's threads compute on and take "
                                "their share of them (on a machine shared with other jobs part of this is "
                                "noise: compare rows only within this table).")]
    if 0 in loaders:
        lines.append(f"- In the training process (--workers 0) the loader delivers {_n(loaders[0])} images/s "
                     f"with {args.threads} torch thread(s)"
                     + (f" and {_n(one_thread)} with 1: the transforms' small tensor operations run on "
                        "torch's intra-op threads there, which on cores busy with other work wait for each "
                        "other; a worker runs them on one thread. Use workers (the default)."
                        if one_thread is not None and one_thread > 1.5 * loaders[0] else
                        f" and {_n(one_thread)} with 1." if one_thread is not None else "."))
    lines.append(f"- On an accelerator consuming R images/s the loader needs about R / {_n(per_worker)} workers "
                 "at this per-worker rate (decode, random-resized crop and colour jitter of a JPEG of this "
                 "size on one core); the default gives each training process the cores it may use (at most "
                 "16): give --workers where the host has fewer cores than that needs.")
    lines.append(f"- The absolute rates are those of 2 cores shared with other jobs (load average {load:.1f} "
                 "when the run started, each row's in the table); on free cores every rate would be higher, "
                 "and a row measured at a lower load than another is favoured against it.")
    out = out_dir / "loader_throughput.md"
    out.write_text("\n".join(lines) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--model", default="timm:resnet50")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--workers", type=int, nargs="+", default=None,
                    help="loader worker counts to time alone (default: 0 and the default count)")
    ap.add_argument("--default-workers", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="smoke run under WORKDIR/quick (see the docstring)")
    ap.add_argument("--workdir", type=Path, default=ROOT / "bench" / "runs" / "loader_throughput",
                    help="scratch directory: the generated images, and --quick's table in WORKDIR/quick")
    ap.add_argument("--table-only", action="store_true", help="rewrite the md from the json of the last run")
    args = ap.parse_args(argv)
    out_dir = RESULTS
    if args.quick:
        args.images, args.size, args.model, args.batch, args.rounds, args.steps = 32, 64, "timm:resnet18", 8, 1, 1
        out_dir = args.workdir / "quick"
    out_dir.mkdir(parents=True, exist_ok=True)
    cache = out_dir / "loader_throughput.json"
    if args.table_only:
        saved = json.loads(cache.read_text())
        ns = argparse.Namespace(**saved["args"])
        out = write_table(saved["rows"], ns, out_dir, saved["argv"], saved["load"], saved["commit"], saved["default"],
                          saved["host"])
        print(f"wrote {out}")
        return
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    data = args.workdir / f"images_{args.images}_{args.size}"
    if not (data / "done").exists():
        make_image_folder(data, n_train=args.images, n_val=max(2, args.images // 8), size=args.size)
        (data / "done").write_text("")
    default = default_workers() if args.default_workers is None else args.default_workers
    rows: list[dict[str, Any]] = []
    for w in args.workers or sorted({0, default}):
        for threads in ([args.threads, 1] if w == 0 and args.threads > 1 else [args.threads]):
            torch.set_num_threads(threads)
            cfg, task = _task(data, args.model, args.size, w)
            row_load = os.getloadavg()[0]
            got = measure_loader(task, args.batch, args.rounds)
            what = f"loader alone, {threads} torch thread(s)" if w == 0 else "loader alone"
            rows.append({"kind": "loader" if threads == args.threads else "loader1", "what": what, "workers": w,
                         "load": row_load, **got, "transforms": ", ".join(type(t).__name__ for t in task.train_set.transform.transforms)})
            print(rows[-1]["what"], w, _spread(got["rate"]), flush=True)
    torch.set_num_threads(args.threads)
    cfg, task = _task(data, args.model, args.size, default)
    rows.append({"kind": "step", "what": f"training step of {args.model}, batch in memory", "workers": "-",
                 "load": os.getloadavg()[0], "rate": measure_steps(cfg, task, args.batch, args.steps, fed=False)})
    print(rows[-1]["what"], _spread(rows[-1]["rate"]), flush=True)
    rows.append({"kind": "fed", "what": f"training step of {args.model}, fed by the loader", "workers": default,
                 "load": os.getloadavg()[0], "rate": measure_steps(cfg, task, args.batch, args.steps, fed=True)})
    print(rows[-1]["what"], _spread(rows[-1]["rate"]), flush=True)
    commit, argv = git_commit(ROOT), sys.argv[1:] if argv is None else argv
    kept = {k: v for k, v in vars(args).items() if k not in ("workdir", "table_only")}
    machine = host()
    cache.write_text(json.dumps({"args": kept, "argv": argv, "load": load, "commit": commit, "default": default,
                                 "host": machine, "rows": rows}, indent=1) + "\n")
    print(f"wrote {write_table(rows, args, out_dir, argv, load, commit, default, machine)}")


if __name__ == "__main__":
    main()
