"""Where a DMS training step spends its time on a GPU: the top operators of one profiled step.

    PYTHONPATH=src:tests python -m bench.gpu_profile [--models llama_135m vit_b16 resnet50] [--out DIR]

For each model of ``bench/lib/gpu_check_lib.py`` (the same inputs, bf16 autocast, SGD + Adam, the
library API as the README shows it), a plain step and a DMS step are profiled once after
three warm-up steps (``torch.profiler``, CPU and CUDA): the step's wall time, the CPU time of
its Python and dispatch, the device time of its kernels, the number of kernels, and the
operators with the most device time and the most calls, DMS and plain side by side, the CUDA
runtime calls with the most host time, and where a step made the host wait for the device
(``torch.cuda.set_sync_debug_mode``, one more step: file and line of each wait). Written
to ``DIR/gpu_profile.md`` (default ``bench/runs/gpu_profile``; results worth keeping go under
``bench/results/`` by hand, with the device named). ``--quick``: the tiny models on the CPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
from bench.lib import gpu_check_lib as lib  # noqa: E402
from bench.lib.benchlib import RUNS  # noqa: E402

__all__ = ["profile_step", "main"]


def profile_step(step: Any, device: torch.device, top: int = 12) -> dict[str, Any]:
    """One profiled call of ``step``: wall ms, kernels, device ms and the top operators."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    lib._sync(device)
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        step()
        lib._sync(device)
    wall = (time.perf_counter() - t0) * 1e3
    table = prof.key_averages()
    dev = "device_time_total" if device.type == "cuda" else "cpu_time_total"
    ops = [e for e in table if e.key.startswith("aten::")]
    by_time = sorted(ops, key=lambda e: getattr(e, dev, 0.0), reverse=True)[:top]
    by_count = sorted(ops, key=lambda e: e.count, reverse=True)[:top]
    kernels = [e for e in prof.events() if getattr(e, "device_type", None) is not None
               and str(e.device_type).endswith("CUDA")]
    runtime = sorted((e for e in table if e.key.startswith("cuda")), key=lambda e: e.cpu_time_total, reverse=True)
    return {"wall_ms": wall, "kernels": len(kernels),
            "device_ms": sum(e.device_time for e in kernels) / 1e3 if kernels else None,
            "host_ms": sum(e.self_cpu_time_total for e in table) / 1e3,
            "runtime": [(e.key, e.count, e.cpu_time_total / 1e3) for e in runtime[:6]],
            "by_time": [(e.key, e.count, getattr(e, dev, 0.0) / 1e3) for e in by_time],
            "by_count": [(e.key, e.count, getattr(e, dev, 0.0) / 1e3) for e in by_count]}


def synchronisations(step: Any, device: torch.device) -> list[tuple[str, int]]:
    """The places (file:line, count) where one call of ``step`` made the host wait for the
    device (``torch.cuda.set_sync_debug_mode``: ``.item()``, ``.cpu()``, a copy from pageable
    memory, ``nonzero`` ...); empty off CUDA."""
    import collections
    import warnings

    if device.type != "cuda":
        return []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    lib._sync(device)
    where = collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught
                                if "synchroniz" in str(w.message).lower())
    return where.most_common(8)


def _model(name: str, quick: bool, device: torch.device) -> list[str]:
    import dmscale as dms
    spec = lib.SPECS[name]
    torch.manual_seed(0)
    model = spec.build(quick).to(device).train()
    x = spec.make_inputs(quick, spec.train_batch(quick), device)
    lines = [f"## {name}: {spec.describe(quick)}, batch {spec.train_batch(quick)}", ""]
    results = {}
    for label in ("plain", "dms"):
        searcher = None
        if label == "dms":
            searcher = dms.prepare(model, lib._example(x), dms.SearchConfig(resource="macs", target=spec.target))
            model.train()
        opts = lib._optimizers(model, searcher)
        step = lambda: lib._train_step(model, x, spec, device, opts, searcher)  # noqa: E731
        for _ in range(3):
            step()
        results[label] = profile_step(step, device)
        results[label]["syncs"] = synchronisations(step, device)
    p, d = results["plain"], results["dms"]
    lines.append(f"- wall ms per step: plain {p['wall_ms']:.1f}, DMS {d['wall_ms']:.1f} "
                 f"({d['wall_ms'] / p['wall_ms']:.2f}x)")
    if p["device_ms"] is not None:
        lines.append(f"- kernel time ms: plain {p['device_ms']:.1f}, DMS {d['device_ms']:.1f}; "
                     f"kernels: plain {p['kernels']}, DMS {d['kernels']}")
    lines.append(f"- CPU time of the profiled operators and runtime calls (self, ms): plain {p['host_ms']:.1f}, "
                 f"DMS {d['host_ms']:.1f}")
    for label, r in (("plain", p), ("DMS", d)):
        if r["runtime"]:
            lines.append(f"- {label} runtime calls (name, calls, CPU ms): "
                         + "; ".join(f"{k} {n} {ms:.1f}" for k, n, ms in r["runtime"]))
        if device.type == "cuda":
            lines.append(f"- {label} host waits for the device in a step (file:line, calls): "
                         + ("; ".join(f"{w} {n}" for w, n in r["syncs"]) or "none"))
    lines.append("")
    for key, title in (("by_time", "most device time" if p["device_ms"] is not None else "most CPU time"),
                       ("by_count", "most calls")):
        lines += [f"{title} (operator, calls, ms): plain | DMS", "", "| plain | DMS |", "|---|---|"]
        for a, b in zip(p[key], d[key]):
            lines.append(f"| {a[0]} {a[1]} {a[2]:.2f} | {b[0]} {b[1]} {b[2]:.2f} |")
        lines.append("")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["llama_135m", "vit_b16", "resnet50"],
                    choices=[n for n, s in lib.SPECS.items() if s.loss is not None])
    ap.add_argument("--out", type=Path, default=RUNS / "gpu_profile")
    ap.add_argument("--quick", action="store_true", help="the tiny models on the CPU (a smoke run)")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    lines = ["# One DMS step profiled", "", f"- device: {name}; torch {torch.__version__}", ""]
    args.out.mkdir(parents=True, exist_ok=True)
    for model in args.models:
        try:
            lines += _model(model, args.quick, device)
        except Exception as e:  # noqa: BLE001 - one model failing keeps the others
            lines += [f"## {model}: error {type(e).__name__}: {e}", ""]
        (args.out / "gpu_profile.md").write_text("\n".join(lines) + "\n")
        print(f"{model}: done", flush=True)
    print(f"wrote {args.out / 'gpu_profile.md'}")


if __name__ == "__main__":
    main()
