"""Cost of searching: a DMS training step vs a plain training step, side by side (issue 10, table 8).

    PYTHONPATH=src:tests python -m bench.search_overhead [--quick] [--threads 1] [--rounds 15] [--models ...]

Step time: for each model, a plain copy and a prepared copy (masks + importance hooks +
resource loss) run the same forward + backward + SGD step on the same batch, interleaved
round by round (which goes first alternates); the ratio of their median times is reported
with the quartiles of the per-round ratios (absolute times on a shared machine are noise,
ratios measured side by side are not).

Peak memory: one fresh subprocess per model x variant imports torch and the model's
libraries (and builds the model once, to load every lazy import), resets the kernel's
resident-set high-water mark (``/proc/self/clear_refs`` = 5) and reads VmRSS (the base), then
builds the model, prepares it (DMS), runs ``--mem-steps`` training steps and reads VmHWM (the
peak). Reported: the peak RSS and what the run added on top of the base (weights, gradients,
optimizer state, activations, the searcher and its tracing, allocator caching), DMS over
plain. Where ``clear_refs`` cannot be written the subprocess falls back to
``resource.getrusage(RUSAGE_SELF).ru_maxrss``, which then also holds imports and preparation;
the table says which was used. Results are cached per model in bench/results/search_overhead.json
(a model already measured with the same batch, rounds, steps and threads is not re-run; --fresh
re-runs) and the table bench/results/search_overhead.md is rewritten after each model.
``--quick`` is a smoke run (small_cnn unless ``--models`` says otherwise, batch 4, 4 rounds, one
memory step) whose cache and table go to ``WORKDIR/quick/`` (``--workdir``, default
``bench/runs/search_overhead/``; nothing under bench/results).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
import dmscale as dms  # noqa: E402
from bench.lib.benchlib import add_quick_flags, git_commit, host, load_cache, quick_mode, save_cache, write_md  # noqa: E402

__all__ = ["Bench", "BENCHES", "measure_time", "measure_memory", "main"]

RESULTS = ROOT / "bench" / "results"
LM_SEQ = 32


@dataclass(frozen=True)
class Bench:
    """A model to time: its builder, a batch of inputs and the task loss of its output."""

    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[int], Any]
    loss: Callable[[Any, Any], torch.Tensor]
    shape: str

    def example(self, batch_inputs: Any) -> Any:
        """The first example of a batch (what ``dms.prepare`` traces)."""
        if isinstance(batch_inputs, dict):
            return {k: v[:1] for k, v in batch_inputs.items()}
        return batch_inputs[:1]


def _zoo(name: str) -> Callable[[], nn.Module]:
    from zoo import ZOO

    return lambda: ZOO[name].build()


def _tzoo(name: str) -> Callable[[], nn.Module]:
    from transformer_zoo import TZOO

    return lambda: TZOO[name].build()


def _images(size: int, channels: int = 3) -> Callable[[int], torch.Tensor]:
    return lambda b: torch.randn(b, channels, size, size, generator=torch.Generator().manual_seed(0))


def _tokens(b: int) -> dict[str, torch.Tensor]:
    from transformer_zoo import token_ids

    return {"input_ids": token_ids(b, LM_SEQ, seed=0)}


def _ce(out: Any, inputs: Any) -> torch.Tensor:
    n = out.shape[0]
    return nn.functional.cross_entropy(out, torch.arange(n) % 10)


def _lm(out: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    logits, ids = out.logits[:, :-1], inputs["input_ids"][:, 1:]
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1))


BENCHES: dict[str, Bench] = {b.name: b for b in [
    Bench("resnet20", _zoo("resnet20"), _images(32), _ce, "3x32x32"),
    Bench("small_cnn", _zoo("small_cnn"), _images(28, 1), _ce, "1x28x28"),
    Bench("tv_resnet18", _zoo("tv_resnet18"), _images(64), _ce, "3x64x64"),
    Bench("tv_mobilenet_v2", _zoo("tv_mobilenet_v2"), _images(64), _ce, "3x64x64"),
    Bench("timm_efficientnet_b0", _zoo("timm_efficientnet_b0"), _images(64), _ce, "3x64x64"),
    Bench("timm_vit_small", _tzoo("timm_vit_small"), _images(32), _ce, "3x32x32 (4 patches + cls)"),
    Bench("hf_llama_tiny", _tzoo("hf_llama_gqa"), _tokens, _lm, f"{LM_SEQ} tokens (3 layers, d 64, GQA 8/2)"),
]}


def _setup(bench: Bench, batch: int, with_dms: bool, model: nn.Module | None = None
           ) -> tuple[nn.Module, Any, torch.optim.Optimizer, Any]:
    """The model in train mode, its batch, an SGD optimizer, and the searcher (or None)."""
    model = (model if model is not None else bench.build()).train()
    x = bench.inputs(batch)
    if not with_dms:
        return model, x, torch.optim.SGD(model.parameters(), lr=1e-3), None
    searcher = dms.prepare(model, bench.example(x), dms.SearchConfig(target=0.5))
    model.train()
    opt = torch.optim.SGD([{"params": list(searcher.model_parameters())},
                           {"params": list(searcher.structure_parameters())}], lr=1e-3)
    return model, x, opt, searcher


def _call(model: nn.Module, x: Any) -> Any:
    return model(**x) if isinstance(x, dict) else model(x)


def _step(bench: Bench, model: nn.Module, opt: torch.optim.Optimizer, x: Any, searcher: Any = None,
          progress: float = 0.5) -> float:
    """One timed training step; ``progress`` 0.5 is before the settle phase (Eq. 6's loss on
    the soft cost), 0.9 inside it (the band loss on the exact cost, evaluated every step)."""
    t0 = time.perf_counter()
    loss = bench.loss(_call(model, x), x)
    if searcher is not None:
        loss = loss + searcher.resource_loss(progress=progress)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return time.perf_counter() - t0


def measure_time(bench: Bench, batch: int, rounds: int) -> dict[str, float]:
    """Plain, DMS and settle-phase DMS steps interleaved in one process (the order rotates each
    round); medians, their ratios to plain, per-round quartiles of the DMS ratio."""
    torch.manual_seed(0)
    base = bench.build()
    plain, x, opt_p, _ = _setup(bench, batch, False, copy.deepcopy(base))
    settle_net, _, opt_s, settle_searcher = _setup(bench, batch, True, copy.deepcopy(base))
    t0 = time.perf_counter()
    dmsnet, _, opt_d, searcher = _setup(bench, batch, True, base)
    prepare_s = time.perf_counter() - t0
    for _ in range(2):  # warm-up
        _step(bench, plain, opt_p, x)
        _step(bench, dmsnet, opt_d, x, searcher)
        _step(bench, settle_net, opt_s, x, settle_searcher, progress=0.9)
    tp: list[float] = []
    td: list[float] = []
    ts: list[float] = []
    for r in range(rounds):
        arms = [(tp, lambda: _step(bench, plain, opt_p, x)),
                (td, lambda: _step(bench, dmsnet, opt_d, x, searcher)),
                (ts, lambda: _step(bench, settle_net, opt_s, x, settle_searcher, progress=0.9))]
        for out, fn in arms[r % 3:] + arms[:r % 3]:
            out.append(fn())
    mp, md, ms = statistics.median(tp), statistics.median(td), statistics.median(ts)
    q = statistics.quantiles([d / p for d, p in zip(td, tp)], n=4)
    return {"plain_ms": mp * 1e3, "dms_ms": md * 1e3, "ratio": md / mp, "ratio_q1": q[0], "ratio_q3": q[2],
            "settle_ms": ms * 1e3, "settle_ratio": ms / mp,
            "dims": len(searcher.gates.width) + len(searcher.gates.depth), "prepare_s": prepare_s}


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} line (Linux only)")


def _child(name: str, variant: str, batch: int, steps: int, threads: int) -> dict[str, Any]:
    """In a fresh process with torch imported: base RSS, then the peak RSS over building the model,
    ``dms.prepare`` (DMS only: tracing and the self-check forwards) and ``steps`` training steps."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    bench = BENCHES[name]
    bench.inputs(1)  # import what the model's builder and inputs import before the base is read
    bench.build()
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        method = "VmHWM after clear_refs"
    except OSError:
        method = "ru_maxrss (whole process)"
    base = _status_kb("VmRSS")
    model, x, opt, searcher = _setup(bench, batch, variant == "dms")
    out = {"base_mb": base / 1024, "method": method}
    if method.startswith("VmHWM"):  # the peak of building + preparing, then of the steps alone
        out["setup_peak_mb"] = _status_kb("VmHWM") / 1024
        Path("/proc/self/clear_refs").write_text("5")
    for _ in range(steps):
        _step(bench, model, opt, x, searcher)
    if method.startswith("VmHWM"):
        out["steps_peak_mb"] = _status_kb("VmHWM") / 1024
        out["peak_mb"] = max(out["setup_peak_mb"], out["steps_peak_mb"])
    else:
        out["peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def measure_memory(name: str, batch: int, steps: int, threads: int) -> dict[str, dict[str, Any]]:
    """One fresh subprocess per variant (plain, dms)."""
    out = {}
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    for variant in ("plain", "dms"):
        cmd = [sys.executable, "-m", "bench.search_overhead", "--child", name, variant, "--batch", str(batch),
               "--mem-steps", str(steps), "--threads", str(threads)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"memory subprocess for {name}/{variant} failed:\n{proc.stderr[-2000:]}")
        out[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def _row(name: str, batch: int, t: dict[str, float], m: dict[str, dict[str, Any]]) -> str:
    p, d = m["plain"], m["dms"]
    added_p, added_d = p["peak_mb"] - p["base_mb"], d["peak_mb"] - d["base_mb"]
    return (f"| {name} | {batch}x{BENCHES[name].shape} | {t['dims']} | {t['ratio']:.3f} | "
            f"{t['ratio_q1']:.3f}-{t['ratio_q3']:.3f} | {t['plain_ms']:.1f} / {t['dms_ms']:.1f} | "
            f"{p['peak_mb']:.0f} / {d['peak_mb']:.0f} | {d['peak_mb'] / p['peak_mb']:.3f} | "
            f"{added_p:.0f} / {added_d:.0f} | {added_d / added_p if added_p > 0 else float('nan'):.2f} | "
            f"{_steps_ratio(p, d)} | {t['prepare_s']:.2f} | "
            + (f"{t['settle_ratio']:.3f} |" if "settle_ratio" in t else "- |"))


def _table(rows: list[dict[str, Any]], batch: int) -> list[str]:
    return ["| model | input | dims searched | step ratio | ratio q1-q3 | step ms plain / DMS | peak RSS MB "
            "plain / DMS | peak ratio | added MB plain / DMS | added ratio | steps-only peak ratio | prepare (s) "
            "| settle-phase step ratio |",
            "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
            *[_row(r["name"], batch, r["time"], r["mem"]) for r in rows]]


def _steps_ratio(p: dict[str, Any], d: dict[str, Any]) -> str:
    """(peak over the steps alone - base), DMS over plain; '-' where it was not measured."""
    if "steps_peak_mb" not in p or "steps_peak_mb" not in d:
        return "-"
    sp, sd = p["steps_peak_mb"] - p["base_mb"], d["steps_peak_mb"] - d["base_mb"]
    return f"{sd / sp:.2f}" if sp > 0 else "-"


def _protocol(args: argparse.Namespace) -> dict[str, int]:
    return {"threads": args.threads, "rounds": args.rounds, "batch": args.batch, "mem_steps": args.mem_steps}


def write_table(cache: dict[str, Any], args: argparse.Namespace) -> Path:
    rows = [cache["rows"][n] for n in BENCHES if n in cache["rows"]]
    machine = cache["host"]  # the machine the rows were measured on
    methods = sorted({r["mem"][v]["method"] for r in rows for v in ("plain", "dms")})
    lines = [
        "# Cost of the method: a DMS training step vs a plain one (issue 10, table 8)", "",
        "Written by `bench/search_overhead.py`. Step time: each round runs one plain step and one DMS",
        "step (masks on every searched dimension, depth masks, Taylor importance hooks, the",
        "differentiable resource loss) on the same batch in one process, alternating which goes first;",
        "ratio = median(DMS) / median(plain), q1-q3 = quartiles of the per-round ratios. Peak memory:",
        "a fresh subprocess per model and variant; base = RSS with torch and the model's libraries",
        "imported; peak = the resident-set high-water mark over building the model, `dms.prepare` (DMS)",
        f"and {args.mem_steps} training steps, measured as {' and '.join(methods)}; added = peak - base;",
        "steps-only peak ratio = (high-water mark over the training steps alone, reset after building",
        "and `dms.prepare`, - base), DMS over plain: the training footprint without preparation's tracing.",
        "Settle-phase step ratio: a third copy, timed in the same rounds, whose resource loss is at",
        "progress 0.9, inside the settle phase (the default's last 40 %: the band loss on the exact cost,",
        "computed every step), median over plain's median; '-' for rows measured before it existed.", "",
        f"- command: `PYTHONPATH=src:tests python bench/search_overhead.py --threads {args.threads} "
        f"--rounds {args.rounds} --batch {args.batch} --mem-steps {args.mem_steps} --models MODEL ...` (one "
        "invocation per model or several; each row is cached in the json)",
        f"- commits: {', '.join(sorted({'`' + r['commit'] + '`' for r in rows}))}; machine: {machine['platform']}, "
        f"{machine['cpus']} CPUs shared with other jobs, Python {machine['python']}, torch "
        f"{machine['torch']}, {args.threads} thread(s); load average (1 min) when each row started: "
        + ", ".join(f"{r['name']} {r['load']:.1f}" for r in rows),
        f"- seeds: model init 0, batch generator 0; {args.rounds} rounds after 2 warm-up steps; one run "
        "(the spread is the per-round q1-q3, not across runs)", "", *_table(rows, args.batch)]
    before = [cache["before"][n] for n in BENCHES if n in cache.get("before", {})]
    if before:  # the rows of an earlier commit, kept when the table was measured again
        lines += ["", f"Before issue 29's batched masks and masks folded into weights (commits "
                  f"{', '.join(sorted({'`' + r['commit'] + '`' for r in before}))}, the same protocol and "
                  "machine type; a run on another day):", "", *_table(before, args.batch)]
    lines.append("")
    lines += _proxies_section()
    lines += ["", "## Reading", "", READING]
    return write_md(RESULTS / "search_overhead.md", lines)


def _proxies_section() -> list[str]:
    """The device-independent proxies of bench/search_proxies.py (operators per step, bytes
    held for the backward pass, host synchronisations), before and after, and where the GPU
    measurements are."""
    path = RESULTS / "search_proxies.json"
    if not path.exists():
        return []
    from bench.lib.proxy_table import render
    table = render(json.loads(path.read_text())).splitlines()
    start = next(i for i, line in enumerate(table) if line.startswith("| model"))
    return ["## What a step adds, device-independent, before and after (issue 29)", "",
            "From `bench/results/search_proxies.md` (its method and command): operators per training",
            "step (all, and those that launch device work) and bytes held for the backward pass at the",
            "real batch (bf16 autocast), DMS over plain, and host synchronisations per step; 'before' is",
            "the package at 340ec91, 'fused norms' the masked norms compiled (the default on a GPU), and",
            "the last table the step under torch.compile(model). Measured on an NVIDIA H200 (an earlier",
            "commit): `bench/results/gpu_check.md`.", ""] + table[start:]


READING = ("See bench/RESULTS.md (table 8) for the reading of these numbers next to the deployment "
           "latency of the exported models.")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--mem-steps", type=int, default=3)
    ap.add_argument("--models", nargs="+", default=None, choices=list(BENCHES), help="default: every model")
    ap.add_argument("--fresh", action="store_true", help="re-measure models already in the cache")
    ap.add_argument("--memory-only", action="store_true",
                    help="re-measure only the memory of models already in the cache (keeps their step times)")
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)
    ap.add_argument("--table-only", action="store_true", help="only rewrite the md from the json cache")
    add_quick_flags(ap, "search_overhead", "smoke run: small_cnn (or --models), batch 4, 4 rounds, 1 memory step, "
                    "under WORKDIR/quick")
    args = ap.parse_args(argv)
    global RESULTS
    torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(_child(*args.child, args.batch, args.mem_steps, args.threads)))
        return
    RESULTS = quick_mode(args, RESULTS, rounds=4, batch=4, mem_steps=1, models=args.models or ["small_cnn"])
    RESULTS.mkdir(parents=True, exist_ok=True)
    args.models = args.models or list(BENCHES)
    cache_path = RESULTS / "search_overhead.json"
    cache = load_cache(cache_path)
    if args.table_only:  # the protocol of the cached rows, not of these arguments
        saved = argparse.Namespace(**{**vars(args), **cache.get("args", {})})
        print(f"wrote {write_table(cache, saved)}")
        return
    if cache.get("args") != _protocol(args):  # another protocol: start a new table
        cache = {"args": _protocol(args), "rows": {}}
    cache.setdefault("host", host())  # where the rows are measured (kept when rows are added)
    for name in args.models:
        if args.memory_only and name in cache["rows"]:
            cache["rows"][name]["mem"] = measure_memory(name, args.batch, args.mem_steps, args.threads)
            save_cache(cache_path, cache, sort_keys=False)
            print(f"{name}: memory re-measured; wrote {write_table(cache, args)}", flush=True)
            continue
        if name in cache["rows"] and not args.fresh:
            continue
        load, t0 = os.getloadavg()[0], time.perf_counter()
        t = measure_time(BENCHES[name], args.batch, args.rounds)
        m = measure_memory(name, args.batch, args.mem_steps, args.threads)
        cache["rows"][name] = {"name": name, "time": t, "mem": m, "load": load, "commit": git_commit(ROOT),
                               "seconds": round(time.perf_counter() - t0, 1)}
        save_cache(cache_path, cache, sort_keys=False)
        print(_row(name, args.batch, t, m), flush=True)
        print(f"wrote {write_table(cache, args)}", flush=True)


if __name__ == "__main__":
    main()
