"""Cost of searching: a DMS training step vs a plain training step, side by side.

    PYTHONPATH=src:tests python bench/search_overhead.py [--threads 1] [--rounds 15]

For each model, a plain copy and a prepared copy (masks + resource loss) run the same
forward + backward + SGD step on the same batch, interleaved round by round; the ratio of
their median times is reported (absolute times on a shared machine are noise, ratios
measured side by side are not). Writes bench/results/search_overhead.md.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import dmscale as dms  # noqa: E402
from zoo import ZOO  # noqa: E402

MODELS = ["resnet20", "small_cnn", "tv_resnet18", "tv_mobilenet_v2", "timm_efficientnet_b0"]


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, searcher=None) -> float:
    t0 = time.perf_counter()
    loss = nn.functional.cross_entropy(model(x), y)
    if searcher is not None:
        loss = loss + searcher.resource_loss(progress=0.5)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return time.perf_counter() - t0


def measure(name: str, batch: int, rounds: int) -> dict[str, float]:
    entry = ZOO[name]
    plain = entry.build().train()
    dmsnet = copy.deepcopy(plain)
    x = torch.randn(batch, *entry.input_shape[1:], generator=torch.Generator().manual_seed(0))
    y = torch.arange(batch) % 10
    t0 = time.perf_counter()
    searcher = dms.prepare(dmsnet, x[:1], dms.SearchConfig(target=0.5))
    prepare_s = time.perf_counter() - t0
    opt_p = torch.optim.SGD(plain.parameters(), lr=1e-3)
    opt_d = torch.optim.SGD([{"params": list(searcher.model_parameters())},
                             {"params": list(searcher.structure_parameters())}], lr=1e-3)
    for _ in range(2):  # warm-up
        _step(plain, opt_p, x, y)
        _step(dmsnet, opt_d, x, y, searcher)
    tp, td = [], []
    for r in range(rounds):
        pair = [(tp, lambda: _step(plain, opt_p, x, y)), (td, lambda: _step(dmsnet, opt_d, x, y, searcher))]
        for out, fn in (pair if r % 2 == 0 else pair[::-1]):
            out.append(fn())
    mp, md = statistics.median(tp), statistics.median(td)
    ratios = [d / p for d, p in zip(td, tp)]
    return {"plain_ms": mp * 1e3, "dms_ms": md * 1e3, "ratio": md / mp,
            "ratio_q1": statistics.quantiles(ratios, n=4)[0], "ratio_q3": statistics.quantiles(ratios, n=4)[2],
            "dims": len(searcher.gates.width) + len(searcher.gates.depth), "prepare_s": prepare_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    load = os.getloadavg()
    rows = []
    for name in MODELS:
        r = measure(name, args.batch, args.rounds)
        rows.append((name, r))
        print(f"{name}: x{r['ratio']:.3f} ({r['plain_ms']:.1f} ms -> {r['dms_ms']:.1f} ms)", flush=True)
    lines = [
        "# Search overhead: a DMS step vs a plain training step",
        "",
        "Written by `bench/search_overhead.py`. Each round runs one plain step and one DMS step",
        "(masks on every channel-mixing layer, depth masks, Taylor importance hooks, the",
        "differentiable resource loss) on the same batch, alternating which goes first; the",
        "ratio is median(DMS) / median(plain). The quartiles are those of the per-round ratios.",
        "",
        f"- command: `PYTHONPATH=src:tests python bench/search_overhead.py --threads {args.threads} "
        f"--rounds {args.rounds} --batch {args.batch}`",
        f"- machine: {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"torch {torch.__version__}, {args.threads} thread(s); load average before: "
        f"{load[0]:.2f}/{load[1]:.2f}/{load[2]:.2f}",
        f"- seeds: model init 0 (zoo), batch generator 0; {args.rounds} rounds after 2 warm-up steps; one run",
        "",
        "| model | input | dims searched | plain step (ms) | DMS step (ms) | ratio | ratio q1-q3 | prepare (s) |",
        "|---|---|---:|---:|---:|---:|---|---:|",
    ]
    for name, r in rows:
        shape = "x".join(str(s) for s in (args.batch,) + tuple(ZOO[name].input_shape[1:]))
        lines.append(f"| {name} | {shape} | {r['dims']} | {r['plain_ms']:.1f} | {r['dms_ms']:.1f} | "
                     f"{r['ratio']:.3f} | {r['ratio_q1']:.3f}-{r['ratio_q3']:.3f} | {r['prepare_s']:.2f} |")
    out = Path(__file__).resolve().parent / "results" / "search_overhead.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out.relative_to(Path.cwd()) if out.is_relative_to(Path.cwd()) else out.name}")


if __name__ == "__main__":
    main()
