"""What an export at half the MACs still moves: MACs, weights and activations, pruned over original.

    python -m bench.deploy_traffic [--models vit_base resnet50 llama yolov8n]
        [--quick --workdir DIR]     # resnet18 at 96 px only, under DIR/quick

``bench/deploy_latency.py --device cuda`` times the exports of the device table on a GPU: at half
the MACs (widths in multiples of 8) they run in 0.69x-0.93x the original's time, not 0.5x. A
GPU forward at a serving batch is bound partly by compute (the matrix multiplications and
convolutions, which scale with the MACs) and partly by memory traffic (norms, activations,
residual additions, attention's softmax, casts: every layer's output written and read again),
which scales with the activations. Pruning a width c to r c scales the MACs of the layers between
two pruned widths by r^2 but their outputs by r: at half the MACs the activations shrink far less.

This script measures, on the CPU and without timing anything, for the exports of the device
table (the same pruning: ``deploy_latency.prune_half``, ``align=8``, importance by position):
the MACs (``dmscale.count``), the parameters, and the activation elements: the number of
elements every leaf module outputs in one forward pass (batch 1), the part of the traffic that
pruning can shrink. Next to them, the GPU latency ratios that ``deploy_latency_cuda.json``
holds (eager and compiled, at the serving batch), where that file has the model.

Results: ``bench/results/deploy_traffic.{json,md}``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
from bench.lib import deploy_models as dl
from bench.lib.benchlib import (add_quick_flags, command_line, environment, git_commit, load_cache, quick_mode,  # noqa: E402
                      save_cache, write_md)

RESULTS = ROOT / "bench" / "results"
CHOICES = {"vit_base": "vit_base_patch16 (timm)", "resnet50": "resnet50 (torchvision)",
           "llama": "llama_smollm2_shape (transformers)", "yolov8n": "yolov8n (ultralytics)",
           "resnet18": "resnet18 (torchvision)"}
SERVING_BATCH = "64"

__all__ = ["activation_elements", "measure", "render", "main"]


def activation_elements(model: nn.Module, x: torch.Tensor) -> int:
    """Elements output by every leaf module (a module without children) in one forward of ``x``
    (tensors; a tuple's tensors each)."""
    total = 0

    def count(module: nn.Module, args: Any, out: Any) -> None:
        nonlocal total
        outs = out if isinstance(out, (tuple, list)) else (out,)
        total += sum(t.numel() for t in outs if isinstance(t, torch.Tensor))
    leaves = [m for m in model.modules() if next(m.children(), None) is None]
    handles = [m.register_forward_hook(count) for m in leaves]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return total


def measure(name: str, build: dl.Builder, size: int) -> dict[str, Any]:
    """MACs, parameters and activation elements of the original and its export at half the MACs."""
    x = dl.example(1, size, dl.VOCAB.get(name))
    original, pruned, (macs_o, macs_p) = dl.prune_half(build, x, align=8)
    params = [sum(p.numel() for p in m.parameters()) for m in (original, pruned)]
    acts = [activation_elements(m, x) for m in (original, pruned)]
    return {"size": size, "macs": [macs_o, macs_p], "params": params, "activations": acts,
            "macs_ratio": macs_p / macs_o, "params_ratio": params[1] / params[0],
            "activations_ratio": acts[1] / acts[0]}


def _latency(gpu: dict[str, Any], name: str, engine: str) -> str:
    """The GPU's pruned/original median at the serving batch, from deploy_latency_cuda.json's
    cache ``gpu``."""
    cell = gpu.get("models", {}).get(name, {}).get("batches", {}).get(SERVING_BATCH, {})
    orig, pruned = cell.get(f"{engine}_orig"), cell.get(f"{engine}_pruned")
    return f"{pruned[1] / orig[1]:.2f}" if orig and pruned else "-"


def render(cache: dict[str, Any]) -> str:
    gpu = load_cache(RESULTS / "deploy_latency_cuda.json")
    lines = [
        "# What an export at half the MACs still moves (issue 29)", "",
        "Written by `bench/deploy_traffic.py` (its docstring gives the method): the exports of the device "
        "table of `bench/results/deploy_latency_cuda.md` (half the MACs, widths in multiples of 8, channels "
        "kept by position), pruned over original, counted on the CPU at batch 1; activation elements = "
        "elements output by every leaf module in one forward. GPU latency: the pruned/original medians at "
        f"batch {SERVING_BATCH} from `deploy_latency_cuda.json` (eager and `torch.compile`), where it has "
        "the model.", "",
        f"- command: `{cache.get('command', '')}`",
        f"- commit: {cache.get('commit', '')}; {cache.get('machine', '')}", "",
        "| model | input | MACs ratio | params ratio | activation elements ratio | GPU latency eager | "
        "GPU latency compiled |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in cache["models"].items():
        what = f"{r['size']} tokens" if name in dl.VOCAB else f"{r['size']} px"
        lines.append(f"| {name} | {what} | {r['macs_ratio']:.3f} | {r['params_ratio']:.3f} "
                     f"| {r['activations_ratio']:.3f} | {_latency(gpu, name, 'eager')} "
                     f"| {_latency(gpu, name, 'compile')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", choices=sorted(CHOICES),
                    default=["vit_base", "resnet50", "llama", "yolov8n"])
    add_quick_flags(ap, "deploy_traffic", "smoke run: resnet18 at 96 px, under WORKDIR/quick")
    ap.add_argument("--table-only", action="store_true", help="only rewrite deploy_traffic.md from its cache")
    args = ap.parse_args(argv)
    if args.table_only:
        write_md(RESULTS / "deploy_traffic.md", render(load_cache(RESULTS / "deploy_traffic.json")).splitlines())
        return
    out = RESULTS
    if args.quick:
        out = quick_mode(args, RESULTS)
        args.models = ["resnet18"]
    torch.set_num_threads(1)
    deploy = dl.models(deploy_sizes=not args.quick)
    env = environment(1)
    cache: dict[str, Any] = {"models": {}, "command": command_line("-m bench.deploy_traffic", argv),
                             "commit": git_commit(ROOT), "machine": f"{env['machine']}, torch {env['torch']}"}
    for key in args.models:
        name = CHOICES[key]
        build, size = deploy[name]
        cache["models"][name] = measure(name, build, size)
        r = cache["models"][name]
        print(f"{name}: MACs {r['macs_ratio']:.3f}, params {r['params_ratio']:.3f}, "
              f"activations {r['activations_ratio']:.3f}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    save_cache(out / "deploy_traffic.json", cache, end="\n")
    write_md(out / "deploy_traffic.md", render(cache).splitlines())


if __name__ == "__main__":
    main()
