"""Does a latency budget land on the latency? Half the MACs against half the time (issue 29).

    PYTHONPATH=src:tests python -m bench.latency_target [--models resnet18 vit mobilenet yolo]
        [--batches 1 8] [--runs 3] [--rounds 30] [--threads 1]
    PYTHONPATH=src:tests python -m bench.latency_target --device cuda --bf16 [--out OUT]   # on a GPU
    PYTHONPATH=src:tests python -m bench.latency_target --table-only           # md from the json
    PYTHONPATH=src:tests python -m bench.latency_target --quick                # smoke run, bench/runs/

An export at half the MACs is not half as fast (``deploy_latency.md``: 0.53-1.07x on a CPU,
0.69-0.92x on an H200; ``deploy_traffic.md`` counts why). ``SearchConfig(resource="latency")``
budgets the time itself: it times the model's layers on the device it is given
(:class:`dmscale.cost.latency.LatencyCostModel`) and the search meets a fraction of the measured
latency. Here both budgets are met on the same model at initialisation, as ``deploy_latency.py``
prunes (``importance="index"``, ``searcher.meet_target()``: the budget solver, no training; a
latency depends on the shapes, not on the weights), and each export is timed against the
original:

* **MACs arm**: ``resource="macs", target=0.5``;
* **latency arm**: ``resource="latency", target=0.5``, profiled at the batch it is timed at;
  ``--runs`` independent profiles (each its own ``prepare``), since the profile is itself a
  measurement: its prediction (the fitted cost of the export over the fitted cost of the
  original) beside what the export then measures.

The original and every export run interleaved round by round on one input; per round the ratio
export / original; reported: the median and the quartiles of those per-round ratios. Results are
cached per model and batch in ``bench/results/latency_target{_DEVICE}.json``; the md is rendered
from the cache (a run replaces the rows it measures).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import dmscale as dms
from dmscale.errors import ConfigError

from bench.lib import deploy_models as dl
from bench.lib.benchlib import (RESULTS, add_quick_flags, command_line, environment, git_commit, hand_reading,  # noqa: E402
                      load_cache, quick_mode, save_cache, write_md)

__all__ = ["TARGET", "LLM_TARGET", "pruned", "time_ratios", "measure", "render", "main"]

TARGET = 0.5
LLM_TARGET = 0.8  # token models (deploy_latency.VOCAB), as in the GPU check: half is below what they reach
ROOT = Path(__file__).resolve().parents[1]


def pruned(build: dl.Builder, original: nn.Module, x: torch.Tensor, resource: str, target: float,
           budget_s: float) -> tuple[nn.Module, dict[str, Any]]:
    """A copy of ``original`` (its weights, device and dtype) met at ``target`` of ``resource``
    and exported, and what the search predicted: the hard cost over the supernet's and the
    seconds ``prepare`` took (the latency profile)."""
    source = build().eval().to(device=x.device, dtype=next(original.parameters()).dtype)
    source.load_state_dict(original.state_dict())
    opts = {"budget_s": budget_s} if resource == "latency" else {}
    t0 = time.perf_counter()
    searcher = dms.prepare(source, x, dms.SearchConfig(resource=resource, target=target, importance="index",
                                                       latency_options=opts))
    prepare_s = time.perf_counter() - t0
    res = searcher.meet_target()
    export = searcher.export().eval()
    return export, {"predicted": res["hard"] / res["supernet"], "prepare_s": round(prepare_s, 1)}


def time_ratios(original: nn.Module, exports: dict[str, nn.Module], x: torch.Tensor,
                rounds: int) -> dict[str, Any]:
    """Run the original and ``exports`` interleaved (order rotated each round) after one warm-up
    call each; per export the quartiles of its per-round ratio to the original, and the
    original's median milliseconds."""
    timers = {k: dl.synced(m, x, x.device) for k, m in {"original": original, **exports}.items()}
    times: dict[str, list[float]] = {k: [] for k in timers}
    keys = list(timers)
    with torch.no_grad():
        for t in timers.values():
            t()
        for r in range(rounds):
            for k in keys[r % len(keys):] + keys[:r % len(keys)]:
                times[k].append(timers[k]())
    out: dict[str, Any] = {"original_ms": round(1e3 * statistics.median(times["original"]), 3)}
    for k in exports:
        ratios = [a / b for a, b in zip(times[k], times["original"])]
        q1, med, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        out[k] = {"ratio": round(med, 4), "q1": round(q1, 4), "q3": round(q3, 4)}
    return out


def measure(name: str, build: dl.Builder, size: int, batch: int, runs: int, rounds: int, device: torch.device,
            dtype: torch.dtype, budget_s: float) -> dict[str, Any]:
    """The MACs arm and ``runs`` latency arms of one model at one batch (see the module text); an
    arm whose target lies below the smallest structure's cost records the search's error."""
    target = LLM_TARGET if name in dl.VOCAB else TARGET
    torch.manual_seed(0)
    original = build().eval().to(device=device, dtype=dtype)
    x = dl.example(batch, size, dl.VOCAB.get(name)).to(device)
    x = x.to(dtype) if x.is_floating_point() else x
    macs = lambda m: dms.count(m, x)["macs"]  # noqa: E731
    full = macs(original)
    exports, arms = {}, {}
    for arm in ["macs"] + [f"latency{i}" for i in range(runs)]:
        try:
            exports[arm], arms[arm] = pruned(build, original, x, "latency" if arm != "macs" else "macs", target,
                                             budget_s)
        except ConfigError as err:  # e.g. a latency target below the smallest structure's
            arms[arm] = {"error": str(err).split(";")[0]}
            continue
        arms[arm]["macs_ratio"] = round(macs(exports[arm]) / full, 4)
    timed = time_ratios(original, exports, x, rounds)
    for arm in exports:
        arms[arm].update(timed[arm])
        arms[arm]["predicted"] = round(arms[arm]["predicted"], 4)
    return {"model": name, "size": size, "batch": batch, "rounds": rounds, "dtype": str(dtype).split(".")[-1],
            "target": target, "original_ms": timed["original_ms"], "arms": arms}


def _cell(a: dict[str, Any]) -> str:
    return f"{a['ratio']:.3f} ({a['q1']:.3f}-{a['q3']:.3f})"


def _arm(a: dict[str, Any], with_prediction: bool) -> str:
    """One arm's cell: [predicted /] measured (quartiles) (MACs ratio), or its error."""
    if "error" in a:
        return f"not met: {a['error']}"
    head = f"{a['predicted']:.3f} / " if with_prediction else f"{a['macs_ratio']:.3f} / "
    return head + _cell(a) + (f" ({a['macs_ratio']:.2f})" if with_prediction else "")


def render(cache: dict[str, Any]) -> list[str]:
    rows = cache.get("rows", {})
    lines = ["# Half the MACs against half the time: a latency budget on the device (issue 29)", "",
             "Written by `bench/latency_target.py` (see its docstring for the method): each model at random init "
             f"met at {TARGET} of its MACs ({LLM_TARGET} for a language model) and, in independent profiles, at the "
             "same fraction of its latency "
             "(`SearchConfig(resource=\"latency\")`, profiled on the device at the batch it is timed at), by the "
             "budget solver; every export timed against the original, interleaved; latency ratio = median "
             "(quartiles) of the per-round ratios export / original. Predicted: the latency model's cost of the "
             "export over its cost of the original.", ""]
    if "command" in cache:
        env = cache.get("environment", {})
        lines += [f"- command: `{cache['command']}`; commit `{cache.get('commit', '?')}`",
                  f"- machine: {env.get('machine', '?')}, device {env.get('device', '?')}, torch "
                  f"{env.get('torch', '?')}, {env.get('threads', '?')} CPU thread(s)"]
    lines += ["", "| model | input | batch | target | original ms | MACs budget: MACs / latency ratio "
              "| latency budget, per profile: predicted / measured latency ratio (MACs ratio) | profile s |",
              "|---|---|---:|---:|---:|---|---|---|"]
    for key in sorted(rows, key=lambda k: (rows[k]["model"], rows[k]["batch"])):
        r = rows[key]
        lat = [a for k, a in sorted(r["arms"].items()) if k.startswith("latency")]
        cells = "; ".join(_arm(a, True) for a in lat)
        unit = "tokens" if r["model"] in dl.VOCAB else "px"
        lines.append(f"| {r['model']} | {r['size']} {unit}, {r['dtype']} | {r['batch']} | {r.get('target', TARGET)} "
                     f"| {r['original_ms']:.2f} "
                     f"| {_arm(r['arms']['macs'], False)} | {cells} "
                     f"| {', '.join(str(a.get('prepare_s', '-')) for a in lat)} |")
    return lines


def _with_reading(lines: list[str], stem: str) -> list[str]:
    """The table followed by its hand-written reading (``bench/results/STEM_reading.md``)."""
    reading = hand_reading(RESULTS / f"{stem}_reading.md")
    return lines + ["", reading] if reading is not None else lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=None, help="substrings of deploy_latency's model names")
    ap.add_argument("--batches", nargs="+", type=int, default=None, help="default: 1 8 (cuda: 1 64)")
    ap.add_argument("--runs", type=int, default=3, help="independent latency profiles per model and batch")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--budget-s", type=float, default=30.0, help="latency profile: seconds at most per profile")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--bf16", action="store_true", help="models, profiles and timings in bfloat16")
    ap.add_argument("--table-only", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS,
                    help="folder of the cache and table (default bench/results; on a machine whose bench/results "
                         "does not come back, a folder that does)")
    add_quick_flags(ap, "latency_target", "resnet18 at batch 1, one profile of 2 s, 4 rounds")
    args = ap.parse_args(argv)
    out = quick_mode(args, args.out, models=["resnet18"], batches=[1], runs=1, rounds=4, budget_s=2.0)
    stem = "latency_target" if args.device == "cpu" else f"latency_target_{args.device}"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}.json"
    cache = load_cache(path, {"rows": {}})
    if not args.table_only:
        torch.set_num_threads(args.threads)
        device = torch.device(args.device)
        dtype = torch.bfloat16 if args.bf16 else torch.float32
        table = dl.models(deploy_sizes=args.device == "cuda")
        names = [n for n in table if args.models is None or any(m in n for m in args.models)]
        batches = args.batches or ([1, 8] if args.device == "cpu" else [1, dl.SERVING_BATCH])
        cache.update(command=command_line("-m bench.latency_target", argv), commit=git_commit(ROOT),
                     environment=environment(args.threads, args.device))
        for name in names:
            build, size = table[name]
            for batch in batches:
                row = measure(name, build, size, batch, args.runs, args.rounds, device, dtype, args.budget_s)
                cache["rows"][f"{name}@{batch}@{row['dtype']}"] = row
                save_cache(path, cache)
                print(render({"rows": {"r": row}})[-1], flush=True)
    write_md(out / f"{stem}.md", _with_reading(render(cache), stem) if out == RESULTS else render(cache))


if __name__ == "__main__":
    main()
