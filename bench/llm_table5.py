"""Table 5 analog, longer protocol: SmolLM2-135M at a parameter target, DMS_p against the LLM
pruning baselines with **equal weight steps**, several seeds (issue 10).

    python -m bench.llm_table5 --method dms --target 0.8 --seed 0
    python -m bench.llm_table5 --method taylor --target 0.8 --seed 0
    python -m bench.llm_table5 --table      # rewrite the table from the cache
    python -m bench.llm_table5 --quick      # smoke: dms then taylor, under bench/runs/
    python -m bench.llm_table5 --name llm_table5_long --search-steps 60 \
        --finetune-steps 240 --method shortgpt --weight-steps 300   # a longer budget, its own table

One arm per invocation, cached as ``bench/results/llm_table5/{method}_t{target}_s{seed}.json``
(so two invocations can run side by side, one per core, and the table is built arm by arm).

The arms are the ones of ``bench/llm_baselines.py`` (the short table 5): ``dms`` (the
pipeline p of ``bench/smollm2_prune.py`` at the library's defaults, the settle phase
included (annealing alone in the cached tables, which ran before ``SearchConfig.settle_hold``;
``--settle-hold`` with a ``--name`` of its own for the current default): search with logits-KL distillation, export, finetune with the same distillation),
``dms_ffn`` (the same DMS run with every attention module excluded: FFN units per layer and
depth, the search space of the Torch-Pruning arm plus depth; a comparison of search spaces, not
a protocol setting), ``dms_widths`` (an ablation of DMS, not a baseline: the per-layer KV groups
and FFN units (and the kept layers) that the ``dms`` arm of the same target and seed exported,
the units chosen in the original by the Taylor importance of ``taylor``, then the baselines'
finetune of as many weight steps: DMS's structure without its search's unit choice and trained
weights), ``taylor`` (LLM-Pruner-style, uniform per layer), ``tp_taylor`` (the Torch-Pruning package's
Taylor pruner, uniform per layer, FFN units only on this GQA model), ``tp_hidden`` (the same
package in its LLM example's scope: the hidden size and the FFN units at one ratio), ``minitron``
(Minitron's activation importance of query heads, FFN units and hidden channels, uniform widths:
``bench/lib/llm_minitron.py``; ``minitron_keep_heads`` the same with every head kept), ``magnitude``
(L2, uniform), ``shortgpt``
(block-influence layer removal) and ``original`` (the unpruned model, finetuned: a reference).
What differs from the short table: ``--search-steps`` and ``--finetune-steps`` (default 30 and
40 instead of 5 and 4), several seeds, 8,192 held-out tokens, and **every baseline finetunes
for as many weight steps as the DMS run of the same target and seed took in all** (search +
finish + finetune; read from its cache, so run ``dms`` first): DMS's search trains the weights
too, and the short table showed that ShortGPT closes most of the gap once given those steps.
The seed sets the batches of every phase (the calibration batches of Taylor, Minitron and
ShortGPT use their own fixed seed).

``--quick`` is a smoke run of ``dms`` then ``taylor`` (2 search + 1 finetune steps of 2 x 32
tokens, 128 held-out tokens) whose run directories, cache and table go to ``WORKDIR/quick/``
(``--workdir``, default ``bench/runs/llm_table5/``); nothing of ``bench/results`` is written.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
from bench.lib import llm_baselines_runs as llm_baselines  # noqa: E402
from bench.lib import smollm2_runs as smollm2_prune  # noqa: E402
from bench.lib.benchlib import (add_quick_flags, hand_reading, paired_ci, pyplot, quick_mode, save_cache,  # noqa: E402
                      save_figure, write_md)

RESULTS = ROOT / "bench" / "results"
CACHE = RESULTS / "llm_table5"
METHODS = ("dms", "dms_ffn", "dms_widths", "taylor", "tp_taylor", "tp_hidden", "minitron", "minitron_keep_heads",
           "magnitude", "shortgpt", "original")
DMS = ("dms", "dms_ffn")  # DMS in its default search space, and with the attention widths fixed
ATTENTION = [f"lm.model.layers.{i}.self_attn" for i in range(30)]  # SmolLM2's 30 layers
BASELINES = llm_baselines.BASELINES
ANNEAL_TABLES = ("llm_table5", "llm_table5_long")  # their DMS rows: settle phase without the hold
LABEL = {**llm_baselines.LABEL, "dms": "DMS_p + distillation (per-layer widths, settle default)",
         "dms_ffn": "DMS_p, FFN units and depth only (attention widths fixed)",
         "dms_widths": "DMS_p's per-layer widths, Taylor units of the original, finetuned (structure alone)"}


def _epochs(steps: int, args: argparse.Namespace) -> float:
    """The epoch fraction that the pipeline turns into exactly ``steps`` steps
    (``ceil(epochs * steps_per_epoch)``, 1,407,001 training tokens)."""
    spe = 1_407_001 // (args.batch_size * args.seq_len)
    return (steps - 0.5) / spe


def _path(method: str, target: float, seed: int, cache: Path = CACHE) -> Path:
    return cache / f"{method}_t{target}_s{seed}.json"


def _dms_record(args: argparse.Namespace, why: str) -> dict[str, Any]:
    """The cached ``dms`` arm of ``args``' target and seed; exits naming ``why`` it is needed."""
    path = _path("dms", args.target, args.seed, args.cache)
    if not path.is_file():
        sys.exit(f"run the DMS arm first: --method dms --target {args.target} --seed {args.seed} "
                 f"({why}; {path} is missing)")
    return json.loads(path.read_text())


def _dms_weight_steps(args: argparse.Namespace) -> int:
    if args.weight_steps:  # given ahead, to run beside the DMS arm; the table checks they agree
        return args.weight_steps
    rec = _dms_record(args, "the baselines finetune as many weight steps as it took in all")
    return sum(rec["phase_steps"].values())


def run_arm(args: argparse.Namespace) -> dict[str, Any]:
    """One arm for (target, seed); returns the cached record."""
    out = args.out or tempfile.mkdtemp(prefix="table5-")
    if args.method in DMS:
        ns = argparse.Namespace(
            exclude_extra=ATTENTION if args.method == "dms_ffn" else [],
            target=args.target, epochs=_epochs(args.search_steps, args),
            retrain_epochs=_epochs(args.finetune_steps, args), seq_len=args.seq_len,
            batch_size=args.batch_size, test_limit=args.test_limit, structure_lr=0.1,
            resource_weight=50.0, distill_hidden=0.0, threads=args.threads, layer_uniform=False,
            out=out, settle=args.settle, settle_hold=args.settle_hold, seed=args.seed,
            distill_weight=args.distill_weight, lr=args.lr)
        res = smollm2_prune.run(ns)
        run_dir = Path(out) / f"target{args.target}"  # where smollm2_prune.run wrote the run
        res.update(method=args.method, target=args.target, seed=args.seed, settle_hold=args.settle_hold,
                   structure=structure_summary(run_dir / "structure.json"),
                   search_end=search_end(run_dir / "summary.json"),
                   weight_steps=sum(res["phase_steps"].values()),
                   params_found=res["params"]["found"], supernet=res["params"]["supernet"])
        return res
    steps = _dms_weight_steps(args) if args.method != "original" else args.search_steps + args.finetune_steps
    widths = _dms_widths(args) if args.method == "dms_widths" else None
    ns = argparse.Namespace(method=args.method, prune="per_layer_taylor" if widths else args.method,
                            widths=widths, target=args.target if args.method != "original" else 1.0,
                            calib_batches=2, retrain_epochs=_epochs(steps, args), seq_len=args.seq_len,
                            batch_size=args.batch_size, test_limit=args.test_limit,
                            threads=args.threads, out=out, seed=args.seed,
                            distill_weight=args.distill_weight, lr=args.lr)
    if args.method == "original":
        _original(args)  # llm_baselines reads the original's evaluation from the DMS arm's cache
    res = llm_baselines.run(ns)
    res.update(seed=args.seed, weight_steps=res["finetune_steps"], params_found=res["params"])
    return res


def _dms_widths(args: argparse.Namespace) -> dict[str, list[int]]:
    """The decoder layers, and per kept layer the KV groups and FFN units, that the DMS arm of
    the same target and seed exported (from its cache). A shallower export needs the record's
    ``kept_layers`` (written since the DMS arm records it; older records do not say which
    layers went)."""
    s = _dms_record(args, "dms_widths keeps its per-layer widths")["structure"]
    kept = s.get("kept_layers", list(range(30)) if len(s["ffn"]) == 30 else None)
    if kept is None or not len(kept) == len(s["ffn"]) == len(s["kv_groups"]):
        sys.exit(f"{_path('dms', args.target, args.seed, args.cache)}: the DMS export kept {len(s['ffn'])} of 30 "
                 "layers and its record does not say which: run the DMS arm again (it records them now)")
    return {"kv_groups": s["kv_groups"], "ffn": s["ffn"], "kept_layers": kept}


def structure_summary(path: Path) -> dict[str, list[int]]:
    """What a DMS export kept of SmolLM2 (from the run's ``structure.json``): decoder layers,
    and per kept layer the KV groups (of 3) and FFN units (of 1536), removed layers left out."""
    s = json.loads(path.read_text())
    kept = {name for d in s.get("depth", []) for name in d["kept"]}  # "lm.model.layers.7", ...
    layer = lambda w: w["name"].split(".self_attn")[0].split(".mlp")[0]  # noqa: E731
    alive = [w for w in s["width"] if not s.get("depth") or layer(w) in kept]
    index = lambda name: int(name.rsplit(".", 1)[1])  # noqa: E731 - "lm.model.layers.7" -> 7
    return {"layers": [len(d["kept"]) for d in s.get("depth", [])],
            "kept_layers": sorted(index(n) for n in kept) if kept else list(range(30)),
            "kv_groups": [w["kept"] for w in alive if w["name"].endswith("heads")],
            "ffn": [w["kept"] for w in alive if ".mlp." in w["name"]]}


def search_end(path: Path) -> float:
    """The exact cost where the search alone ended, over the target (before finish and solver)."""
    end = json.loads(path.read_text())["resources_search_end"]
    return end["hard"] / end["target"]


def _original(args: argparse.Namespace) -> dict[str, float]:
    path = smollm2_prune.CACHE / f"original_seq{args.seq_len}_test{args.test_limit}.json"
    if not path.is_file():
        sys.exit(f"{path} is missing: run the DMS arm first (it evaluates the original once)")
    return json.loads(path.read_text())


def _records(cache: Path) -> list[dict[str, Any]]:
    return [json.loads(f.read_text()) for f in sorted(cache.glob("*_t*_s*.json"))]


def _ppl(r: dict[str, Any]) -> float:
    return r["after"]["ppl"]


def _table(recs: list[dict[str, Any]]) -> list[str]:
    lines = ["| target | method | seeds | parameters | weight steps | ppl before FT | ppl after FT "
             "(mean, per seed) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    order = {m: i for i, m in enumerate(METHODS)}
    keys = sorted({(r["target"], r["method"]) for r in recs}, key=lambda k: (-k[0], order[k[1]]))
    for t, m in keys:
        rs = sorted((r for r in recs if r["target"] == t and r["method"] == m), key=lambda r: r["seed"])
        sup = rs[0]["supernet"]
        params = statistics.mean(r["params_found"] for r in rs)
        after = [_ppl(r) for r in rs]
        per = ", ".join(f"s{r['seed']} {_ppl(r):.1f}" for r in rs)
        tgt = "100 %" if m == "original" else f"{t:.0%}"
        lines.append(f"| {tgt} | {LABEL[m]} | {len(rs)} | {params / 1e6:.2f}M ({params / sup:.1%}) | "
                     f"{'/'.join(sorted({str(r['weight_steps']) for r in rs}))} | "
                     f"{statistics.mean(r['before']['ppl'] for r in rs):.1f} | "
                     f"**{statistics.mean(after):.1f}** ({per}) |")
    return lines


def _arm(recs: list[dict[str, Any]], method: str, target: float) -> dict[int, float]:
    """Perplexity after finetuning by seed, of one arm at one target."""
    return {r["seed"]: _ppl(r) for r in recs if r["method"] == method and r["target"] == target}


def _best_baseline(recs: list[dict[str, Any]], target: float) -> tuple[str, dict[int, float]] | None:
    """The baseline of lowest mean perplexity at ``target`` (the first of ``BASELINES`` on a
    tie) and its perplexity by seed; None if no baseline ran there."""
    arms = [(m, _arm(recs, m, target)) for m in BASELINES]
    arms = [(m, b) for m, b in arms if b]
    return min(arms, key=lambda mb: statistics.mean(mb[1].values())) if arms else None


def _gaps(recs: list[dict[str, Any]]) -> list[str]:
    """Per target: DMS's perplexity after finetuning against the best baseline (by mean), paired
    by seed; the issue's bar is >= 20 % lower at 80 %."""
    out = []
    for d, t in sorted({(r["method"], r["target"]) for r in recs if r["method"] in DMS},
                       key=lambda k: (-k[1], DMS.index(k[0]))):
        dms = _arm(recs, d, t)
        best = _best_baseline(recs, t)
        if best is None:
            continue
        m, b = best
        seeds = sorted(set(dms) & set(b))
        rel = [1 - dms[s] / b[s] for s in seeds]
        steps = {(r["method"], r["seed"]): r["weight_steps"] for r in recs if r["target"] == t}
        odd = [f"seed {s}: {steps[d, s]} vs {steps[m, s]}" for s in seeds if steps[d, s] != steps[m, s]]
        unequal = f" NOT at equal weight steps ({'; '.join(odd)})" if odd else ""
        ci = ""
        if len(rel) > 1:
            mean, lo, hi, _ = paired_ci(rel)
            ci = f", 95 % CI [{lo:+.1%}, {hi:+.1%}]"
        out.append(f"- {t:.0%}: {'DMS' if d == 'dms' else LABEL[d]} vs the best baseline ({LABEL[m]}), paired over seeds "
                   f"{', '.join(map(str, seeds))}: perplexity lower by "
                   + ", ".join(f"{x:+.1%}" for x in rel)
                   + (f" (mean {statistics.mean(rel):+.1%}{ci})" if len(rel) > 1 else "")
                   + f"; the issue's bar is >= 20 % at 80 %.{unequal}")
    return out


def _against(w: dict[int, float], label: str, other: dict[int, float]) -> str | None:
    """``w``'s perplexity relative to ``other``'s, paired by seed: mean, per seed, and the 95 %
    interval when two or more seeds pair (None when none does)."""
    seeds = sorted(set(w) & set(other))
    if not seeds:
        return None
    rel = [w[s] / other[s] - 1 for s in seeds]
    ci = ""
    if len(rel) > 1:
        _, lo, hi, _ = paired_ci(rel)
        ci = f"; 95 % CI [{lo:+.1%}, {hi:+.1%}]"
    return (f"{statistics.mean(rel):+.1%} against {label} (seeds "
            f"{', '.join(map(str, seeds))}: {', '.join(f'{x:+.1%}' for x in rel)}{ci})")


def _structure_alone(recs: list[dict[str, Any]]) -> list[str]:
    """Per target: DMS's per-layer widths given to a plain finetune of the original (Taylor
    units, ``dms_widths``) against DMS itself and the best baseline, paired by seed: how much of
    DMS's margin its structure carries, and how much its search's units and trained weights."""
    out = []
    for t in sorted({r["target"] for r in recs if r["method"] == "dms_widths"}, reverse=True):
        w = _arm(recs, "dms_widths", t)
        rows = [("DMS", _arm(recs, "dms", t))]
        best = _best_baseline(recs, t)
        if best is not None:
            rows.append((LABEL[best[0]], best[1]))
        parts = [p for label, other in rows if (p := _against(w, label, other))]
        if parts:
            out.append(f"- {t:.0%}, DMS's widths alone (finetuned from the original): perplexity "
                       + "; ".join(parts) + ".")
    return out


def _minitron(recs: list[dict[str, Any]]) -> list[str]:
    """Per target: the Minitron-style arm against DMS, the best other baseline and ``tp_hidden``
    (the same scope, hidden size and FFN units, chosen by Taylor importance), paired by seed."""
    out = []
    for t in sorted({r["target"] for r in recs if r["method"] == "minitron"}, reverse=True):
        w = _arm(recs, "minitron", t)
        others = [(m, _arm(recs, m, t)) for m in BASELINES if m != "minitron"]
        others = [(m, b) for m, b in others if b]
        rows = [("DMS", _arm(recs, "dms", t))]
        if others:
            m, b = min(others, key=lambda mb: statistics.mean(mb[1].values()))
            rows.append((LABEL[m], b))
        if rows[-1][0] != LABEL["tp_hidden"]:
            rows.append((LABEL["tp_hidden"], _arm(recs, "tp_hidden", t)))
        parts = [p for label, other in rows if (p := _against(w, label, other))]
        if parts:
            out.append(f"- {t:.0%}, Minitron-style activation pruning: perplexity " + "; ".join(parts) + ".")
    return out


def _structures(recs: list[dict[str, Any]]) -> list[str]:
    """One line per DMS run: what it kept (the baselines' structures are fixed by their rule:
    uniform widths, or whole layers)."""
    out = []
    for r in sorted((r for r in recs if r["method"] in DMS and "structure" in r),
                    key=lambda r: (-r["target"], DMS.index(r["method"]), r["seed"])):
        s = r["structure"]
        ffn, kv = s["ffn"], s["kv_groups"]
        landed = (f"search ended at {r['search_end']:.3f} x the target, exported at "
                  f"{r['cost']['hard'] / r['cost']['target']:.3f}; ") if "search_end" in r else ""
        heads = (f"KV groups {sum(kv)}/{3 * 30} (per kept layer {min(kv)}-{max(kv)}), " if kv
                 else "attention kept, ")
        out.append(f"- {'DMS' if r['method'] == 'dms' else 'DMS, FFN only,'} {r['target']:.0%} seed {r['seed']}: "
                   f"{landed}{sum(s['layers'])}/30 layers, {heads}FFN units {sum(ffn):,}/"
                   f"{1536 * 30:,} (per kept layer {min(ffn)}-{max(ffn)}; first three layers "
                   f"{', '.join(map(str, ffn[:3]))})")
    return out


def _plot(recs: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for m in METHODS:
        rs = [r for r in recs if r["method"] == m]
        if rs:
            ax.scatter([r["params_found"] / r["supernet"] for r in rs], [_ppl(r) for r in rs],
                       label=LABEL[m], s=22)
    ax.set_xlabel("parameters / SmolLM2-135M")
    ax.set_ylabel("held-out perplexity after finetuning")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax.set_title("SmolLM2-135M, equal weight steps (one point per seed)", fontsize=9)
    save_figure(fig, path)


def write_markdown(cache: Path = CACHE, name: str = "llm_table5", out: Path = RESULTS) -> Path:
    """``out/{name}.md``, ``.json`` and ``.png`` from every cached arm."""
    recs = _records(cache)
    if not recs:
        sys.exit(f"no cached arm in {cache}")
    r0 = next((r for r in recs if r["method"] == "dms"), recs[0])
    a = r0["args"]
    cmds = sorted({"    PYTHONPATH=src python bench/llm_table5.py " + (
        " ".join(r["argv"]) if "argv" in r else
        f"--method {r['method']} --target {r['target']} --seed {r['seed']}") for r in recs})
    lines = ["# Table 5 analog, longer protocol: SmolLM2-135M, DMS_p vs LLM pruning baselines, "
             "equal weight steps", "",
             "Written by `bench/llm_table5.py` (protocol in its docstring); `--table` rewrites it "
             f"from `bench/results/{cache.name}/`. Commands:", "", *cmds, "",
             f"Commits: {', '.join(sorted({'`' + r['commit'] + '`' for r in recs}))}; machine: "
             f"{r0['machine']}, {r0['cpus']} CPU cores, 1 torch thread per arm (two arms side by "
             "side), float32, no GPU.", "",
             f"Data: {r0['task']}. Batches of {a['batch_size']} x {a['seq_len']} tokens; "
             f"{a['test_limit']} held-out tokens; AdamW lr 1e-4 cosine with logits-KL "
             "distillation from a frozen copy of the original in every arm's finetune (and in "
             "DMS's search). Weight steps: DMS search + finish + finetune; every baseline "
             "finetunes that many steps (same target and seed).", ""]
    lines += _table(recs) + [""] + _gaps(recs) + _structure_alone(recs) + _minitron(recs)
    lines += ["", "What DMS kept:", ""] + _structures(recs)
    notes = hand_reading(RESULTS / f"{name}_notes.md", strip=False)
    if notes is not None:
        lines += ["", notes]
    md = write_md(out / f"{name}.md", lines)
    keep = ("method", "target", "seed", "params_found", "supernet", "weight_steps", "before", "after")
    save_cache(out / f"{name}.json", [{k: r[k] for k in keep} for r in recs], sort_keys=False)
    _plot(recs, out / f"{name}.png")
    return md


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--method", choices=METHODS, default="dms")
    p.add_argument("--target", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--search-steps", type=int, default=30)
    p.add_argument("--finetune-steps", type=int, default=40)
    p.add_argument("--settle", type=float, default=0.4, help="DMS's settle phase (the library default)")
    p.add_argument("--settle-hold", action="store_true",
                   help="hold DMS's structure while the exact cost is inside the band (the library default "
                        "since it was added; the cached rows ran without it, the settle phase annealing alone)")
    p.add_argument("--distill-weight", type=float, default=None, metavar="W",
                   help="weight of the logits-KL distillation in every arm (default: the library's, 1)")
    p.add_argument("--lr", type=float, default=None,
                   help="peak lr of every arm's weights (default: the library's, 1e-4 for AdamW on hf:)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--test-limit", type=int, default=8192)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="scratch run directory (default: a temp dir)")
    p.add_argument("--weight-steps", type=int, default=0, metavar="N",
                   help="a baseline's finetune steps given ahead (default: read from the DMS arm's "
                        "cache); the table flags a baseline whose steps differ from DMS's")
    p.add_argument("--name", default="llm_table5",
                   help="the table: cache bench/results/NAME/, NAME.md, .json, .png")
    p.add_argument("--table", action="store_true", help="only rewrite the table from the cache")
    add_quick_flags(p, "llm_table5", "smoke run of dms then taylor: 2 + 1 steps of 2 x 32 tokens, 128 test "
                    "tokens, under WORKDIR/quick", "runs, cache and table")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    if args.settle_hold and args.name in ANNEAL_TABLES:
        p.error(f"the cached DMS rows of {args.name} ran without the hold (the settle phase annealing "
                f"alone): give the held runs a table of their own, e.g. --name {args.name}_hold")
    global RESULTS
    RESULTS = quick_mode(args, RESULTS, search_steps=2, finetune_steps=1, test_limit=128, seq_len=32, batch_size=2)
    args.cache = RESULTS / args.name
    if args.quick:  # nothing of bench/results is written: the runs and the DMS arm's cache go beside the table
        args.out = str(RESULTS / "runs")
        smollm2_prune.CACHE = llm_baselines.DMS_CACHE = args.cache
    args.cache.mkdir(parents=True, exist_ok=True)
    for method in (("dms", "taylor") if args.quick else () if args.table else (args.method,)):
        args.method = method
        res = run_arm(args)
        res["quick"], res["argv"] = args.quick, argv
        save_cache(_path(method, args.target, args.seed, args.cache), res, sort_keys=False)
        print(json.dumps({k: res[k] for k in ("method", "target", "seed", "params_found",
                                              "weight_steps", "before", "after")}))
    print(write_markdown(args.cache, args.name, RESULTS).read_text())


if __name__ == "__main__":
    main()
