"""The result numbers of the documents, generated from the benchmark caches.

    PYTHONPATH=src python scripts/doc_numbers.py            # --check: exit 1 on any disagreement
    PYTHONPATH=src python scripts/doc_numbers.py --write    # rewrite every marked span from the caches
    PYTHONPATH=src python scripts/doc_numbers.py --list     # every key and its value
    PYTHONPATH=src python scripts/doc_numbers.py --check README.md   # some documents only

A generated number sits in a marked span of a markdown document (an HTML comment, invisible
on GitHub and in the site)::

    <!-- num:peers.w8.t0.25 -->+2.45 pt over the best peer, 95 % CI [1.50, 3.41]<!-- /num -->

and a table in the block form (blank lines inside the markers, so the table stays a table)::

    <!-- num:default_run.table -->

    | ... |

    <!-- /num -->

The key names a function of this module (``@number("peers.w8.t0.25")``) that computes the
span's text from ``bench/results`` with the benchmark scripts' own helpers (``benchlib``'s
``paired_ci`` / ``mean_std``, each script's selection of seeds and baselines), so the text a
document shows is the text the caches give. ``--check`` lists every span whose text differs
(file, line, key, the document's text and the cache's) and exits 1; ``--write`` puts the
cache's text in. Prose around the spans stays hand-written; what a span holds is generated.
To add a number: write its function here, put the markers around it in the document, run
``--write``. ``tests/bench/test_doc_numbers.py`` runs the check on the committed documents.
"""

from __future__ import annotations

import argparse
import functools
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
RESULTS = BENCH / "results"
for _p in (BENCH, BENCH / "lib", ROOT / "src"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from benchlib import load_cache, mean_std, paired_ci, paired_diff  # noqa: E402

__all__ = ["DOCUMENTS", "SPAN", "NUMBERS", "Disagreement", "number", "value", "spans", "check", "write", "main",
           "LATENCY_BAND", "latency_target_text", "STEP_GOAL", "gpu_step_text"]

DOCUMENTS = ("README.md", "docs/benchmarks.md", "docs/search.md", "docs/gpus.md", "docs/deploy.md",
             "bench/RESULTS.md")
SPAN = re.compile(r"<!-- num:(?P<key>[\w.@-]+) -->(?P<text>.*?)<!-- /num -->", re.S)
NUMBERS: dict[str, Callable[[], str]] = {}


def number(key: str) -> Callable[[Callable[[], str]], Callable[[], str]]:
    """Register the function that computes the span ``key``."""
    def register(fn: Callable[[], str]) -> Callable[[], str]:
        if key in NUMBERS:
            raise ValueError(f"duplicate number key {key!r}")
        NUMBERS[key] = fn
        return fn
    return register


@functools.cache
def value(key: str) -> str:
    """The text of span ``key`` from the caches (KeyError for an unknown key)."""
    return NUMBERS[key]()


@functools.cache
def cache(name: str) -> dict[str, Any]:
    """``bench/results/NAME.json`` (read once)."""
    path = RESULTS / f"{name}.json"
    if not path.is_file():
        raise FileNotFoundError(f"no cache {path.relative_to(ROOT)}")
    return load_cache(path)


# ---------------------------------------------------------------- formatting


def ci(diffs: list[float], digits: int = 2) -> tuple[float, str]:
    """``(mean, "+m [lo, hi]")`` of paired differences with their 95 % t-interval (benchlib.paired_ci)."""
    mean, lo, hi, _ = paired_ci(diffs)
    return mean, f"{mean:+.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def resolved(diffs: list[float]) -> bool:
    """The 95 % interval of the paired differences excludes 0."""
    _, lo, hi, _ = paired_ci(diffs)
    return lo > 0 or hi < 0


def pm(values: list[float], digits: int = 1) -> str:
    """``mean ± std`` (benchlib.mean_std)."""
    return mean_std(values, f"{{:.{digits}f}}")


def mean(values: Any) -> float:
    return statistics.mean(list(values))


def span_of(values: list[float], fmt: str = "{:.2f}", sep: str = "-") -> str:
    """``min-max`` of ``values`` (one value when they are equal in ``fmt``)."""
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return lo if lo == hi else f"{lo}{sep}{hi}"


# ---------------------------------------------------------------- the default run


def _default() -> dict[str, Any]:
    return cache("default_run")


def _minutes(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m} min {s} s" if m else f"{s} s"


def _si(n: float) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"


@number("default_run.where")
def _default_where() -> str:
    d = _default()
    env = d["env"]
    cores = env["machine"].split()[0]
    threads = env["threads"]
    load = d.get("load_average")
    busy = (" shared with other jobs", f"load average {load[0]:.1f}; ") if load and load[0] >= 1 else ("", "")
    return (f"On {cores} CPU cores{busy[0]} ({busy[1]}seed {d['seed']}, {threads} thread{'s' if threads != 1 else ''}, "
            f"commit `{env['commit']}`), {_minutes(d['wall_seconds'])}")


@number("default_run.table")
def _default_table() -> str:
    d = _default()
    c, target = d["counts"], d["search_end"]["target"]
    return "\n".join([
        "| | supernet | found |", "| --- | ---: | ---: |",
        f"| MACs (one image) | {_si(c['supernet']['macs'])} | {_si(c['found']['macs'])} (target {_si(target)}) |",
        f"| parameters | {_si(c['supernet']['params'])} | {_si(c['found']['params'])} |",
        f"| MNIST test accuracy | | {100 * d['acc_search']:.2f}% after search, "
        f"**{100 * d['acc_retrain']:.2f}%** after retraining |"])


@number("default_run.table_blocks")
def _default_table_blocks() -> str:
    d = _default()
    b = d["blocks"]
    removed = b["removed"]
    words = {1: "one", 2: "two", 3: "three", 4: "four"}
    per = [(s, sum(r.startswith(s + ".") for r in removed)) for s in b["stages"]]
    parts = [f"{words.get(n, n)} {'block' if n == 1 else 'blocks'} of {s}" if i == 0 else f"{words.get(n, n)} of {s}"
             for i, (s, n) in enumerate((s, n) for s, n in per if n)]
    what = "none removed" if not parts else " and ".join([", ".join(parts[:-1]), parts[-1]] if len(parts) > 1
                                                          else parts) + " removed"
    lines = value("default_run.table").split("\n")
    row = (f"| blocks per stage ({'/'.join(b['stages'])}) | {'/'.join(map(str, b['supernet']))} | "
           f"{'/'.join(map(str, b['found']))} ({what}) |")
    return "\n".join(lines[:4] + [row] + lines[4:])


def _load(d: dict[str, Any]) -> str:
    load = d.get("load_average")
    return f" average of {load[0]:.1f} on {d['env']['machine'].split()[0]} cores" if load else ""


@number("default_run.measured")
def _default_measured() -> str:
    d = _default()
    env = d["env"]
    threads = env["threads"]
    end = d["search_end"]
    ratio = end["hard"] / end["target"]
    band = ("inside the settle phase's band of [0.98, 1.00], so the budget solver changed nothing"
            if 0.98 <= ratio <= 1.0 else
            "outside the settle phase's band of [0.98, 1.00], so the finish phase and budget solver set the "
            "exported structure")
    return (f"Wall time {_minutes(d['wall_seconds'])} (`python bench/default_run.py`: `dmscale search` with no "
            f"flags, seed {d['seed']}, {threads} thread{'s' if threads != 1 else ''} as the CLI chose from the "
            f"machine's load{_load(d)}, commit `{env['commit']}`, {d['date']}, torch {env['torch']}). This search ended at "
            f"{ratio:.3f} x target by its loss alone, {band}")


# ---------------------------------------------------------------- table 4: peers


@dataclass
class Paired:
    best: str
    diffs: list[float]
    seeds: list[int]
    means: dict[str, float]


PEER_NAMES = {"tp_magnitude": "Torch-Pruning magnitude", "tp_taylor": "Torch-Pruning Taylor", "uniform": "uniform"}


def _peers(key: str, seeds: list[int] | None = None) -> Paired:
    """DMS_p minus the best peer by mean, paired by seed, as ``bench/peers.py``'s table."""
    import peers

    c = cache("peers")
    runs = c["runs"][key]
    have = sorted(int(s) for s, r in runs.items() if all(m in r for m in peers.METHODS))
    if seeds is not None:
        have = [s for s in have if s in seeds]
    means = {m: mean(100 * runs[str(s)][m]["acc"] for s in have) for m in (*peers.METHODS, peers.REFERENCE)
             if all(m in runs[str(s)] for s in have)}
    best = max((m for m in peers.METHODS if m != "dms_p"), key=means.get)
    diffs = [100 * (runs[str(s)]["dms_p"]["acc"] - runs[str(s)][best]["acc"]) for s in have]
    return Paired(best, diffs, have, means)


def _peer_gap(key: str, a: str, b: str) -> list[float]:
    runs = cache("peers")["runs"][key]
    return [100 * (r[a]["acc"] - r[b]["acc"]) for _, r in sorted(runs.items(), key=lambda kv: int(kv[0]))
            if a in r and b in r]


W8 = "pre10.0-s2.0-ft4.0"


@number("peers.w8.t0.25")
def _peers_default_025() -> str:
    p = _peers(f"t0.25-{W8}-settle0.4")
    return f"{ci(p.diffs)[1].replace(' [', ' pt over the best peer, 95 % CI [', 1)}"


@number("peers.w8.t0.25.seeds")
def _peers_default_025_seeds() -> str:
    return f"{len(_peers(f't0.25-{W8}-settle0.4').seeds)} seeds"


@number("peers.w8.t0.5.verdict")
def _peers_default_05_verdict() -> str:
    p = _peers(f"t0.5-{W8}-settle0.4")
    return "resolved" if resolved(p.diffs) else "not resolved"


@number("peers.first10")
def _peers_first10() -> str:
    p25, p5 = _peers(f"t0.25-{W8}"), _peers(f"t0.5-{W8}")
    e5, e25 = _peers(f"t0.5-{W8}-eqtrain"), _peers(f"t0.25-{W8}-eqtrain")
    every = "every seed" if all(d > 0 for d in p25.diffs) else f"{sum(d > 0 for d in p25.diffs)} of {len(p25.diffs)} seeds"
    return (f"{len(p25.seeds)} seeds: at 0.25 x MACs **{ci(p25.diffs)[1].replace(' [', ' pt over the best peer, 95 % CI [', 1)}**, "
            f"{every}; at 0.5 {mean(p5.diffs):+.2f} over {PEER_NAMES[p5.best]}, "
            f"{'resolved' if resolved(p5.diffs) else 'not resolved'}; when the peers also get the search's weight "
            f"epochs: {mean(e5.diffs):+.2f} (0.5), {mean(e25.diffs):+.2f} (0.25)")


@number("peers.default")
def _peers_default() -> str:
    p25, p5 = _peers(f"t0.25-{W8}-settle0.4"), _peers(f"t0.5-{W8}-settle0.4")
    return (f"{len(p25.seeds)} seeds: **{ci(p25.diffs)[1]}** at 0.25, {ci(p5.diffs)[1]} at 0.5 "
            f"({'resolved' if resolved(p5.diffs) else 'not resolved'}, "
            f"{'under' if mean(p5.diffs) < 0.5 else 'over'} the +0.5 bar)")


@number("peers.ceiling")
def _peers_ceiling() -> str:
    key = f"t0.5-{W8}-settle0.4"
    top = mean(_peer_gap(key, "unpruned", "tp_taylor"))
    dms = -mean(_peer_gap(key, "dms_p", "unpruned"))
    return (f"the unpruned supernet with the same finetune is only {top:.2f} pt above Torch-Pruning Taylor "
            f"there, and DMS_p is within {dms:.2f} of it")


def _fastnas(key: str) -> str:
    """DMS_p minus ModelOpt FastNAS, paired by seed over the seeds both ran (``key``: a peers run)."""
    runs = cache("peers")["runs"][key]
    seeds = sorted(int(s) for s, r in runs.items() if "dms_p" in r and "modelopt_fastnas" in r)
    diffs = [100 * (runs[str(s)]["dms_p"]["acc"] - runs[str(s)]["modelopt_fastnas"]["acc"]) for s in seeds]
    return ci(diffs)[1]


@number("peers.fastnas.readme")
def _peers_fastnas_readme() -> str:
    eq = "pre10.0-s2.0-ft4.0-eqtrain-settle0.4-hold"
    return (f"{_fastnas('t0.25-' + eq)} pt at 0.25 x, {_fastnas('t0.5-' + eq)} at 0.5 x; "
            f"width 4 at 0.25 x {_fastnas('w4-t0.25-' + eq)}, at 0.5 x {_fastnas('w4-t0.5-' + eq)}")


EQ = "pre10.0-s2.0-ft4.0-eqtrain-settle0.4-hold"  # issue 56's protocol (equal weight training)


def _diag(key: str, a: str, b: str) -> tuple[list[float], str]:
    """``a`` minus ``b`` in ``peers_diag``'s setting ``key``, paired over the seeds both ran."""
    runs = cache("peers_diag")["runs"][key]
    diffs = [100 * (r[a]["acc"] - r[b]["acc"]) for _, r in sorted(runs.items(), key=lambda kv: int(kv[0]))
             if a in r and b in r]
    if len(diffs) < 2:  # one seed: a sketch, no interval
        return diffs, f"{diffs[0]:+.2f} (1 seed, no interval)"
    return diffs, f"{ci(diffs)[1]} ({len(diffs)} seeds)"


@number("diag.w4")
def _diag_w4() -> str:
    out = []
    for t in ("0.25", "0.5"):
        key = f"w4-t{t}-{EQ}"
        out.append(f"at {t} x: DMS_p - FastNAS {_diag(key, 'dms_p', 'modelopt_fastnas')[1]}; DMS_p's structure "
                   f"retrained from the pretrained weights - FastNAS {_diag(key, 'dms_p_struct', 'modelopt_fastnas')[1]}, "
                   f"- DMS_p {_diag(key, 'dms_p_struct', 'dms_p')[1]}; residual streams held whole - DMS_p "
                   f"{_diag(key, 'dms_p_keep_residual', 'dms_p')[1]}")
    return "; ".join(out)


@number("diag.w4.readme")
def _diag_w4_readme() -> str:
    a, b = (_diag(f"w4-t{t}-{EQ}", "dms_p_struct", "modelopt_fastnas")[1] for t in ("0.25", "0.5"))
    return (f"{a} pt against FastNAS at 0.25 x, {b} at 0.5 x, where FastNAS already equals the unpruned "
            "network finetuned the same way")


STRUCT = "DMS_p's structure retrained from the pretrained weights"


def _diag_rows(key: str, rows: tuple[tuple[str, str, str], ...]) -> str:
    """``label a-b`` for each (label, a, b) of ``rows`` in ``peers_diag``'s setting ``key``."""
    return "; ".join(f"{label} {_diag(key, a, b)[1]}" for label, a, b in rows)


@number("diag.d32")
def _diag_d32() -> str:
    return _diag_rows(f"w4-d32-t0.25-{EQ}", (("DMS_p - FastNAS", "dms_p", "modelopt_fastnas"),
                                             (f"{STRUCT} - FastNAS", "dms_p_struct", "modelopt_fastnas"),
                                             ("unpruned - uniform", "unpruned", "uniform")))


@number("diag.w8")
def _diag_w8() -> str:
    return "; ".join(f"at {t} x DMS_p's structure retrained from the pretrained weights - DMS_p "
                     f"{_diag(f't{t}-{EQ}', 'dms_p_struct', 'dms_p')[1]}" for t in ("0.25", "0.5"))


@number("diag.r18")
def _diag_r18() -> str:
    return _diag_rows("mnist-tv_resnet18-n5000-t0.5-pre3.0-s1.0-ft2.0-eqtrain-settle0.4-hold",
                      (("DMS_p - FastNAS", "dms_p", "modelopt_fastnas"),
                       (f"{STRUCT} - FastNAS", "dms_p_struct", "modelopt_fastnas"),
                       ("residual streams held whole - DMS_p", "dms_p_keep_residual", "dms_p")))


@number("peers.w4")
def _peers_w4() -> str:
    p5, p25 = _peers("w4-t0.5-pre10.0-s2.0-ft4.0-settle0.4-hold"), _peers("w4-t0.25-pre10.0-s2.0-ft4.0-settle0.4-hold")
    e5, e25 = (_peers("w4-t0.5-pre10.0-s2.0-ft4.0-eqtrain-settle0.4-hold"),
               _peers("w4-t0.25-pre10.0-s2.0-ft4.0-eqtrain-settle0.4-hold"))
    return (f"({len(p5.seeds)} seeds): **{ci(p5.diffs)[1].replace(' [', ' pt [', 1)} over {PEER_NAMES[p5.best]} at "
            f"0.5 x, {ci(p25.diffs)[1]} over the best peer at 0.25 x**; with the peers given the search's weight "
            f"epochs too, {ci(e5.diffs)[1]} (0.5 x, {'resolved' if resolved(e5.diffs) else 'not resolved'}) and "
            f"**{ci(e25.diffs)[1]}** (0.25 x)")


@number("peers.budget_use")
def _peers_budget_use() -> str:
    c = cache("peers")
    fr = [r["dms_p"]["macs_frac"] / c["settings"][k]["target"] for k in (f"t0.5-{W8}", f"t0.25-{W8}")
          for r in c["runs"][k].values()]
    return f"{100 * min(fr):.1f}-{100 * max(fr):.0f} %"


# ---------------------------------------------------------------- table 1: gates


GATE_NAMES = {"mes": "MES", "sns": "SNS", "get": "GET", "dms_nonorm": "without importance normalisation"}


def _gates(key: str) -> tuple[dict[str, list[float]], list[int]]:
    import gates

    c = cache("gates")
    runs = c["runs"][key]
    have = sorted(int(s) for s, r in runs.items() if all(m in r for m in gates.METHODS))
    return {m: [100 * runs[str(s)][m]["acc"] for s in have] for m in gates.METHODS}, have


def _gate_list(acc: dict[str, list[float]], methods: tuple[str, ...], spread: bool) -> str:
    order = sorted(methods, key=lambda m: -mean(acc[m]))
    return ", ".join(f"{GATE_NAMES[m]} {pm(acc[m]) if spread else f'{mean(acc[m]):.1f}'}" for m in order)


def _gate_lead(acc: dict[str, list[float]], others: tuple[str, ...]) -> tuple[str, list[float]]:
    best = max(others, key=lambda m: mean(acc[m]))
    return best, [a - b for a, b in zip(acc["dms"], acc[best])]


@number("gates.eq10")
def _gates_eq10() -> str:
    acc, have = _gates("t0.5-pre10.0-s36.36")
    return (f"DMS {pm(acc['dms'])} % vs {_gate_list(acc, ('get', 'mes', 'sns', 'dms_nonorm'), True)} "
            f"({len(have)} seeds)")


@number("gates.eq10.lead")
def _gates_eq10_lead() -> str:
    acc, have = _gates("t0.5-pre10.0-s36.36")
    best, d = _gate_lead(acc, ("mes", "sns", "get"))
    return (f"**{ci(d, 1)[1].replace(' [', f' pt over {GATE_NAMES[best]}, 95 % CI [', 1)}**, ahead on "
            f"{sum(x > 0 for x in d)} of {len(d)} seeds")


@number("gates.settle")
def _gates_settle() -> str:
    acc, _ = _gates("t0.5-pre10.0-s36.36-settle0.4")
    return f"DMS {mean(acc['dms']):.1f} vs {_gate_list(acc, ('mes', 'sns', 'get'), False)}"


@number("gates.hold")
def _gates_hold() -> str:
    acc, _ = _gates("t0.5-pre10.0-s36.36-settle0.4-hold")
    return f"{mean(acc['dms']):.1f} vs {_gate_list(acc, ('mes', 'sns', 'get'), False)}"


@number("gates.hold.lead")
def _gates_hold_lead() -> str:
    acc, have = _gates("t0.5-pre10.0-s36.36-settle0.4-hold")
    ahead = sum(all(acc["dms"][i] > acc[m][i] for m in ("mes", "sns", "get")) for i in range(len(have)))
    best, d = _gate_lead(acc, ("mes", "sns", "get"))
    return (f"**ahead of each on {ahead} of {len(have)} seeds** "
            f"({ci(d, 1)[1].replace(' [', f' pt over {GATE_NAMES[best]} [', 1)})")


# ---------------------------------------------------------------- table 8 (paper): importance


def _importance() -> dict[str, dict[int, dict[str, Any]]]:
    import importance

    rows = list(cache("importance")["runs"].values())
    return {m: {r["seed"]: r for r in rows if r["metric"] == m} for m in importance.METRICS}


@number("importance.after")
def _importance_after() -> str:
    by = _importance()
    taylor = by["taylor"]
    gaps = [mean(100 * (r["acc"] - taylor[s]["acc"]) for s, r in rs.items()) for m, rs in by.items()
            if m != "taylor" and rs]
    n = len(taylor)
    return f"{min(gaps):+.2f} to {max(gaps):+.2f} pt vs Taylor, {n} seeds"


@number("importance.fisher")
def _importance_fisher() -> str:
    by = _importance()
    seeds = sorted(set(by["fisher"]) & set(by["taylor"]))
    d = [100 * (by["fisher"][s]["acc_search"] - by["taylor"][s]["acc_search"]) for s in seeds]
    return ci(d, 1)[1].replace(" [", " pt [", 1)


@number("importance.fisher.wins")
def _importance_fisher_wins() -> str:
    by = _importance()
    seeds = sorted(set(by["fisher"]) & set(by["taylor"]))
    d = [by["fisher"][s]["acc_search"] - by["taylor"][s]["acc_search"] for s in seeds]
    return f"{sum(x > 0 for x in d)} of {len(d)} seeds"


# ---------------------------------------------------------------- table 3: evolution


def _evolution(name: str) -> dict[str, Any]:
    import evolution

    c = cache(name)
    (key,) = c["settings"]
    s = evolution._summary(c, key)
    s["runs"] = c["runs"][key]
    return s


def _x(v: float) -> str:
    return f"{v:.2f}x"


@number("evolution.eq10")
def _evolution_eq10() -> str:
    s = _evolution("evolution")
    r = [x["ratio_mean"] for x in s["rows"] if x["ratio_mean"] is not None]
    return f"{min(r):.2f}-{max(r):.2f}x its CPU time on {len(r)} of {len(s['rows'])} seeds"


@number("evolution.settle_long")
def _evolution_settle_long() -> str:
    s = _evolution("evolution_settle_long")
    budget = mean(x["evo_cpu_s"] / x["dms_cpu_s"] for x in s["rows"])
    hits = [x["ratio_seed"] for x in s["rows"] if x["ratio_seed"] is not None]
    miss = len(s["rows"]) - len(hits)
    words = {1: "one", 2: "two", 3: "three"}
    tail = (" and never on the third" if miss == 1 and len(s["rows"]) == 3 else
            f", never on {miss}" if miss else "")
    return (f"given ~{budget:.0f}x DMS_p-'s CPU time, {' and '.join(_x(h) for h in hits)} on "
            f"{words.get(len(hits), len(hits))} seeds{tail}")


@number("evolution.candidate_cost")
def _evolution_candidate_cost() -> str:
    s = _evolution("evolution_settle_long")
    return f"{mean(x['evo_cpu_s'] / s['runs'][str(x['seed'])]['evolution']['evaluations'] for x in s['rows']):.2f} CPU s"


def _never(s: dict[str, Any]) -> bool:
    return all(x["ratio_seed"] is None for x in s["rows"])


@number("evolution.d56")
def _evolution_d56() -> str:
    s, long = _evolution("evolution_d56"), _evolution("evolution_d56_long")
    b = [x["evo_cpu_s"] / x["dms_cpu_s"] for x in s["rows"]]
    bl = [x["evo_cpu_s"] / x["dms_cpu_s"] for x in long["rows"]]
    if not (_never(s) and _never(long)):
        return "the evolution reaches its seed's DMS_p- accuracy on some seeds (see evolution_d56.md)"
    return (f"the evolution never reaches its seed's DMS_p- accuracy within {min(b):.0f}-{max(b):.0f}x DMS_p-'s "
            f"CPU time on any of {len(b)} seeds ({100 * s['dms_mean_acc']:.1f} % vs "
            f"{pm([100 * x['evo_final_acc'] for x in s['rows']])} %), nor within {min(bl):.0f}-{max(bl):.0f}x on "
            f"the {len(bl)} seeds given "
            f"{cache('evolution_d56_long')['settings'][next(iter(cache('evolution_d56_long')['settings']))]['evolution']['generations']} generations")


# ---------------------------------------------------------------- table 3 (np): np_uniform


def _np(name: str = "np_uniform") -> list[dict[str, Any]]:
    return list(cache(name)["runs"].values())


def _np_gap(arm: str, target: float, name: str = "np_uniform", seeds: range | None = None,
            base: str = "uniform") -> list[float]:
    from np_uniform_table import _sel, paired_gap

    runs = _np(name)
    rows = _sel(runs, arm=arm, target=target, search_epochs=10.0, retrain_epochs=20.0)
    uni = _sel(runs, arm=base, target=target if base == "uniform" else 1.0, retrain_epochs=20.0)
    if seeds is not None:
        rows = [r for r in rows if r["seed"] in seeds]
    return paired_gap(rows, uni)


@number("np.expand.t0.25")
def _np_expand_025() -> str:
    d = _np_gap("dms_expand", 0.25)
    first = _np_gap("dms_expand", 0.25, seeds=range(10))
    return (f"**{ci(d)[1].replace(' [', ' pt, 95 % CI [', 1)}** ({len(d)} seeds, better on "
            f"{sum(x > 0 for x in d)}, worse on {sum(x < 0 for x in d)}, with `--settle 0`; "
            f"{mean(first):+.2f} over the first {len(first)})")


@number("np.expand.t0.5")
def _np_expand_05() -> str:
    return f"{mean(_np_gap('dms_expand', 0.5)):+.2f}"


@number("np.base")
def _np_base() -> str:
    return f"{mean(_np_gap('dms', 0.5)):+.2f} / {mean(_np_gap('dms', 0.25)):+.2f}"


@number("np.t0.25.three")
def _np_three() -> str:
    d = _np_gap("dms_expand", 0.25)
    return (f"{len(d)} seeds from `--expand` at 0.25: {ci(d)[1]}, with the settle phase annealing alone "
            f"{ci(_np_gap('dms_expand@settle', 0.25))[1]}, at the current default (settle + hold) "
            f"**{ci(_np_gap('dms_expand@hold', 0.25))[1]}**")


@number("np.hold.t0.5")
def _np_hold_05() -> str:
    d = _np_gap("dms_expand@hold", 0.5)
    return f"{ci(d)[1]} ({len(d)} seeds)"


@number("np.ceiling")
def _np_ceiling() -> str:
    from np_uniform_table import _sel, paired_gap

    runs = _np()
    base = _sel(runs, arm="uniform", target=1.0, retrain_epochs=20.0)
    uni = _sel(runs, arm="uniform", target=0.5, retrain_epochs=20.0)
    return f"{mean(paired_gap(base, uni)):.2f} pt"


@number("np.w4")
def _np_w4() -> str:
    d25 = _np_gap("dms@hold", 0.25, "np_uniform_w4")
    d5 = _np_gap("dms@hold", 0.5, "np_uniform_w4")
    return (f"**{ci(d25)[1].replace(' [', ' pt [', 1)} at 0.25 x** ({len(d25)} seeds), {mean(d5):+.2f} at 0.5 "
            f"({'resolved' if resolved(d5) else 'not resolved'})")


# ---------------------------------------------------------------- table 5: SmolLM2


TP_NAME = {"tp_taylor": "Torch-Pruning's Taylor", "shortgpt": "ShortGPT", "taylor": "LLM-Pruner-style Taylor",
           "tp_hidden": "Torch-Pruning (hidden + FFN)", "magnitude": "L2 magnitude",
           "minitron": "Minitron-style", "minitron_keep_heads": "Minitron-style, every head kept"}


def _llm(name: str = "llm_table5") -> list[dict[str, Any]]:
    import llm_table5

    return llm_table5._records(RESULTS / name)


def _llm_vs(recs: list[dict[str, Any]], target: float, method: str = "dms",
            base: str | None = None) -> tuple[str, dict[int, float], dict[int, float], list[float]]:
    """DMS's perplexity against the best baseline (or ``base``) by seed: ``1 - dms / base``."""
    import llm_table5

    dms = llm_table5._arm(recs, method, target)
    if base is None:
        base, b = llm_table5._best_baseline(recs, target)
    else:
        b = llm_table5._arm(recs, base, target)
    seeds = sorted(set(dms) & set(b))
    return base, dms, b, [1 - dms[s] / b[s] for s in seeds]


def _rel_ci(rel: list[float]) -> str:
    m, lo, hi, _ = paired_ci([100 * r for r in rel])
    return f"{m:.1f} % lower [{lo:.1f}, {hi:.1f}]"


@number("llm5.t0.8.setup")
def _llm_setup() -> str:
    recs = _llm()
    dms = [r for r in recs if r["method"] == "dms" and r["target"] == 0.8]
    steps = sorted({r["weight_steps"] for r in dms})
    return f"{len(dms)} seeds, {span_of(steps, '{:d}')} weight steps each"


@number("llm5.t0.8")
def _llm_08() -> str:
    base, dms, b, rel = _llm_vs(_llm(), 0.8)
    return f"{mean(dms.values()):.1f} vs {mean(b.values()):.1f}"


@number("llm5.t0.8.best")
def _llm_08_best() -> str:
    return TP_NAME[_llm_vs(_llm(), 0.8)[0]]


@number("llm5.t0.8.rel")
def _llm_08_rel() -> str:
    rel = _llm_vs(_llm(), 0.8)[3]
    return f"{_rel_ci(rel)}, {len(rel)} seeds"


@number("llm5.t0.8.headline")
def _llm_08_headline() -> str:
    base, dms, b, rel = _llm_vs(_llm(), 0.8)
    label = {"tp_taylor": "Torch-Pruning's Taylor, FFN units only"}.get(base, TP_NAME[base])
    every = "every seed" if all(x > 0 for x in rel) else f"{sum(x > 0 for x in rel)} of {len(rel)} seeds"
    return (f"**{mean(dms.values()):.1f} vs {mean(b.values()):.1f} for the best baseline ({label}), "
            f"{_rel_ci(rel)}**, {every}")


@number("llm5.t0.8.others")
def _llm_08_others() -> str:
    import llm_table5

    recs = _llm()
    p = {m: mean(llm_table5._arm(recs, m, 0.8).values()) for m in ("shortgpt", "taylor", "tp_hidden", "magnitude")}
    return (f"ShortGPT {p['shortgpt']:.1f}, Taylor over KV groups and FFN {p['taylor']:.1f}, Torch-Pruning in its "
            f"own LLM example's scope (hidden size and FFN at one ratio) {p['tp_hidden']:.1f}, magnitude "
            f"{p['magnitude']:.0f}")


def _llm7(target: float) -> str:
    """Table 7 at CPU scale at ``target``: DMS_p against the best baseline and the finetuned
    original, WikiText-2 / PTB perplexity and mean zero-shot accuracy (``bench/llm_table7.py``)."""
    import llm_table7 as t7

    recs = t7._records(RESULTS / "llm_table7")
    col = lambda m, c, t=target: t7._by_seed(recs, m, t, c)  # noqa: E731
    dms = col("dms_p", "wikitext2")
    if not dms:
        return "not run yet"
    best = t7._best_baseline(recs, target)
    parts = [f"WikiText-2 perplexity {mean(dms.values()):.1f}, PTB {mean(col('dms_p', 'ptb').values()):.1f}"]
    if best is not None:
        parts[0] += (f" vs {mean(col(best, 'wikitext2').values()):.1f} and {mean(col(best, 'ptb').values()):.1f} "
                     f"for the best baseline ({t7.LABEL[best]})")
    orig = col("original", "wikitext2", 1.0)
    if orig:
        paper = "; the paper: 1.36x at 81 %" if target > 0.8 else ""
        parts.append(f"{mean(dms.values()) / mean(orig.values()):.2f}x the finetuned original's WikiText-2 "
                     f"perplexity ({mean(orig.values()):.1f}{paper})")
    acc = f"mean zero-shot accuracy {mean(col('dms_p', 'mean_acc').values()):.1f} %"
    if best is not None:
        acc += f" vs {mean(col(best, 'mean_acc').values()):.1f} %"
    parts.append(acc)
    seeds = {r["seed"] for r in recs if r["method"] == "dms_p" and r["target"] == target}
    return "; ".join(parts) + f" ({len(seeds)} seed{'s' if len(seeds) > 1 else ''})"


@number("llm7.t0.81")
def _llm7_81() -> str:
    return _llm7(0.81)


@number("llm7.t0.5")
def _llm7_50() -> str:
    return _llm7(0.5)


@number("llm5.long.t0.8")
def _llm_long_08() -> str:
    recs = _llm("llm_table5_long")
    _, _, _, tp = _llm_vs(recs, 0.8, base="tp_taylor")
    _, _, _, sg = _llm_vs(recs, 0.8, base="shortgpt")
    return (f"{100 * mean(tp):.1f} % below Torch-Pruning ({100 * mean(sg):.1f} % below ShortGPT) with a 4x budget "
            f"({len(tp)} seeds)")


@number("llm5.t0.5")
def _llm_05() -> str:
    base, dms, b, rel = _llm_vs(_llm(), 0.5)
    return f"{len(rel)} seeds: {mean(dms.values()):.0f} vs {mean(b.values()):.0f}, {100 * mean(rel):.1f} % lower"


@number("llm5.long.t0.5")
def _llm_long_05() -> str:
    base, dms, b, rel = _llm_vs(_llm("llm_table5_long"), 0.5)
    n = {1: "one seed"}.get(len(rel), f"{len(rel)} seeds")
    return (f"{mean(dms.values()):.1f} vs {mean(b.values()):.1f}, {100 * mean(rel):.1f} %, with the 4x budget, {n}")


@number("llm5.hold.t0.8")
def _llm_hold_08() -> str:
    recs = _llm("llm_table5_hold")
    base, dms, b, rel = _llm_vs(recs, 0.8)
    runs = [r for r in recs if r["method"] == "dms"]
    band = all(0.98 <= r["search_end"] <= 1.0 for r in runs)
    return (f"{mean(dms.values()):.1f} vs {mean(b.values()):.1f}, {_rel_ci(rel)}, "
            + ("every search in the budget band by itself" if band else
               f"{sum(0.98 <= r['search_end'] <= 1.0 for r in runs)} of {len(runs)} searches in the budget band by themselves"))


@number("llm5.hold.seeds")
def _llm_hold_seeds() -> str:
    import llm_table5

    seeds = sorted(llm_table5._arm(_llm("llm_table5_hold"), "dms", 0.8))
    return f"seeds {seeds[0]}-{seeds[-1]}" if seeds == list(range(seeds[0], seeds[-1] + 1)) else \
        "seeds " + ", ".join(map(str, seeds))


def _widths_vs(target: float, other: str) -> list[float]:
    import llm_table5

    recs = _llm()
    w, o = llm_table5._arm(recs, "dms_widths", target), llm_table5._arm(recs, other, target)
    return [w[s] / o[s] - 1 for s in sorted(set(w) & set(o))]


@number("llm5.widths.t0.8")
def _llm_widths_08() -> str:
    import llm_table5

    return f"{mean(llm_table5._arm(_llm(), 'dms_widths', 0.8).values()):.1f}"


@number("llm5.widths.t0.8.rel")
def _llm_widths_08_rel() -> str:
    rel = [100 * x for x in _widths_vs(0.8, "dms")]
    m, lo, hi, _ = paired_ci(rel)
    return f"{m:+.1f} % [{lo:.1f}, {hi:.1f}], {len(rel)} seeds"


@number("llm5.widths.t0.5")
def _llm_widths_05() -> str:
    rel = _widths_vs(0.5, "dms")
    return f"{100 * mean(rel):.1f} % above DMS, {len(rel)} seeds"


@number("llm5.ffn")
def _llm_ffn() -> str:
    import llm_table5

    recs = _llm()
    ffn = llm_table5._arm(recs, "dms_ffn", 0.8)
    dms = llm_table5._arm(recs, "dms", 0.8)
    _, _, _, rel = _llm_vs(recs, 0.8, method="dms_ffn", base="tp_taylor")
    above = mean(ffn.values()) - mean(dms[s] for s in ffn)
    return f"{mean(ffn.values()):.1f}, {100 * mean(rel):.1f} % below it and {above:.1f} above"


@number("llm5.tp_hidden.shape")
def _llm_tp_hidden_shape() -> str:
    import ast

    shapes = {(c["hidden"], c["q_heads"]) for c in (ast.literal_eval(r["chosen"]) if isinstance(r["chosen"], str)
                                                    else r["chosen"] for r in _llm_raw("tp_hidden", 0.8))}
    return "; ".join(f"{h} with {q} heads" for h, q in sorted(shapes))


def _llm_raw(method: str, target: float) -> list[dict[str, Any]]:
    """The per-arm records of ``bench/results/llm_table5/`` as written (every field)."""
    return [r for r in _llm() if r["method"] == method and r["target"] == target]


@number("llm5.band")
def _llm_band() -> str:
    runs = sorted((r for r in _llm() if r["method"] == "dms" and "search_end" in r),
                  key=lambda r: (-r["target"], r["seed"]))
    inside = [r for r in runs if 0.98 <= r["search_end"] <= 1.0]
    under = [r for r in runs if r["search_end"] < 0.98]
    over = [r for r in runs if r["search_end"] > 1.0]
    parts = [f"{len(inside)} of {len(runs)} searches ended in [0.98, 1.00] x target by themselves"]
    for r in under:
        parts.append(f"{100 * r['target']:.0f} % seed {r['seed']} ended at {r['search_end']:.3f} and the solver "
                     f"filled it to {r['cost']['hard'] / r['cost']['target']:.3f}")
    for t in sorted({r["target"] for r in over}, reverse=True):
        rs = [r for r in over if r["target"] == t]
        seeds = " and ".join(str(r["seed"]) for r in rs)
        ends = ", ".join(f"{r['search_end']:.4f}" for r in rs)
        steps = sorted({r["phase_steps"]["finish"] for r in rs})
        parts.append(f"{100 * t:.0f} % seed{'s' if len(rs) > 1 else ''} {seeds} ended just over it ({ends} x) "
                     f"and the finish phase took {'/'.join(map(str, steps))} weight step{'s' if steps != [1] else ''}"
                     f"{' each' if len(rs) > 1 else ''} to land "
                     f"({'/'.join(sorted({str(r['weight_steps']) for r in rs}))} weight steps in all)")
    return "; ".join(parts)


# ---------------------------------------------------------------- table 11: YOLO


def _yolo(arm: str, base: str = "yolov8n") -> list[float]:
    rows = cache("yolo_table11")["rows"]
    return paired_diff(rows[arm], rows[base], "map50_95")


@number("yolo.hold")
def _yolo_hold() -> str:
    d = _yolo("dms_np_hold")
    return f"{ci(d, 1)[1].replace(' [', ' mAP50-95 [', 1)}"


@number("yolo.hold.seeds")
def _yolo_hold_seeds() -> str:
    return f"{len(_yolo('dms_np_hold'))} seeds"


@number("yolo.first")
def _yolo_first() -> str:
    rows = cache("yolo_table11")["rows"]
    d = _yolo("dms_np")
    seeds = {r["seed"] for r in rows["dms_np"]}
    base = [100 * r["map50_95"] for r in rows["yolov8n"] if r["seed"] in seeds]
    return (f"DMS_np {mean(100 * r['map50_95'] for r in rows['dms_np']):.1f} vs YOLOv8n {mean(base):.1f} mAP50-95 "
            f"at equal MACs ({'+' if mean(d) > 0 else ''}{pm(d)} paired, {len(d)} seeds")


@number("yolo.default")
def _yolo_default() -> str:
    rows = cache("yolo_table11")["rows"]
    d = _yolo("dms_np_hold")
    # paired against p3 over the seeds both have
    p3 = paired_diff(rows["dms_np_hold"], rows["p3"], "map50_95")
    return (f"{len(d)} seeds: **{ci(d, 1)[1].replace(' [', ' [', 1)} over YOLOv8n, and {ci(p3, 1)[1]} over the "
            f"hand-made design it points to**")


# ---------------------------------------------------------------- llama.cpp speed (issue 48)

DECODE_GOAL = 1.8  # issue 48: decode tokens/s of the 50 % per-layer export over the original's
DEEP_DECODE_GOAL = 1.5  # ... and of the KV-cache-budget export at 1,024 tokens of context


def _llamacpp_ratio(arm: str, gtype: str, depth: bool) -> float:
    """Decode tokens/s of ``arm`` over the original's, at ``gtype``, with or without the
    deep context of ``bench/llamacpp_speed.py``."""
    rows = cache("llamacpp_speed")["rows"]

    def tg(name: str) -> float:
        recs = rows[name]["types"][gtype]["bench"]
        return next(r["avg_ts"] for r in recs if r["n_gen"] > 0 and bool(r.get("n_depth")) == depth)

    return tg(arm) / tg("original")


@number("llamacpp.decode.readme")
def _llamacpp_decode_readme() -> str:
    c = cache("llamacpp_speed")
    per, uni = (_llamacpp_ratio(a, "f16", False) for a in ("per-layer, params 0.5", "layer-uniform, params 0.5"))
    kv = _llamacpp_ratio("per-layer, params 0.8 + kv_cache 0.5", "f16", True)
    depth = c["settings"]["depth"]
    met = sum([per >= DECODE_GOAL, kv >= DEEP_DECODE_GOAL])
    return (f"at half the parameters a decode of {per:.2f}x the original's tokens/s per layer "
            f"({uni:.2f}x layer-uniform), and with a KV-cache budget of 0.5 (and 0.8 of the parameters) "
            f"{kv:.2f}x at {depth:,} tokens of context (f16, {c['threads']} thread): {met} of 2 goals "
            f"({DECODE_GOAL}x, {DEEP_DECODE_GOAL}x) met")


# ---------------------------------------------------------------- table 16


def _t16(name: str) -> list[dict[str, Any]]:
    return list(cache(name)["runs"].values())


@number("table16.acc")
def _t16_acc() -> str:
    runs = _t16("table16")
    cells: dict[tuple[float, float], list[float]] = {}
    for r in runs:
        cells.setdefault((r["weight"], r["lr"]), []).append(100 * r["acc"])
    means = [mean(v) for v in cells.values()]
    return f"{min(means):.1f}-{max(means):.1f} %"


@number("table16.settle")
def _t16_settle() -> str:
    runs, before = _t16("table16_settle"), _t16("table16")
    fast = [r for r in runs if r["lr"] >= 5e-3]
    land = sum(0.98 <= r["search_end"] <= 1.0 for r in fast)
    land0 = sum(0.98 <= r["search_end"] <= 1.0 for r in before)
    return f"{land} of those {len(fast)} searches land in [0.98, 1.00] by the loss alone ({land0} of {len(before)} before)"


# ---------------------------------------------------------------- table 6: budget


def _budget(mode: str, width: int | None = None) -> list[dict[str, Any]]:
    return [r for r in cache("budget")["runs"].values() if r["mode"] == mode and r["epochs"] == 10.0
            and (width is None or r.get("width", 8) == width)]


def _band(rows: list[dict[str, Any]]) -> str:
    return f"{sum(0.98 <= r['search_end'] <= 1.0 + 1e-9 for r in rows)} of {len(rows)}"


@number("budget.hold")
def _budget_hold() -> str:
    return f"{_band(_budget('settle'))} searches of a width-8 and a width-32 ResNet-20 in [0.98, 1.00] x target"


@number("budget.others")
def _budget_others() -> str:
    return f"the paper's loss as written: {_band(_budget('soft'))}; the settle phase without the hold: {_band(_budget('anneal'))}"


@number("budget.gain")
def _budget_gain() -> str:
    runs = cache("budget")["runs"]
    gains = []
    for width in (8, 32):
        for target in (0.5, 0.25):
            sfx = "" if width == 8 else f"/w{width}"
            d = [100 * (runs[f"{target}/settle/{s}/10.0{sfx}"]["acc"] - runs[f"{target}/soft/{s}/10.0{sfx}"]["acc"])
                 for s in range(10) if f"{target}/settle/{s}/10.0{sfx}" in runs]
            gains.append(mean(d))
    return f"{min(gains):+.1f} to {max(gains):+.1f} pt"


@number("budget.expand")
def _budget_expand() -> str:
    rows = [r for r in _np() if r["arm"] == "dms_expand@hold" and r["search_epochs"] == 10.0]
    return _band(rows)


# ---------------------------------------------------------------- table 8: cost of a step


def _gpu(name: str = "gpu_check") -> dict[str, Any]:
    return cache(name)["jobs"]


def _step(job: dict[str, Any], field: str = "median_ms") -> float:
    return job["train"]["dms"][field] / job["train"]["plain"][field]


GPU_MODELS = ("resnet50", "vit_b16", "llama_135m")


@number("gpu.step")
def _gpu_step() -> str:
    new = _gpu()
    runs = ("gpu_check", "gpu_check_8d28630", "gpu_check_9983864")  # today's code in every GPU run
    was = {m: [_step(_gpu(n)[f"today/{m}"]) for n in runs] for m in GPU_MODELS}
    names = {"resnet50": "ResNet-50", "vit_b16": "ViT-B/16", "llama_135m": "SmolLM2-shaped Llama"}
    return ", ".join(f"{names[m]} {_step(new[f'new/{m}']):.2f}x (was {min(was[m]):.2f}-{max(was[m]):.2f}x)"
                     for m in GPU_MODELS)


@number("gpu.memory")
def _gpu_memory() -> str:
    new = _gpu()
    now = " / ".join(f"{_step(new[f'new/{m}'], 'peak_gib'):.2f}x" for m in GPU_MODELS)
    was = " / ".join(f"{_step(new[f'today/{m}'], 'peak_gib'):.2f}x" for m in GPU_MODELS)
    return f"peak memory {now} (was {was})"


@number("gpu.cost")
def _gpu_cost() -> str:
    new = _gpu()
    time = " / ".join(f"{_step(new[f'new/{m}']):.2f}x" for m in GPU_MODELS)
    memory = " / ".join(f"{_step(new[f'new/{m}'], 'peak_gib'):.2f}x" for m in GPU_MODELS)
    batch = " / ".join(str(new[f"new/{m}"]["train"]["batch"]) for m in GPU_MODELS)
    return (f"{time} the plain step's time and {memory} its peak memory (ResNet-50 / ViT-B/16 / "
            f"SmolLM2-shaped Llama, batch {batch}, the Llama's of 512 tokens)")


@number("gpu.kernels")
def _gpu_kernels() -> str:
    new = _gpu()
    return span_of([_step(new[f"new/{m}"], "kernels") for m in GPU_MODELS], "{:.1f}") + "x"


@number("gpu.env")
def _gpu_env() -> str:
    envs = {(j["env"]["gpu"], j["env"]["torch"].split("+")[0].rsplit(".", 1)[0]) for j in _gpu().values()}
    (gpu, torch), = envs
    return f"one {gpu}, bf16, torch {torch}"


STEP_GOAL = 1.2  # issue 29's goal on a GPU: a DMS step at most 1.2x a plain step


def gpu_step_text(ratios: dict[str, float], goal: float = STEP_GOAL) -> str:
    """The README's line on a DMS step's cost on a GPU: each model's step ratio and how many
    miss the goal (counted from the ratios, so a model over the goal shows as a miss).

        >>> gpu_step_text({"resnet50": 1.1, "vit_b16": 1.3, "llama_135m": 1.2})
        'a DMS step is 1.10x a plain step on ResNet-50, 1.30x on ViT-B/16, 1.20x on the SmolLM2-shaped Llama: 1 of 3 over the 1.2x goal'
    """
    missed = sum(ratios[m] > goal + 1e-9 for m in GPU_MODELS)
    verdict = f"all {len(ratios)} within the {goal}x goal" if not missed else \
        f"{missed} of {len(ratios)} over the {goal}x goal"
    return (f"a DMS step is {ratios['resnet50']:.2f}x a plain step on ResNet-50, {ratios['vit_b16']:.2f}x on "
            f"ViT-B/16, {ratios['llama_135m']:.2f}x on the SmolLM2-shaped Llama: {verdict}")


@number("gpu.step.readme")
def _gpu_step_readme() -> str:
    new = _gpu()
    return gpu_step_text({m: _step(new[f"new/{m}"]) for m in GPU_MODELS})


def _export(model: str, batch: str, label: str) -> float:
    lat = _gpu()[f"new/{model}"]["export"]["latency"][batch]
    return lat[label]["median_ms"] / lat["original"]["median_ms"]


LATENCY_BAND = 0.10  # a latency export lands when its measured ratio is within 10 % of its target


def latency_target_text(rows: list[dict[str, Any]], band: float = LATENCY_BAND) -> str:
    """How many latency-budget exports of ``rows`` (``latency_target.json``'s) ran within ``band``
    of their target (0.5: half the original's time), their range, and the MACs arm's range. The
    count comes from the band, so an export that misses it shows as one fewer.

        >>> row = {"target": 0.5, "arms": {"latency0": {"ratio": 0.52}, "latency1": {"ratio": 0.61},
        ...                                "macs": {"ratio": 0.7}}}
        >>> latency_target_text([row])
        "1 of 2 exports within 10 % of half the measured latency (0.52-0.61x the original's time), 0.70x at half the MACs"
    """
    lat = [(a["ratio"], float(r.get("target", 0.5))) for r in rows
           for k, a in r["arms"].items() if k.startswith("latency") and "ratio" in a]
    inside = sum(abs(ratio - target) <= band * target + 1e-9 for ratio, target in lat)
    ratios = [ratio for ratio, _ in lat]
    macs = [r["arms"]["macs"]["ratio"] for r in rows if "ratio" in r["arms"]["macs"]]
    return (f"{inside} of {len(lat)} exports within {100 * band:.0f} % of half the measured latency "
            f"({span_of(ratios)}x the original's time), {span_of(macs)}x at half the MACs")


@number("latency.target")
def _latency_target() -> str:
    return latency_target_text(list(cache("latency_target")["rows"].values()))


@number("latency.target.macs")
def _latency_target_macs() -> str:
    rows = cache("latency_target")["rows"].values()
    return span_of([a["macs_ratio"] for r in rows for k, a in r["arms"].items()
                    if k.startswith("latency") and "macs_ratio" in a])


DEPLOY_CUDA_NAMES = {"vit_base_patch16": "ViT-B/16", "resnet50": "ResNet-50", "yolov8n": "YOLOv8n (640 px)"}


@number("deploy.cuda.compiled")
def _deploy_cuda_compiled() -> str:
    """Pruned / original median latency of the ``torch.compile``d exports at batch 64 (bf16)."""
    parts = []
    for model, m in cache("deploy_latency_cuda")["models"].items():
        b = m["batches"].get("64", {})
        if m.get("compiled") and "compile_orig" in b:
            name = model.split(" (")[0]
            parts.append(f"{DEPLOY_CUDA_NAMES.get(name, name)} {b['compile_pruned'][1] / b['compile_orig'][1]:.2f}x")
    return ", ".join(parts)


@number("gpu.export.readme")
def _gpu_export_readme() -> str:
    return f"{_export('resnet50', '64', 'align8'):.2f}x / {_export('vit_b16', '64', 'align8'):.2f}x"


@number("gpu.export")
def _gpu_export() -> str:
    a8 = (_export("resnet50", "64", "align8"), _export("vit_b16", "64", "align8"), _export("llama_135m", "16", "align8"))
    a1 = (_export("resnet50", "64", "align1"), _export("vit_b16", "64", "align1"), _export("llama_135m", "16", "align1"))

    def free(v: float) -> str:
        return f"{v:.2f}x" if v <= 1 else f"{v:.2f}x slower"
    return (f"ResNet-50 {a8[0]:.2f}x, ViT-B/16 {a8[1]:.2f}x (fused attention kept), Llama at 0.8 x MACs {a8[2]:.2f}x "
            f"at batch 64 / 16 x 512 tokens; free widths: {free(a1[0])}, **{free(a1[1])}**, {free(a1[2])}")


@number("cpu.step")
def _cpu_step() -> str:
    rows = cache("search_overhead")["rows"].values()
    t = [r["time"]["ratio"] for r in rows]
    mem = [r["mem"]["dms"]["peak_mb"] / r["mem"]["plain"]["peak_mb"] - 1 for r in rows]
    return (f"step time {min(t):.2f}-{max(t):.2f}x a plain step, the settle phase no more; peak RSS "
            f"{100 * min(mem):+.0f} to {100 * max(mem):+.0f} %")


OVERHEAD_CNNS = ("resnet20", "small_cnn", "tv_resnet18", "tv_mobilenet_v2", "timm_efficientnet_b0")
OVERHEAD_NAMES = {"resnet20": "ResNet-20", "small_cnn": "small CNN", "tv_resnet18": "torchvision ResNet-18",
                  "tv_mobilenet_v2": "torchvision MobileNetV2", "timm_efficientnet_b0": "timm EfficientNet-B0",
                  "timm_vit_small": "timm ViT-S/16", "hf_llama_tiny": "tiny Llama (3 layers, d 64, GQA)"}


def _overhead() -> dict[str, dict[str, Any]]:
    return cache("search_overhead")["rows"]


def _added(r: dict[str, Any], arm: str) -> float:
    """MB a model and its training add above the imported interpreter (peak - base)."""
    return r["mem"][arm]["peak_mb"] - r["mem"][arm]["base_mb"]


@number("cpu.step.detail")
def _cpu_step_detail() -> str:
    rows = _overhead()
    cnn = [rows[m]["time"]["ratio"] for m in OVERHEAD_CNNS]
    settle = [r["time"]["settle_ratio"] - r["time"]["ratio"] for r in rows.values()]
    mem = [r["mem"]["dms"]["peak_mb"] / r["mem"]["plain"]["peak_mb"] - 1 for r in rows.values()]
    added = [_added(r, "dms") / _added(r, "plain") for r in rows.values()]
    return (f"step time {span_of(cnn)}x on CNNs, {rows['timm_vit_small']['time']['ratio']:.2f}x ViT-S, "
            f"{rows['hf_llama_tiny']['time']['ratio']:.2f}x tiny Llama; the settle phase's step within "
            f"{min(settle):+.2f} to {max(settle):+.2f} of it; peak RSS {100 * min(mem):+.0f} to "
            f"{100 * max(mem):+.0f} %, {span_of(added)}x plain's above the imported interpreter")


@number("cpu.step.commits")
def _cpu_step_commits() -> str:
    commits = sorted({r["commit"] for r in _overhead().values()})
    return ", ".join(f"`{c}`" for c in commits)


@number("cpu.step.table")
def _cpu_step_table() -> str:
    rows = _overhead()
    lines = ["| model | dims | step time DMS / plain (q1-q3) | in the settle phase | peak RSS DMS / plain "
             "| RSS above base, MB plain / DMS (ratio) |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for m, name in OVERHEAD_NAMES.items():
        t, mem = rows[m]["time"], rows[m]["mem"]
        plain, dms = _added(rows[m], "plain"), _added(rows[m], "dms")
        lines.append(f"| {name} | {t['dims']} | {t['ratio']:.2f} ({t['ratio_q1']:.2f}-{t['ratio_q3']:.2f}) | "
                     f"{t['settle_ratio']:.2f} | {mem['dms']['peak_mb'] / mem['plain']['peak_mb']:.2f} | "
                     f"{plain:.0f} / {dms:.0f} ({dms / plain:.2f}) |")
    return "\n".join(lines)


@number("cpu.host")
def _cpu_host() -> str:
    rows = cache("host_time")["rows"]

    def f(arm: str, suffix: str = "") -> str:
        return " / ".join(f"{rows[m + suffix][arm + '_ratio']:.2f}x" for m in GPU_MODELS)
    compiled = (f"; under `torch.compile(model)` {f('dms_compiled')} the compiled plain step's"
                if all("dms_compiled_ratio" in rows[m] for m in GPU_MODELS) else "")
    return (f"host time per step {f('dms')} the plain step's (the same layers at tiny widths, where a step's "
            f"time is its Python and dispatch; was {f('dms', '@before')}), {f('dms_fused')} with the masked "
            f"norms compiled{compiled}")


@number("cpu.host.ratios")
def _cpu_host_ratios() -> str:
    host = cache("host_time")
    return " / ".join(f"{host['rows'][m]['dms_ratio']:.2f}x" for m in GPU_MODELS) + f" at `{host['commit']}`"


@number("cpu.proxies")
def _cpu_proxies() -> str:
    rows = cache("search_proxies")["rows"]
    ms = GPU_MODELS

    def f(field: str, when: str) -> str:
        return " / ".join(f"{rows[f'{m}@{when}'][field]:.2f}x" for m in ms)
    sync_before = max(rows[f"{m}@before"]["dms_sync"] for m in ms)
    sync_now = max(rows[f"{m}@now"]["dms_sync"] for m in ms)
    fused = (f", {f('ops_ratio', 'fused')} with the masked norms fused (`--fuse-norms`, the default on a GPU)"
             if all(f"{m}@fused" in rows for m in ms) else "")
    compiled = (cache("search_proxies").get("compiled") or {}).get("rows", {})
    launch = [compiled[f"{m}@now"]["launch_ratio"] for m in ms if f"{m}@now" in compiled]
    whole = ("; under `torch.compile(model)` " + " / ".join(f"{r:.2f}x" for r in launch)
             + " the compiled plain step's launching operators" if len(launch) == len(ms) else "")
    return (f"operators per step {f('ops_ratio', 'now')} (ResNet-50 / ViT-B / SmolLM2-shaped Llama; was "
            f"{f('ops_ratio', 'before')}){fused}, bytes held for the backward pass at batch 64 {f('bytes_ratio', 'now')} "
            f"(was {f('bytes_ratio', 'before')}), "
            + (f"no host synchronisation in a step (was {sync_before})" if sync_now == 0 else
               f"{sync_now} host synchronisations in a step (was {sync_before})") + whole)


def _deploy() -> dict[str, dict[str, float]]:
    """``{model: {"b1": [torch, ort], "b32": [...]}}``: pruned / original median latency."""
    out = {}
    for model, m in cache("deploy_latency")["models"].items():
        out[model] = {b: [m["batches"][b][f"{rt}_pruned"][1] / m["batches"][b][f"{rt}_orig"][1]
                          for rt in ("torch", "ort")] for b in m["batches"]}
    return out


@number("deploy.cpu")
def _deploy_cpu() -> str:
    d = _deploy()
    b1 = [v for m in d.values() for v in m["1"]]
    b32 = [v for name, m in d.items() if not name.startswith("mobilenet") for v in m["32"]]
    return f"CPU latency {min(b1):.2f}-{max(b1):.2f}x at batch 1; {min(b32):.2f}-{max(b32):.2f}x at batch 32"


# ---------------------------------------------------------------- the documents


@dataclass
class Disagreement:
    file: str
    line: int
    key: str
    document: str
    cache: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.key}: document {self.document!r} != cache {self.cache!r}"


def _expected(key: str) -> str:
    try:
        return value(key)
    except KeyError:
        return f"(no number {key!r} in scripts/doc_numbers.py)"
    except Exception as err:  # a cache missing or not in the shape this key reads
        return f"(cannot compute {key!r}: {type(err).__name__}: {err})"


def _block(text: str) -> bool:
    return "\n" in text


def _same(document: str, want: str) -> bool:
    """A block (a table) must match line for line; an inline span may wrap lines anywhere."""
    if _block(want):
        return document.strip("\n") == want
    return " ".join(document.split()) == " ".join(want.split()) and document == document.strip()


def spans(text: str) -> list[tuple[str, int, str]]:
    """``(key, line, text)`` of every marked span of a document's ``text``."""
    return [(m["key"], text.count("\n", 0, m.start()) + 1, m["text"]) for m in SPAN.finditer(text)]


def _documents(paths: list[Path] | None, root: Path) -> list[Path]:
    return paths if paths else [root / d for d in DOCUMENTS if (root / d).is_file()]


def _name(path: Path, root: Path) -> str:
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return str(path)


def check(paths: list[Path] | None = None, root: Path = ROOT) -> list[Disagreement]:
    """Every span of the documents whose text is not its cache's."""
    out = []
    for path in _documents(paths, root):
        for key, line, text in spans(path.read_text(encoding="utf-8")):
            want = _expected(key)
            if "<!-- num:" in text or "<!-- /num" in text:  # an opening marker left unclosed before this one
                want = "(a span must not hold another marker: is one of them unclosed?)"
            if not _same(text, want):
                got = text.strip("\n") if _block(want) else " ".join(text.split())
                out.append(Disagreement(_name(path, root), line, key, got, want))
    return out


def write(paths: list[Path] | None = None, root: Path = ROOT) -> list[Path]:
    """Rewrite every span from the caches; returns the documents that changed. A key that
    cannot be computed is left as it is (``check`` still reports it)."""
    changed = []
    for path in _documents(paths, root):
        text = path.read_text(encoding="utf-8")

        def sub(m: re.Match) -> str:
            if "<!-- num:" in m["text"]:
                return m.group(0)
            try:
                want = value(m["key"])
            except Exception:
                return m.group(0)
            if _same(m["text"], want):  # keeps the document's line breaks
                return m.group(0)
            body = f"\n\n{want}\n\n" if _block(want) else want
            return f"<!-- num:{m['key']} -->{body}<!-- /num -->"
        new = SPAN.sub(sub, text)
        if new != text:
            path.write_text(new, encoding="utf-8")
            changed.append(path)
    return changed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="report every span that disagrees with its cache (default)")
    mode.add_argument("--write", action="store_true", help="rewrite every span from the caches")
    mode.add_argument("--list", action="store_true", help="print every key and its value")
    p.add_argument("documents", nargs="*", type=Path, help=f"markdown files (default: {', '.join(DOCUMENTS)})")
    args = p.parse_args(argv)
    if args.list:
        for key in sorted(NUMBERS):
            print(f"{key}: {_expected(key)}")
        return 0
    if args.write:
        for path in write(args.documents or None):
            print(f"rewrote {_name(path, ROOT)}")
    bad = check(args.documents or None)
    used = {k for path in _documents(args.documents or None, ROOT) for k, _, _ in spans(path.read_text(encoding="utf-8"))}
    for d in bad:
        print(d)
    if not args.documents:
        unused = sorted(set(NUMBERS) - used)
        if unused:
            print(f"note: keys no document shows: {', '.join(unused)}")
    if bad:
        print(f"{len(bad)} span(s) disagree with the caches; `python scripts/doc_numbers.py --write` rewrites them")
        return 1
    print(f"{len(used)} key(s) in agreement with the caches")
    return 0


if __name__ == "__main__":
    sys.exit(main())
