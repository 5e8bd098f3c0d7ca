"""What pruning buys at deployment: CPU latency of the original and of the pruned export, in
PyTorch and in onnxruntime, at batch 1 and 32, next to the MACs ratio.

    PYTHONPATH=src python bench/deploy_latency.py [--threads 1] [--rounds 15] [--models ...]

Each model is pruned to half its MACs with the budget solver on the supernet at
initialisation (``searcher.meet_target()``: one common pruning ratio for every width and
depth dimension, then single units given back greedily; no training: latency depends on the
shapes, not on the weights). The four variants (PyTorch / onnxruntime x original / pruned)
run interleaved round by round on the same input, and medians with the interquartile range
are reported. ONNX files come from ``torch.onnx.export(dynamo=True)`` with a dynamic batch
dimension and are checked against PyTorch with :func:`dmscale.deploy.check_onnx` at both
batch sizes. Small image sizes keep the run to a few minutes on 2 cores. Writes
bench/results/deploy_latency.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch import nn

import dmscale as dms
from dmscale import deploy


def _models() -> dict[str, tuple[nn.Module, int]]:
    dms.ensure_torchvision()
    import timm
    import torchvision
    from ultralytics.nn.tasks import DetectionModel

    return {
        "resnet18 (torchvision)": (lambda: torchvision.models.resnet18(), 96),
        "mobilenet_v3_small (torchvision)": (lambda: torchvision.models.mobilenet_v3_small(), 96),
        "vit_tiny_patch16 (timm)": (lambda: timm.create_model("vit_tiny_patch16_224", img_size=96,
                                                              pretrained=False), 96),
        "yolov8n (ultralytics)": (lambda: DetectionModel("yolov8n.yaml", verbose=False), 128),
    }


def _onnx(model: nn.Module, x: torch.Tensor, path: Path) -> None:
    batch = torch.export.Dim("batch", min=1, max=64)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(model, (x[:2],), dynamo=True, verbose=False, optimize=True,
                                    dynamic_shapes=({0: batch},))
    program.save(str(path))


def _timer(fn, x):
    def run() -> float:
        t0 = time.perf_counter()
        fn(x)
        return time.perf_counter() - t0
    return run


def _stats(ts: list[float]) -> str:
    q = statistics.quantiles(ts, n=4) if len(ts) >= 2 else [ts[0]] * 3
    return f"{1e3 * q[1]:.1f} ({1e3 * q[0]:.1f}-{1e3 * q[2]:.1f})"


def bench_one(name: str, build, size: int, threads: int, rounds: dict[int, int], tmp: Path) -> list[str]:
    import onnxruntime as ort

    torch.manual_seed(0)
    original = build().eval()
    x1 = torch.randn(1, 3, size, size)
    pruned_src = build().eval()
    pruned_src.load_state_dict(original.state_dict())
    # untrained: keep channels by position (only the pruned shapes matter for the timings)
    searcher = dms.prepare(pruned_src, x1, dms.SearchConfig(resource="macs", target=0.5, importance="index"))
    searcher.meet_target()
    pruned = searcher.export().eval()
    dms.detach(pruned_src)
    macs = (dms.count(original, x1)["macs"], dms.count(pruned, x1)["macs"])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    sessions = {}
    for tag, m in (("orig", original), ("pruned", pruned)):
        path = tmp / f"{tag}.onnx"
        _onnx(m, torch.cat([x1, x1]), path)
        for b in rounds:
            deploy.check_onnx(path, m, torch.randn(b, 3, size, size))
        sessions[tag] = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    rows = []
    for b, n in rounds.items():
        x = torch.randn(b, 3, size, size)
        xn = x.numpy()
        fns = {}
        for tag, m in (("orig", original), ("pruned", pruned)):
            fns[("torch", tag)] = _timer(lambda inp, m=m: m(inp), x)
            s = sessions[tag]
            feed_name = s.get_inputs()[0].name
            fns[("ort", tag)] = _timer(lambda inp, s=s, k=feed_name: s.run(None, {k: inp}), xn)
        times = {k: [] for k in fns}
        with torch.no_grad():
            for f in fns.values():  # warm-up
                f()
            for _ in range(n):
                for k, f in fns.items():
                    times[k].append(f())
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append(
            f"| {name} | {size} | {b} | {macs[1] / macs[0]:.2f} | {_stats(times[('torch', 'orig')])} | "
            f"{_stats(times[('torch', 'pruned')])} | {med[('torch', 'pruned')] / med[('torch', 'orig')]:.2f} | "
            f"{_stats(times[('ort', 'orig')])} | {_stats(times[('ort', 'pruned')])} | "
            f"{med[('ort', 'pruned')] / med[('ort', 'orig')]:.2f} |")
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=15, help="rounds at batch 1 (batch 32: a third)")
    parser.add_argument("--models", nargs="*", help="substrings of the model names to run")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "deploy_latency.md"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rounds = {1: args.rounds, 32: max(3, args.rounds // 3)}
    rows = []
    t0 = time.time()
    with tempfile.TemporaryDirectory() as d:
        for name, (build, size) in _models().items():
            if args.models and not any(s in name for s in args.models):
                continue
            rows += bench_one(name, build, size, args.threads, rounds, Path(d))
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        commit = "?"
    import onnxruntime

    header = [
        "# Deployment latency: original vs pruned export (half the MACs), PyTorch and onnxruntime",
        "",
        f"Command: `PYTHONPATH=src python bench/deploy_latency.py {' '.join(sys.argv[1:])}`".rstrip() + "  ",
        f"Commit: {commit}; machine: {platform.machine()}, {os.cpu_count()} CPU cores (shared with other "
        f"jobs), {platform.python_version()}, torch {torch.__version__}, onnxruntime {onnxruntime.__version__}; "
        f"{args.threads} thread(s) for PyTorch and onnxruntime; {time.time() - t0:.0f} s in all.",
        "",
        "Milliseconds per forward pass: median (interquartile range) over "
        f"{rounds[1]} rounds at batch 1 and {rounds[32]} at batch 32, the four variants interleaved "
        "round by round. Pruned: `searcher.meet_target()` on the model at initialisation (one common "
        "pruning ratio for all width and depth dimensions to half the MACs; no search training, "
        "random weights: latency depends on shapes only). Small inputs (size column) to keep the run short.",
        "",
        "| model | size | batch | MACs ratio | torch orig | torch pruned | torch ratio | ort orig | ort pruned | ort ratio |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(header + rows) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
