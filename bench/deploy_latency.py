"""What pruning buys at deployment: CPU latency of the original and of the pruned export, in
PyTorch and in onnxruntime, at batch 1 and 32, next to the MACs ratio.

    python -m bench.deploy_latency [--threads 1] [--rounds 15] [--models ...]
    python -m bench.deploy_latency --table-only   # rewrite the md from the json
    python -m bench.deploy_latency --quick        # smoke run, under bench/runs/
    python -m bench.deploy_latency --device cuda  # on a GPU: bf16, eager / compile / ORT

Each model is pruned to half its MACs with the budget solver on the supernet at
initialisation (``searcher.meet_target()``: one common pruning ratio for every width and
depth dimension, then single units given back greedily; no training: latency depends on the
shapes, not on the weights; ``importance="index"`` keeps channels by position). The four
variants (PyTorch / onnxruntime x original / pruned) run interleaved round by round on the
same input, and medians with the interquartile range are reported. ONNX files come from
:func:`dmscale.export.deploy.to_onnx` with a dynamic batch dimension; a model that cannot be
exported so is exported once per batch size (``dynamic_batch=False``) and its row says
"fixed". Every file is checked against PyTorch with :func:`dmscale.export.deploy.check_onnx` at the
batch sizes it is timed at. Small image sizes keep the run to a few minutes on 2 cores.

Results are cached per model in ``bench/results/deploy_latency.json`` (each entry with the
command, commit and machine of the run that measured it); a run replaces the entries of the
models it measures and keeps the others. ``bench/results/deploy_latency.md`` is rendered from
the cache, followed by the hand-written ``deploy_latency_reading.md`` when it exists.
``--quick`` is a smoke run (resnet18 unless ``--models`` says otherwise, batches 1 and 2, two
rounds each) whose json and md go to ``WORKDIR/quick/`` (``--workdir``, default
``bench/runs/deploy_latency/``; nothing under bench/results).

``--device cuda`` (or ``--bf16``: the same path on the CPU, a smoke run of it) measures
another table, cached apart in ``deploy_latency_{device}.json`` / ``.md`` (the CPU table above
is left alone): the models at deployment sizes (224 px, YOLO 640 px), with ViT-B/16, ResNet-50
and a SmolLM2-shaped Llama (512 tokens, random init, no KV cache) first, pruned the same way,
then cast to bfloat16 on the device and timed at batch 1 and a serving batch (64) in PyTorch
eager, under ``torch.compile`` (default mode, one compilation per batch size in the warm-up
call; ``--no-compile`` leaves it out) and in onnxruntime with the CUDA execution provider
where it exists (the float32 ONNX file, inputs and outputs through host memory; n/a
otherwise), each forward synchronised. Expect 1-2 minutes per model on a GPU (an estimate),
mostly compilation. On a machine whose bench/results does not come back, name the files:

    python -m bench.deploy_latency --device cuda --cache OUT/deploy_latency_cuda.json \
        --out OUT/deploy_latency_cuda.md [--models resnet18 vit] [--no-compile]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

import dmscale as dms
from dmscale import deploy
from dmscale.export.deploy import with_batch

from bench.lib.benchlib import add_quick_flags, hand_reading, load_cache, quick_mode, save_cache  # noqa: E402
from bench.lib.deploy_models import (DEPLOY_SIZES, LLAMA_SEQ, LLAMA_VOCAB, SERVING_BATCH, VOCAB, Builder,
                                     example, models, prune_half, synced)

__all__ = ["RESULTS", "CACHE", "DEPLOY_SIZES", "Builder", "models", "prune_half", "onnx_files", "measure", "bench_one",
           "render", "DEVICE_VARIANTS", "VOCAB", "example", "bench_one_device", "render_device", "main"]

RESULTS = Path(__file__).resolve().parent / "results"
CACHE = RESULTS / "deploy_latency.json"
VARIANTS = ("torch_orig", "torch_pruned", "ort_orig", "ort_pruned")
DEVICE_VARIANTS = ("eager_orig", "eager_pruned", "compile_orig", "compile_pruned", "ort_orig", "ort_pruned")
def onnx_files(model: nn.Module, x: torch.Tensor, batches: list[int], stem: Path) -> tuple[dict[int, Path], list[str]]:
    """``{batch: ONNX file}`` (one dynamic-batch file, or one file per batch when the model
    cannot be exported with a dynamic batch) and the export warnings; each file is checked
    against PyTorch at its batch sizes."""
    path = stem.with_suffix(".onnx")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        deploy.to_onnx(model, torch.cat([x, x]), path, check=False)
    notes = [str(w.message) for w in caught if "dynamic batch" in str(w.message)]
    if deploy.batch_is_dynamic(path):
        files = {b: path for b in batches}
    else:
        files = {b: deploy.to_onnx(model, with_batch(x, b), stem.with_name(f"{stem.name}_b{b}.onnx"), check=False,
                                   dynamic_batch=False) for b in batches}
    for b, f in files.items():
        deploy.check_onnx(f, model, torch.randn(b, *x.shape[1:]))
    return files, notes


def _timer(fn: Callable[[Any], Any], x: Any) -> Callable[[], float]:
    def run() -> float:
        t0 = time.perf_counter()
        fn(x)
        return time.perf_counter() - t0
    return run


def _quartiles(ts: list[float]) -> list[float]:
    """[q1, median, q3] in milliseconds."""
    q = statistics.quantiles(ts, n=4) if len(ts) >= 2 else [ts[0]] * 3
    return [round(1e3 * v, 2) for v in q]


def measure(fns: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Run every timer once to warm up, then ``rounds`` rounds interleaved; quartiles per timer."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    with torch.no_grad():
        for f in fns.values():
            f()
        for _ in range(rounds):
            for k, f in fns.items():
                times[k].append(f())
    return {k: _quartiles(v) for k, v in times.items()}


def _sessions(files: dict[int, Path], threads: int) -> dict[int, Any]:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    made: dict[Path, Any] = {}
    for f in set(files.values()):
        made[f] = ort.InferenceSession(str(f), opts, providers=["CPUExecutionProvider"])
    return {b: made[f] for b, f in files.items()}


def _ort_fn(session: Any) -> Callable[[np.ndarray], Any]:
    name = session.get_inputs()[0].name
    return lambda inp: session.run(None, {name: inp})


def bench_one(build: Builder, size: int, threads: int, rounds: dict[int, int], tmp: Path) -> dict[str, Any]:
    """One model's cache entry: MACs, ONNX batch mode and the quartiles of the four variants
    per batch size."""
    x1 = torch.randn(1, 3, size, size)
    original, pruned, macs = prune_half(build, x1)
    nets = {"orig": original, "pruned": pruned}
    sessions, dynamic, notes = {}, {}, []
    for tag, m in nets.items():
        files, warned = onnx_files(m, x1, list(rounds), tmp / tag)
        sessions[tag] = _sessions(files, threads)
        dynamic[tag] = len(set(files.values())) == 1 and deploy.batch_is_dynamic(files[1])
        notes += [f"{tag}: {w}" for w in warned]
    entry: dict[str, Any] = {"size": size, "macs": list(macs), "macs_ratio": round(macs[1] / macs[0], 4),
                             "onnx_dynamic_batch": dynamic, "export_warnings": notes, "batches": {}}
    for b, n in rounds.items():
        x = torch.randn(b, 3, size, size)
        fns = {f"torch_{t}": _timer(m, x) for t, m in nets.items()}
        fns.update({f"ort_{t}": _timer(_ort_fn(sessions[t][b]), x.numpy()) for t in nets})
        entry["batches"][str(b)] = {"rounds": n, **measure({k: fns[k] for k in VARIANTS}, n)}
        print(_row(entry, b), flush=True)
    return entry


# ----------------------------------------------------------------------------- markdown
def _fmt(q: list[float]) -> str:
    return f"{q[1]:.1f} ({q[0]:.1f}-{q[2]:.1f})"


def _row(entry: dict[str, Any], batch: int, name: str = "", run: str = "") -> str:
    r = entry["batches"][str(batch)]
    onnx = "dynamic" if all(entry.get("onnx_dynamic_batch", {"": True}).values()) else "fixed"
    return (f"| {name} | {entry['size']} | {batch} | {entry['macs_ratio']:.2f} | {_fmt(r['torch_orig'])} | "
            f"{_fmt(r['torch_pruned'])} | {r['torch_pruned'][1] / r['torch_orig'][1]:.2f} | {_fmt(r['ort_orig'])} | "
            f"{_fmt(r['ort_pruned'])} | {r['ort_pruned'][1] / r['ort_orig'][1]:.2f} | {onnx} | {r['rounds']} | {run} |")


def _run_key(entry: dict[str, Any]) -> str:
    return f"{entry['run']['command']} @ {entry['run']['commit']}"


def _runs(cache: dict[str, Any]) -> dict[str, str]:
    """``{run key: label}``: one label (A, B, ...) per distinct (command, commit), in cache order."""
    labels: dict[str, str] = {}
    for e in cache["models"].values():
        labels.setdefault(_run_key(e), chr(ord("A") + len(labels)))
    return labels


def _run_line(cache: dict[str, Any], key: str, label: str) -> str:
    names = [n for n, e in cache["models"].items() if _run_key(e) == key]
    run = cache["models"][names[0]]["run"]
    return (f"- Run {label}: `{run['command']}`; commit {run['commit']}{'; ' + run['date'] if run.get('date') else ''}"
            f"; {run['machine']}{'; ' + run['note'] if run.get('note') else ''} ({', '.join(names)})")


def render(cache: dict[str, Any]) -> str:
    """The markdown of ``deploy_latency.md`` from the cache (and the hand-written reading)."""
    labels = _runs(cache)
    lines = ["# Deployment latency: original vs pruned export (half the MACs), PyTorch and onnxruntime", "",
             "Rendered from `deploy_latency.json` by `bench/deploy_latency.py` (each model's rows come from "
             "the run named in the last column; a run replaces only the models it measures).", "", "Runs:", ""]
    lines += [_run_line(cache, key, label) for key, label in labels.items()]
    lines += ["", "Milliseconds per forward pass: median (interquartile range) over the rounds column, the four "
              "variants interleaved round by round after one warm-up call each. Pruned: `searcher.meet_target()` "
              "on the model at initialisation (one common pruning ratio for all width and depth dimensions, down "
              "to half the MACs; `importance=\"index\"`; no search training, random weights: latency depends on "
              "shapes only). Small inputs (size column) to keep the run short. ONNX via `dmscale.export.deploy.to_onnx` "
              "(`torch.onnx.export(dynamo=True)`): `dynamic` = one file with a dynamic batch dimension, `fixed` = "
              "the dynamic export failed and one file per batch size was exported; every file is checked "
              "against PyTorch with `dmscale.export.deploy.check_onnx` at the batch sizes it is timed at.", "",
              "| model | size | batch | MACs ratio | torch orig | torch pruned | torch ratio | ort orig | ort pruned "
              "| ort ratio | ONNX batch | rounds | run |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, e in cache["models"].items():
        lines += [_row(e, int(b), name, labels[_run_key(e)]) for b in e["batches"]]
    warned = [f"- {n}: {w}" for n, e in cache["models"].items() for w in e.get("export_warnings", [])]
    if warned:
        lines += ["", "Export warnings (dynamic batch):", "", *warned]
    reading = hand_reading(RESULTS / "deploy_latency_reading.md")
    if reading is not None:
        lines += ["", reading]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- bf16 on a device
def _ort_cuda() -> bool:
    """Whether onnxruntime has the CUDA execution provider."""
    try:
        import onnxruntime as ort
    except ImportError:
        return False
    return "CUDAExecutionProvider" in ort.get_available_providers()


def _ort_cuda_sessions(nets: dict[str, nn.Module], x1: torch.Tensor, batches: list[int], tmp: Path
                       ) -> dict[str, dict[int, Any]]:
    """``{tag: {batch: session}}`` on the CUDA execution provider (float32 ONNX files)."""
    import onnxruntime as ort

    out: dict[str, dict[int, Any]] = {}
    for tag, m in nets.items():
        files, _ = onnx_files(m, x1, batches, tmp / tag)
        made = {f: ort.InferenceSession(str(f), providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
                for f in set(files.values())}
        out[tag] = {b: made[f] for b, f in files.items()}
    return out


def _device_timers(nets: dict[str, nn.Module], compiled: dict[str, Any], sessions: dict[str, dict[int, Any]] | None,
                   b: int, size: int, device: torch.device, vocab: int | None = None) -> dict[str, Callable[[], float]]:
    x = example(b, size, vocab).to(device)
    x = x.to(torch.bfloat16) if x.is_floating_point() else x
    fns = {f"eager_{t}": synced(m, x, device) for t, m in nets.items()}
    fns.update({f"compile_{t}": synced(m, x, device) for t, m in compiled.items()})
    if sessions is not None:
        host = x.float().cpu().numpy()
        fns.update({f"ort_{t}": synced(_ort_fn(s[b]), host, device) for t, s in sessions.items()})
    return {k: fns[k] for k in DEVICE_VARIANTS if k in fns}


def _working(fns: dict[str, Callable[[], float]], errors: list[str], batch: int) -> dict[str, Callable[[], float]]:
    """The timers whose first call (a compilation for the compiled ones) succeeds; the others'
    errors go to ``errors`` and their cells read n/a."""
    out = {}
    for k, f in fns.items():
        try:
            with torch.no_grad():
                f()
            out[k] = f
        except Exception as e:  # noqa: BLE001 - one engine failing must not lose the others
            errors.append(f"{k} at batch {batch}: {type(e).__name__}: {str(e)[:300]}")
    return out


def bench_one_device(build: Builder, size: int, device: torch.device, rounds: dict[int, int], tmp: Path,
                     compile_: bool = True, vocab: int | None = None) -> dict[str, Any]:
    """One model's entry of the device table: pruned on the CPU as in :func:`bench_one` but
    with widths in multiples of 8 on a GPU (``align=8``, what a search on the GPU would use:
    free widths miss the tensor-core tiles), then both models in bfloat16 on ``device``, timed
    per batch size in eager mode, compiled and in onnxruntime's CUDA provider (what is not
    available is left out: n/a in the table). ``vocab``: a language model, fed ``size`` token
    ids per sequence (no ONNX: n/a)."""
    x1 = example(1, size, vocab)
    original, pruned, macs = prune_half(build, x1, align=8 if device.type == "cuda" else None)
    nets = {"orig": original, "pruned": pruned}
    entry: dict[str, Any] = {"size": size, "macs": list(macs), "macs_ratio": round(macs[1] / macs[0], 4),
                             "dtype": "bfloat16", "compiled": compile_, "errors": [], "batches": {},
                             "ort": "n/a (no CUDA execution provider)"}
    sessions = None
    if vocab is not None:
        entry["ort"] = "n/a (token inputs: not exported to ONNX here)"
    elif device.type == "cuda" and _ort_cuda():
        try:
            sessions = _ort_cuda_sessions(nets, x1, list(rounds), tmp)
            entry["ort"] = "CUDAExecutionProvider, float32"
        except Exception as e:  # noqa: BLE001 - the PyTorch columns still run
            entry["ort"] = f"n/a (failed: {type(e).__name__})"
            entry["errors"].append(f"onnxruntime: {type(e).__name__}: {str(e)[:300]}")
    for m in nets.values():
        m.to(device, torch.bfloat16).eval()
    compiled = {t: torch.compile(m) for t, m in nets.items()} if compile_ else {}
    for b, n in rounds.items():
        t0 = time.perf_counter()
        timers = _working(_device_timers(nets, compiled, sessions, b, size, device, vocab), entry["errors"], b)
        times = measure(timers, n)
        entry["batches"][str(b)] = {"rounds": n, "seconds": round(time.perf_counter() - t0, 1), **times}
        print(_device_row(entry, b), flush=True)
    return entry


def _cell(r: dict[str, Any], k: str) -> str:
    return _fmt(r[k]) if k in r else "n/a"


def _ratio_cell(r: dict[str, Any], engine: str) -> str:
    o, p = r.get(f"{engine}_orig"), r.get(f"{engine}_pruned")
    return f"{p[1] / o[1]:.2f}" if o and p and o[1] else "n/a"


def _device_row(entry: dict[str, Any], batch: int, name: str = "", run: str = "") -> str:
    r = entry["batches"][str(batch)]
    cells = [f"{_cell(r, f'{e}_orig')} | {_cell(r, f'{e}_pruned')} | {_ratio_cell(r, e)}"
             for e in ("eager", "compile", "ort")]
    return (f"| {name} | {entry['size']} | {batch} | {entry['macs_ratio']:.2f} | " + " | ".join(cells)
            + f" | {r['rounds']} | {run} |")


def render_device(cache: dict[str, Any], device: str) -> str:
    """The markdown of ``deploy_latency_{device}.md`` from its cache."""
    labels = _runs(cache)
    lines = [f"# Deployment latency on {device}, bfloat16: original vs pruned export (half the MACs)", "",
             f"Rendered from `deploy_latency_{device}.json` by `bench/deploy_latency.py --device {device}` (each "
             "model's rows come from the run named in the last column).", "", "Runs:", ""]
    lines += [_run_line(cache, key, label) for key, label in labels.items()]
    ort = sorted({e.get("ort", "?") for e in cache["models"].values()})
    lines += ["", "Milliseconds per forward pass (device synchronised before and after): median (interquartile "
              "range) over the rounds column, the variants interleaved round by round after one warm-up call each "
              "(the compiled ones compile in it). Pruned as in `deploy_latency.md` (`meet_target()` at "
              "initialisation, `importance=\"index\"`, random weights), then both models cast to bfloat16 on "
              "the device; eager = PyTorch, compile = `torch.compile(model)` (default mode); ort = onnxruntime: "
              f"{'; '.join(ort)} (inputs and outputs through host memory).", "",
              "| model | size | batch | MACs ratio | eager orig | eager pruned | eager ratio | compile orig | compile "
              "pruned | compile ratio | ort orig | ort pruned | ort ratio | rounds | run |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, e in cache["models"].items():
        lines += [_device_row(e, int(b), name, labels[_run_key(e)]) for b in e["batches"]]
    errors = [f"- {n}: {err}" for n, e in cache["models"].items() for err in e.get("errors", [])]
    errors += [f"- {n}: not measured: {err}" for n, err in cache.get("failed", {}).items()]
    if errors:
        lines += ["", "Errors (their cells read n/a):", "", *errors]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- main
def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip() or "?"
    except OSError:
        return "?"


def _machine(threads: int, device: str = "cpu") -> str:
    try:
        import onnxruntime

        ort = f"onnxruntime {onnxruntime.__version__} ({', '.join(onnxruntime.get_available_providers())})"
    except ImportError:
        ort = "no onnxruntime"
    if device == "cuda":
        return (f"{torch.cuda.get_device_name()}, CUDA {torch.version.cuda}, {platform.machine()}, {os.cpu_count()} "
                f"CPU cores, Python {platform.python_version()}, torch {torch.__version__}, {ort}")
    return (f"{platform.machine()}, {os.cpu_count()} CPU cores (shared with other jobs), Python "
            f"{platform.python_version()}, torch {torch.__version__}, {ort}, "
            f"{threads} thread(s) for PyTorch and onnxruntime")


def _save(cache: dict[str, Any], path: Path, out: Path, draw: Callable[[dict[str, Any]], str] = render) -> None:
    save_cache(path, cache, sort_keys=False, end="\n")
    out.write_text(draw(cache))


def main(argv: list[str] | None = None) -> None:
    global RESULTS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=15, help="rounds at batch 1 (batch 32: a third)")
    parser.add_argument("--models", nargs="*", help="substrings of the model names to run")
    parser.add_argument("--table-only", action="store_true", help="only rewrite the md from the json")
    parser.add_argument("--cache", type=Path, default=CACHE)
    parser.add_argument("--out", type=Path, default=RESULTS / "deploy_latency.md")
    add_quick_flags(parser, "deploy_latency", "smoke run: resnet18 (or --models), batches 1 and 2, 2 rounds, "
                    "under WORKDIR/quick", "json and md")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the bf16 table (eager / compile / onnxruntime CUDA) in deploy_latency_cuda.*")
    parser.add_argument("--bf16", action="store_true", help="the bf16 table on --device (implied by cuda)")
    parser.add_argument("--no-compile", action="store_true", help="bf16 table: leave torch.compile out")
    args = parser.parse_args(argv)
    device_path = args.bf16 or args.device == "cuda"
    rounds = {1: args.rounds, (SERVING_BATCH if device_path else 32): max(3, args.rounds // 3)}  # per batch size
    stem = f"deploy_latency_{args.device}" if device_path else "deploy_latency"
    if device_path:
        args.cache = args.cache if args.cache != CACHE else RESULTS / f"{stem}.json"
        args.out = args.out if args.out != RESULTS / "deploy_latency.md" else RESULTS / f"{stem}.md"
    RESULTS = quick_mode(args, RESULTS, models=args.models or ["resnet18"])
    if args.quick:  # a smoke run: its json and md stay under the work directory; batches 1 and 2, 2 rounds
        args.cache, args.out = RESULTS / f"{stem}.json", RESULTS / f"{stem}.md"
        rounds = {1: 2, 2: 2}
    draw: Callable[[dict[str, Any]], str] = (lambda c: render_device(c, args.device)) if device_path else render
    cache = load_cache(args.cache, {"models": {}})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.table_only:
        args.out.write_text(draw(cache))
        print(f"wrote {args.out}")
        return
    if args.device == "cpu":  # on a GPU machine the CPU work (pruning, ONNX export) keeps torch's threads
        torch.set_num_threads(args.threads)
    run = {"command": ("python -m bench.deploy_latency "
                       + " ".join(argv if argv is not None else sys.argv[1:])).strip(),
           "commit": _commit(), "date": datetime.date.today().isoformat(),
           "machine": _machine(args.threads, args.device)}
    with tempfile.TemporaryDirectory() as d:
        for name, (build, size) in models(device_path and not args.quick).items():
            if args.models and not any(s in name for s in args.models):
                continue
            t0 = time.time()
            tmp = Path(d) / name.split()[0]
            if device_path:
                try:
                    entry = bench_one_device(build, size, torch.device(args.device), rounds, tmp, not args.no_compile,
                                             VOCAB.get(name))
                    cache.get("failed", {}).pop(name, None)
                except Exception as e:  # noqa: BLE001 - a one-shot GPU run goes on with the next model
                    cache.setdefault("failed", {})[name] = f"{type(e).__name__}: {str(e)[:500]} ({run['command']})"
                    _save(cache, args.cache, args.out, draw)
                    print(f"{name}: failed: {type(e).__name__}: {e}", flush=True)
                    continue
            else:
                entry = bench_one(build, size, args.threads, rounds, tmp)
            entry["run"] = {**run, "wall_s": round(time.time() - t0)}
            cache["models"][name] = entry
            _save(cache, args.cache, args.out, draw)  # after each model: a stopped run keeps what it measured
    print(f"wrote {args.cache} and {args.out}")


if __name__ == "__main__":
    main()
