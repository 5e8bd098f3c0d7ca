"""Issue 56, item 1: what moves each dimension's ratio in DMS_p's search, residual streams
against a block's own widths, from the search trace (``search_trace.jsonl``).

    python -m bench.search_trace_diag --width 4 --target 0.5 --seeds 0 1 2 3 4 [--table-only]

Per seed, the DMS_p search of ``bench/peers.py``'s protocol (``--pipeline p --init`` the seed's
pretrained supernet of ``peers_diag``, 2 epochs, ``--settle 0.4 --settle-hold``, no retrain) is
run again with its trace (the trace changes no value of the search, so it is the search whose
structure ``peers_diag.md`` finetuned). Per dimension class (residual stream / a block's own
width / depth) and over the search phase's traced steps: the mean task- and resource-loss
gradients on the ratio, their ratio, the cost per element, the raw importance per unit and the
kept fraction at the end. Cached in ``bench/results/search_trace_diag.json``; the table goes to
``search_trace_diag.md`` and the per-dimension traces of seed 0 to ``search_trace_diag_*.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
from bench.lib.benchlib import command_line, git_commit, load_cache, mean_std, save_cache, shared_machine, widths, write_md  # noqa: E402
from dmscale.config.run_config import RunConfig  # noqa: E402
from dmscale.run.pipeline import Pipeline  # noqa: E402
from dmscale.run.report_plots import write_plots  # noqa: E402
from dmscale.search.search_trace import read_trace  # noqa: E402

RESULTS = ROOT / "bench" / "results"
CACHE = RESULTS / "search_trace_diag.json"
WORK = ROOT / "bench" / "runs" / "peers_diag"


def kind_of(dim: dict[str, Any]) -> str:
    """residual (a width two or more blocks write), own (one layer's), or depth."""
    if dim["kind"] == "depth":
        return "depth"
    return "residual" if "residual stream" in dim["label"] else "own"


def run_search(width: int, target: float, seed: int, threads: int) -> Path:
    pre = WORK / f"w{width}" / "pretrain10.0" / f"seed{seed}"
    if not (pre / "summary.json").is_file():
        raise SystemExit(f"no pretrained supernet at {pre}: run bench/peers.py --name peers_diag --width {width} first")
    out = WORK / "trace" / f"w{width}-t{target}" / f"seed{seed}"
    if not (out / "summary.json").is_file():
        cfg = RunConfig(command="search", task="digits", model="resnet", model_args={"width": width},
                        pipeline="p", init=str(pre), epochs=2.0, retrain_epochs=0, target=target, seed=seed,
                        threads=threads, settle=0.4, settle_hold=True, quiet=True, out=str(out))
        Pipeline(cfg.resolved()).run()
    return out


def summarise(run: Path) -> dict[str, Any]:
    dims, records = read_trace(run)
    rows = [r for r in records if r["phase"] == "search"]
    per_dim = []
    for i, d in enumerate(dims):
        task = statistics.mean(r["grad_task"][i] for r in rows)
        res = statistics.mean(r["grad_resource"][i] for r in rows)
        per_dim.append({"name": d["name"], "label": d["label"], "class": kind_of(d), "size": d["size"],
                        "grad_task": task, "grad_resource": res,
                        "cost_per_element": statistics.mean(r["cost_per_element"][i] for r in rows),
                        "importance": statistics.mean(r["importance_mean"][i] for r in rows),
                        "kept_end": rows[-1]["kept"][i] / d["size"]})
    structure = json.loads((run / "structure.json").read_text())
    summary = json.loads((run / "summary.json").read_text())
    end = summary.get("resources_search_end") or {}
    peers = json.loads((RESULTS / "peers_diag.json").read_text())["runs"]
    key = next(k for k in peers if k.startswith(f"w{run.parent.name.split('-')[0][1:]}-t{run.parent.name.split('-t')[1]}-"))
    cached = peers[key].get(run.name.removeprefix("seed"), {}).get("dms_p", {}).get("structure")
    return {"dims": per_dim, "steps": len(rows), "same_as_peers_diag": cached == widths(structure),
            "search_end": end["hard"] / end["target"] if end else None,
            "final": {w["name"]: w["kept"] / w["size"] for w in structure["width"]}}


def write_table(cache: dict[str, Any]) -> Path:
    lines = ["# What moves each dimension in DMS_p's search (issue 56, item 1)", "",
             f"- machine: {cache['machine']}; commit {cache['commit']}",
             "- per seed, DMS_p's search of `peers_diag.md` (ResNet-20, `--pipeline p --init` the seed's "
             "supernet, 2 epochs, `--settle 0.4 --settle-hold`) rerun with its trace; means over the "
             "search phase's traced steps, then over the dims of a class, then mean ± std over seeds",
             "- gradients are d(loss)/d(a) on the dim's ratio: the task part > 0 keeps elements, the "
             "resource part < 0 removes them; |task / resource| < 1: the dim is pushed to shrink; cost "
             "per element in MACs; importance = raw Taylor importance per unit (Eq. 4), which Eq. 2's "
             "rank normalisation spreads on [0, 1) for every dim alike", ""]
    for key, setting in sorted(cache["settings"].items()):
        seeds = sorted(setting["runs"], key=int)
        lines += [f"## {key} (seeds {', '.join(seeds)})", "",
                  f"- commands: `{setting['command']}`",
                  "- search steps traced: " + mean_std([setting["runs"][s]["steps"] for s in seeds], "{:.0f}")
                  + "; hard cost / target at the search's end (before the finish phase and solver): "
                  + mean_std([setting["runs"][s]["search_end"] or float("nan") for s in seeds], "{:.2f}"),
                  f"- the structure equals the one `peers_diag.md` finetuned (dms_p, same seed) on "
                  f"{sum(bool(setting['runs'][s].get('same_as_peers_diag')) for s in seeds)} of {len(seeds)} seeds", "",
                  "| class | dims | task grad | resource grad | task / resource | cost per element (MACs) "
                  "| importance per unit | kept at the search's end | kept in the structure |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for cls in ("residual", "own", "depth"):
            def per_seed(field: str, s: str) -> float:
                ds = [d for d in setting["runs"][s]["dims"] if d["class"] == cls]
                return statistics.mean(d[field] for d in ds)

            def ratio(s: str) -> float:
                ds = [d for d in setting["runs"][s]["dims"] if d["class"] == cls]
                return statistics.mean(abs(d["grad_task"] / d["grad_resource"]) if d["grad_resource"] else 0.0
                                       for d in ds)
            n = len([d for d in setting["runs"][seeds[0]]["dims"] if d["class"] == cls])
            final = [statistics.mean(v for k, v in setting["runs"][s]["final"].items()
                                     if any(d["name"] == k and d["class"] == cls for d in setting["runs"][s]["dims"]))
                     for s in seeds] if cls != "depth" else None
            lines.append(f"| {cls} | {n} | {mean_std([per_seed('grad_task', s) for s in seeds], '{:.3g}')} | "
                         f"{mean_std([per_seed('grad_resource', s) for s in seeds], '{:.3g}')} | "
                         f"{mean_std([ratio(s) for s in seeds], '{:.2f}')} | "
                         f"{mean_std([per_seed('cost_per_element', s) for s in seeds], '{:,.0f}')} | "
                         f"{mean_std([per_seed('importance', s) for s in seeds], '{:.2e}')} | "
                         f"{mean_std([per_seed('kept_end', s) for s in seeds], '{:.2f}')} | "
                         + (mean_std(final, '{:.2f}') if final else "-") + " |")
        lines += ["", f"![per-dimension trace, seed {seeds[0]}](search_trace_diag_{key}.png)", ""]
    reading = RESULTS / "search_trace_diag_reading.md"
    if reading.is_file():
        lines += [reading.read_text().strip(), ""]
    return write_md(RESULTS / "search_trace_diag.md", lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=4)
    p.add_argument("--target", type=float, default=0.5)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--table-only", action="store_true")
    args = p.parse_args(argv)
    cache = load_cache(CACHE, {"settings": {}})
    key = f"w{args.width}-t{args.target}"
    if not args.table_only:  # the commit and machine the runs ran on
        cache.update(commit=git_commit(ROOT), machine=shared_machine(f"{args.threads} thread(s)"))
        setting = cache["settings"].setdefault(key, {"runs": {}})
        setting["command"] = command_line("-m bench.search_trace_diag", argv)
        for seed in args.seeds:
            run = run_search(args.width, args.target, seed, args.threads)
            setting["runs"][str(seed)] = summarise(run)
            if seed == args.seeds[0]:  # the report's trace plot of the first seed
                (run / "plots").mkdir(exist_ok=True)
                write_plots(run, None, [], False, read_trace(run))
                (RESULTS / f"search_trace_diag_{key}.png").write_bytes((run / "plots" / "search_trace.png").read_bytes())
            save_cache(CACHE, cache)
            print(f"seed {seed}: {setting['runs'][str(seed)]['steps']} traced steps", flush=True)
    print(f"wrote {write_table(cache)}")


if __name__ == "__main__":
    main()
