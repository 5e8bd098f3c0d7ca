"""Does the latency model follow the staircase of aligned widths? (issue 29)

On a GPU a layer's time is a staircase in its width: flat between the sizes its kernels tile
(multiples of 8, 64, 128 ...) and up a step past each. ``--resource latency`` fits one smooth
monotone quadratic per layer to a grid of widths (``LatencyCostModel``, ratios 0.25 / 0.5 /
0.75 / 1); with ``align=N`` the search only visits multiples of N. This script profiles a
model as ``dms.prepare(..., SearchConfig(resource="latency", align=N))`` does, then times a
few layers alone at a sweep of widths (every multiple of N, and one channel more than some of
them) and compares each timing with the fitted prediction:

* the fit's relative error at the aligned widths (what the search reaches) against its error at
  the unaligned ones, and
* the step a width pays for leaving alignment (time at k + 1 over time at k, k aligned).

    python -m bench.latency_staircase --device cuda [--model vit_b16] [--batch 64] [--align 8]
    python -m bench.latency_staircase --quick          # a small ViT on the CPU, seconds

Writes ``bench/results/latency_staircase_<device>.{json,md}`` (``--quick``: under
``bench/runs/latency_staircase/quick/``). On a busy CPU the timings are noise; the table is
meant for a GPU. Each (layer, width) is timed by
:func:`dmscale.cost.timing.measure_latency` (a low quantile of single calls; CUDA synchronised),
the layer pruned to its first k channels as the profile prunes it.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
from bench.lib.benchlib import RESULTS, add_quick_flags, git_commit, quick_mode  # noqa: E402

__all__ = ["MODELS", "sweep", "staircase", "render", "main"]

# model -> (builder, image size, layers to sweep: (name, side)); side "out": the layer's output
# channels (FFN units of fc1, q/k/v rows of qkv), "in": its input channels
MODELS: dict[str, tuple[dict[str, Any], int, list[tuple[str, str]]]] = {
    "vit_b16": ({"model_name": "vit_base_patch16_224"}, 224,
                [("blocks.0.mlp.fc1", "out"), ("blocks.0.mlp.fc2", "in"), ("blocks.0.attn.qkv", "out")]),
    "vit_tiny": ({"model_name": "vit_tiny_patch16_224", "img_size": 64}, 64,
                 [("blocks.0.mlp.fc1", "out"), ("blocks.0.mlp.fc2", "in")]),
}


def _build(name: str, device: torch.device) -> tuple[nn.Module, torch.Tensor]:
    import dmscale as dms
    dms.ensure_torchvision()
    import timm
    kwargs, size, _ = MODELS[name]
    torch.manual_seed(0)
    model = timm.create_model(pretrained=False, **kwargs).to(device).eval()
    return model, torch.randn(1, 3, size, size, device=device)


def sweep(size: int, align: int, points: int) -> list[int]:
    """About ``points`` widths: multiples of ``align`` up to ``size``, and for every other one
    of them the width one channel more (unaligned)."""
    aligned = list(range(align, size + 1, align))
    stride = max(1, len(aligned) // points)
    chosen = aligned[::stride] + ([size] if aligned[::stride][-1] != size else [])
    extra = [k + 1 for k in chosen[::2] if k + 1 < size]
    return sorted(set(chosen + extra))


def _layer_latency_us(layer: nn.Module, x: torch.Tensor, side: str, k: int, repeats: int) -> float:
    from dmscale.cost.latency_profile import with_channels
    from dmscale.cost.timing import measure_latency
    from dmscale.trace.handlers.base import handler_for
    handler = handler_for(layer)
    m = copy.deepcopy(layer)  # pruned to its first k channels, as the profile prunes it
    keep = torch.arange(k, device=x.device)
    handler.prune(m, keep if side == "in" else None, keep if side == "out" else None)
    if side == "in":
        x = with_channels(x, handler.channel_dim, k)
    return 1e6 * measure_latency(m, x, repeats=repeats, warmup=2)


def staircase(name: str, device: torch.device, batch: int, align: int, points: int, repeats: int,
              budget_s: float) -> dict[str, Any]:
    """Profile ``name`` for a latency search on ``device``, then sweep its layers (see the module
    text); returns the rows and the summary of each layer."""
    import dmscale as dms
    from dmscale.cost.latency_profile import capture_inputs
    model, example = _build(name, device)
    x = example.expand(batch, *example.shape[1:]).contiguous()
    layers = MODELS[name][2]
    inputs, _ = capture_inputs(model, [n for n, _ in layers], [], x)  # each layer's input at this batch
    searcher = dms.prepare(copy.deepcopy(model), x, dms.SearchConfig(
        resource="latency", target=0.5, align=align, latency_options={"budget_s": budget_s}))
    cost = searcher.costs.model_of("latency")
    modules = dict(model.named_modules())
    out: dict[str, Any] = {"model": name, "batch": batch, "align": align, "layers": {}}
    for layer_name, side in layers:
        layer, layer_x = modules[layer_name], inputs[layer_name][0][0]
        size = layer.out_features if side == "out" else layer.in_features
        rows = []
        for k in sweep(size, align, points):
            measured = _layer_latency_us(layer, layer_x, side, k, repeats)
            fitted = cost.predict_layer(layer_name, **{f"keep_{side}": k / size})
            rows.append({"k": k, "aligned": k % align == 0, "measured_us": measured, "fitted_us": fitted,
                         "rel_error": fitted / measured - 1})
        out["layers"][layer_name] = {"side": side, "size": size, "rows": rows, **_summary(rows, align)}
    return out


def _summary(rows: list[dict[str, Any]], align: int) -> dict[str, Any]:
    def mean_abs(rs: list[dict[str, Any]]) -> float | None:
        return sum(abs(r["rel_error"]) for r in rs) / len(rs) if rs else None
    by_k = {r["k"]: r["measured_us"] for r in rows}
    steps = [by_k[k + 1] / by_k[k] for k in by_k if k % align == 0 and k + 1 in by_k]
    return {"fit_error_aligned": mean_abs([r for r in rows if r["aligned"]]),
            "fit_error_unaligned": mean_abs([r for r in rows if not r["aligned"]]),
            "step_mean": sum(steps) / len(steps) if steps else None, "step_max": max(steps) if steps else None}


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f} %"


def render(result: dict[str, Any]) -> str:
    lines = [f"# Latency model against the staircase of aligned widths ({result['device']})", "",
             "Written by `bench/latency_staircase.py` (see its docstring). Each layer of the first block "
             "timed alone at a sweep of widths, against what the fitted latency model "
             "(`--resource latency`) predicts there. fit error: mean |fitted / measured - 1|; step: time at "
             "k + 1 channels over time at k (k a multiple of align): what leaving alignment costs.", "",
             f"- command: `{result['command']}`",
             f"- commit: `{result['commit']}`; machine: {result['machine']}; torch {result['torch']}", "",
             "| model | layer | side | size | batch | align | fit error, aligned widths | fit error, unaligned "
             "| step mean / max |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["runs"]:
        for name, layer in r["layers"].items():
            step = ("-" if layer["step_mean"] is None else
                    f"{layer['step_mean']:.2f}x / {layer['step_max']:.2f}x")
            lines.append(f"| {r['model']} | {name} | {layer['side']} | {layer['size']} | {r['batch']} | {r['align']} "
                         f"| {_pct(layer['fit_error_aligned'])} | {_pct(layer['fit_error_unaligned'])} | {step} |")
    lines += ["", "Every timing (µs):", ""]
    for r in result["runs"]:
        for name, layer in r["layers"].items():
            cells = ", ".join(f"{x['k']}{'' if x['aligned'] else '*'}: {x['measured_us']:.1f} / {x['fitted_us']:.1f}"
                              for x in layer["rows"])
            lines.append(f"- {r['model']} `{name}` (k: measured / fitted; * unaligned): {cells}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", choices=list(MODELS), default="vit_b16")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--align", type=int, default=8)
    ap.add_argument("--points", type=int, default=12, help="aligned widths per layer (about)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=30.0, help="the latency profile's time budget")
    ap.add_argument("--out", type=Path, default=None, help="folder for the json and md (default bench/results)")
    add_quick_flags(ap, "latency_staircase", "ViT-Tiny at 64 px, batch 4, three widths per layer", outputs="table")
    args = ap.parse_args(argv)
    out_dir = quick_mode(args, args.out or RESULTS, model="vit_tiny", batch=4, points=3, repeats=3, budget_s=2.0)
    device = torch.device(args.device)
    out_dir.mkdir(parents=True, exist_ok=True)
    run = staircase(args.model, device, args.batch, args.align, args.points, args.repeats, args.budget_s)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "CPU"
    result = {"command": "python -m bench.latency_staircase " + " ".join(argv if argv is not None else sys.argv[1:]),
              "commit": git_commit(ROOT), "machine": f"{platform.platform()}, {name}", "device": name,
              "torch": torch.__version__, "runs": [run]}
    stem = f"latency_staircase_{device.type}"
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out_dir / f"{stem}.md").write_text(render(result))
    print(render(result).split("\n\nEvery timing")[0])
    print(f"wrote {out_dir / stem}.md")


if __name__ == "__main__":
    main()
