"""Host time of a DMS training step, measured without a GPU (issue 29).

    PYTHONPATH=src:tests python -m bench.host_time [--models resnet50 vit_b16 llama_135m] [--rounds 30]
        [--compiled]     # also both under torch.compile(model)
        [--per-layer-folds]   # also DMS with the eager fold batch off (each layer folds alone)

On a GPU a step of small kernels is bound by the host: Python, the dispatcher and the launch of
every operator, not the device (the Llama of `bench/results/gpu_profile.md` spent 78 ms of kernel
time in a 185 ms DMS step). The operator counts of ``search_proxies.py`` count operators but do
not weigh them: a Python hook, an autograd function's Python forward and backward, a compiled
function's guards and wrappers all cost host time without launching anything. Here each model
keeps the real model's layers, so its step runs the same operators, hooks and autograd nodes,
but with tiny widths and inputs, so the compute is negligible and the wall time of a step on one
CPU thread is its host time (under bf16 autocast, as on a GPU): plain, DMS with eager masked
norms, DMS with the masked norms compiled (``SearchConfig(fuse_norms=True)``, the default on a
GPU; inductor's CPU kernels and wrappers stand in for Triton's); with ``--compiled`` also the
plain model and the model with DMS under ``torch.compile(model)`` (the forward and backward of
the layers, hooks included, compiled; the gates' masks, the resource loss and the optimisers
eager: what a GPU user who compiles the model runs). Rounds interleave the arms; median and
interquartile range of the per-step times. The step is ``search_proxies``'s (forward, task loss,
``resource_loss(0.5)``, backward, SGD, Adam, both ``foreach``).

A CPU operator costs less host time than a CUDA one (no launch), so the ratios understate what
the operators add on a GPU and overstate what Python adds; they rank changes, they do not
predict GPU times. Results: ``bench/results/host_time.{json,md}``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
from bench.lib.benchlib import child_json, git_commit, load_cache, save_cache, snapshot_commit  # noqa: E402
from bench.lib.proxy_models import ProxyModel, _ce, _images, _llama, _lm, _prepare, _step_fn, _tokens  # noqa: E402

RESULTS = ROOT / "bench" / "results"

__all__ = ["TINY_MODELS", "guard_ms", "measure", "render", "main"]


def _timm_tiny(name: str, **kw: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import dmscale as dms
        dms.ensure_torchvision()
        import timm
        torch.manual_seed(0)
        return timm.create_model(name, pretrained=False, num_classes=10, **kw)
    return build


# the layers of the proxy models of search_proxies.py, tiny widths and inputs; the transformers'
# token rows (batch x tokens) outnumber every projection's input features, so each weight fold
# takes the path it takes at the real batch (a fold multiplies the smaller of a layer's weight
# and its input or output, call by call: core.weight_masks): ViT-B 3 x 37 rows over fc2's 96
# inputs (fewer images of more tokens: timm's CPU attention loops over images x heads), the Llama
# 4 x 16 over down_proj's 48
TINY_MODELS: dict[str, ProxyModel] = {m.name: m for m in [
    ProxyModel("resnet50", _timm_tiny("resnet50", channels=(8, 16, 32, 64), stem_width=8), _images(32), _ce, 2,
               shape="ResNet-50's layers (timm), widths / 8, 32 px, batch 2"),
    ProxyModel("vit_b16", _timm_tiny("vit_base_patch16_224", img_size=96, embed_dim=24), _images(96), _ce, 3,
               shape="ViT-B/16's layers (12 blocks, 12 heads), width 24, 96 px, batch 3"),
    ProxyModel("llama_135m", _llama(30, 18, 48, 9, 3, 256), _tokens(16, 256), _lm, 4, target=0.8,
               shape="SmolLM2-135M's layers (30, GQA 9/3), width 18, 16 tokens, batch 4"),
]}

ARMS = ("plain", "dms", "dms_fused")
COMPILED_ARMS = ("plain_compiled", "dms_compiled")


def _bf16(step: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):  # as on a GPU: the casts autocast adds
            step()
    return run


def _folding_alone(step: Callable[[], None]) -> Callable[[], None]:
    """``step`` with the eager fold batch off (``dmscale.core.fold_batch.ENABLED``) while it runs."""
    from dmscale.core import fold_batch

    def run() -> None:
        before, fold_batch.ENABLED = fold_batch.ENABLED, False
        try:
            step()
        finally:
            fold_batch.ENABLED = before
    return run


def _arms(spec: ProxyModel, compiled: bool = False, per_layer: bool = False) -> dict[str, Callable[[], None]]:
    """The steps of the arms; code without ``SearchConfig(fuse_norms)`` (a snapshot from before
    it) has no fused arm; ``compiled``: also :data:`COMPILED_ARMS`, the model under
    ``torch.compile(model)`` (inductor); ``per_layer``: also ``dms_per_layer``, the eager DMS arm
    with the fold batch off."""
    import dataclasses

    import dmscale as dms
    fusable = "fuse_norms" in {f.name for f in dataclasses.fields(dms.SearchConfig)}
    base = spec.build().train()
    x = spec.inputs(spec.batch)
    steps = {"plain": _bf16(_step_fn(spec, copy.deepcopy(base), x, None))}
    for arm, fuse, alone in (("dms", False, False), ("dms_fused", True, False), ("dms_per_layer", False, True)):
        if (fuse and not fusable) or (alone and not per_layer):
            continue
        model = copy.deepcopy(base)
        searcher = _prepare(spec, model, x, fuse)
        if fusable and not fuse:
            searcher.gates.fuse_norms = False  # eager even where auto would fuse
        step = _bf16(_step_fn(spec, model, x, searcher))
        steps[arm] = _folding_alone(step) if alone else step
    if compiled:
        steps["plain_compiled"] = _bf16(_step_fn(spec, torch.compile(copy.deepcopy(base)), x, None))
        model = copy.deepcopy(base)
        searcher = _prepare(spec, model, x, False)  # (the norms are compiled with the model)
        steps["dms_compiled"] = _bf16(_step_fn(spec, torch.compile(model), x, searcher))
    return steps


def guard_ms(step: Callable[[], None], steps: int = 5) -> float:
    """Milliseconds per step that torch.compile's guards take to pick the compiled code (the
    profiler's ``TorchDynamo Cache Lookup`` events: every call of a compiled model or a fused norm
    checks the Python values its graph was traced with, hooks and their attributes included);
    0 for a step with nothing compiled. Measured apart from the timed rounds (the profiler slows
    the step down)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    return sum(e.cpu_time_total for e in prof.events() if e.name == "TorchDynamo Cache Lookup") / steps / 1e3


def measure(name: str, rounds: int = 30, per_round: int = 3, compiled: bool = False,
            per_layer: bool = False) -> dict[str, Any]:
    """Per-step wall times (ms) of the arms on one thread: median and quartiles."""
    torch.set_num_threads(1)
    spec = TINY_MODELS[name]
    steps = _arms(spec, compiled, per_layer)
    for step in steps.values():
        for _ in range(5):  # optimiser state, importance; the fused and compiled arms compile here
            step()
    times: dict[str, list[float]] = {arm: [] for arm in steps}
    for _ in range(rounds):
        for arm, step in steps.items():
            for _ in range(per_round):
                t0 = time.perf_counter()
                step()
                times[arm].append((time.perf_counter() - t0) * 1e3)
    out: dict[str, Any] = {"model": name, "shape": spec.shape, "rounds": rounds, "per_round": per_round}
    for arm, ts in times.items():
        q = statistics.quantiles(ts, n=4)
        out[arm] = {"median": statistics.median(ts), "q1": q[0], "q3": q[2], "guards_ms": guard_ms(steps[arm])}
    for arm in ("dms", "dms_fused", "dms_per_layer"):
        if arm in out:
            out[f"{arm}_ratio"] = out[arm]["median"] / out["plain"]["median"]
    if compiled:  # over the compiled plain step
        out["dms_compiled_ratio"] = out["dms_compiled"]["median"] / out["plain_compiled"]["median"]
    return out


def _cell(r: dict[str, Any], arm: str) -> str:
    a = r.get(arm)
    return f"{a['median']:.1f} ({a['q1']:.1f}-{a['q3']:.1f})" if a else "-"


def _guards(r: dict[str, Any]) -> str:
    cells = [r.get(arm, {}).get("guards_ms") for arm in ("dms_fused", "plain_compiled", "dms_compiled")]
    return "-" if all(c is None for c in cells) else " / ".join("-" if c is None else f"{c:.2f}" for c in cells)


def _ratio(r: dict[str, Any], arm: str) -> str:
    return f"{r[arm + '_ratio']:.2f}" if arm + "_ratio" in r else "-"


def render(cache: dict[str, Any]) -> str:
    lines = [
        "# Host time of a DMS step, measured without a GPU (issue 29)", "",
        "Written by `bench/host_time.py` (see its docstring for the method): wall time per training step of "
        "models with the real model's layers but tiny widths and inputs, on one CPU thread, bf16 autocast, so "
        "the step's time is its host time (Python, dispatcher, autograd), what bounds a GPU step of small kernels. "
        "Median (interquartile range) over the interleaved rounds; DMS = eager masked norms, fused = "
        "`SearchConfig(fuse_norms=True)` (the default on a GPU). A CPU operator is cheaper on the host than "
        "a CUDA one (no launch): the ratios rank changes, they do not predict GPU times. Compiled: "
        "`torch.compile(model)`, plain and with DMS (the layers, hooks included, in inductor's graphs; the "
        "gates' masks, resource loss and optimisers eager), their ratio over the compiled plain step. Guards: "
        "milliseconds per step in torch.compile's guard checks (the profiler's `TorchDynamo Cache Lookup`, "
        "5 steps profiled apart from the timed ones): the fused norms' calls, the compiled plain model's, the "
        "compiled model with DMS (its hooks and their attributes are guarded too). Per-layer folds "
        "(`--per-layer-folds`): the DMS arm with the eager fold batch off (`dmscale.core.fold_batch.ENABLED = "
        "False`, every layer folding its masks on its own), timed in the same rounds.", "",
        f"- command: `{cache.get('command', '')}`",
        f"- commit: {cache.get('commit', '')}; machine: {cache.get('machine', '')}", "",
        "| model | layers and input | code | plain ms | DMS ms | DMS / plain | DMS fused norms ms | fused / plain "
        "| plain compiled ms | DMS compiled ms | compiled DMS / compiled plain | guards ms fused / compiled plain "
        "/ compiled DMS | DMS per-layer folds ms | per-layer / plain | steps |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    order = {name: i for i, name in enumerate(TINY_MODELS)}
    for key in sorted(cache["rows"], key=lambda k: (order.get(k.split("@")[0], 99), "@before" not in k)):
        r = cache["rows"][key]
        lines.append(f"| {r['model']} | {r['shape']} | {r.get('code', 'now')} | {_cell(r, 'plain')} "
                     f"| {_cell(r, 'dms')} "
                     f"| {_ratio(r, 'dms')} | {_cell(r, 'dms_fused')} | {_ratio(r, 'dms_fused')} "
                     f"| {_cell(r, 'plain_compiled')} | {_cell(r, 'dms_compiled')} | {_ratio(r, 'dms_compiled')} "
                     f"| {_guards(r)} | {_cell(r, 'dms_per_layer')} | {_ratio(r, 'dms_per_layer')} "
                     f"| {r['rounds'] * r['per_round']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", choices=list(TINY_MODELS), default=list(TINY_MODELS))
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--out", type=Path, default=RESULTS, help="folder of host_time.{json,md}")
    ap.add_argument("--baseline-src", type=Path, default=None,
                    help="also the package snapshot in this src folder (python -m bench.gpu_check --make-baseline "
                         "COMMIT makes one): rows 'before'")
    ap.add_argument("--compiled", action="store_true",
                    help="also the plain and the DMS step under torch.compile(model) (the new code only; minutes)")
    ap.add_argument("--per-layer-folds", action="store_true",
                    help="also the eager DMS step with the fold batch off (the new code only)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-compiled", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-per-layer", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child, args.rounds, compiled=args.child_compiled,
                                 per_layer=args.child_per_layer)))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "host_time.json"
    cache = load_cache(path, {"rows": {}})
    cache["command"] = "PYTHONPATH=src:tests python -m bench.host_time " + " ".join(
        argv if argv is not None else sys.argv[1:])
    cache["commit"] = git_commit(ROOT)
    cache["machine"] = f"{platform.platform()}, {os.cpu_count()} CPUs, torch {torch.__version__}, one thread"
    impls = [(f"now ({cache['commit']})", "", ROOT / "src")]
    if args.baseline_src is not None:
        impls.insert(0, (f"before ({snapshot_commit(args.baseline_src)})", "@before", args.baseline_src.resolve()))
    for name in args.models:
        for code, suffix, src in impls:  # one process per row: no compiled code or allocator state shared
            flags = (["--child-compiled"] if args.compiled and not suffix else []) + (
                ["--child-per-layer"] if args.per_layer_folds and not suffix else [])
            row = child_json("bench.host_time", ["--child", name, "--rounds", str(args.rounds), *flags], [src, ROOT / "tests"])
            row["code"] = code
            cache["rows"][name + suffix] = row
            save_cache(path, cache, sort_keys=False)
            (args.out / "host_time.md").write_text(render(cache))
            print(f"{name} {code}: DMS {row['dms_ratio']:.2f}x the plain step's host time", flush=True)


if __name__ == "__main__":
    main()
