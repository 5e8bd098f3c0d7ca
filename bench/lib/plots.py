"""The plots of the tables whose scripts draw none themselves, each from its json cache
(``python -m bench.results_plots`` draws them all; :data:`PLOTS` maps a cache to its plot)."""



from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Callable

from bench.lib.benchlib import pyplot, save_figure

__all__ = ["PLOTS", "plot_peers", "plot_budget", "plot_yolo", "plot_schedule", "plot_search_overhead",
           "plot_deploy_latency", "plot_llm_baselines", "latency_ratios"]


def _mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def plot_peers(cache: dict[str, Any], out: Path) -> Path:
    """Top-1 after finetune per method, one group of bars per full setting (no quick runs)."""
    methods = ("dms_p", "tp_magnitude", "tp_taylor", "uniform")
    keys = [k for k, s in sorted(cache["settings"].items(), key=lambda kv: (-kv[1]["target"], kv[0]))
            if s["finetune_epochs"] >= 1 and not s.get("structure_lr")]  # not the structure-lr ablation
    plt = pyplot()
    fig, (ax, pareto) = plt.subplots(1, 2, figsize=(19, 4.8), gridspec_kw={"width_ratios": [2.2, 1]})
    width = 0.8 / len(methods)
    low = 100.0
    for g, key in enumerate(keys):
        runs = cache["runs"].get(key, {})
        seeds = sorted(s for s, r in runs.items() if all(m in r for m in methods))
        for i, m in enumerate(methods):
            accs = [100 * runs[s][m]["acc"] for s in seeds]
            if not accs:
                continue
            mean, sd = _mean_sd(accs)
            low = min(low, min(accs), mean - sd)
            x = g + (i - (len(methods) - 1) / 2) * width
            ax.bar(x, mean, width, yerr=sd, capsize=2, color=f"C{i}", label=m if g == 0 else None)
            ax.plot([x] * len(accs), accs, "k.", ms=3)
    labels = []
    for key in keys:
        s = cache["settings"][key]
        width = f"width {s['width']}\n" if s.get("width", 8) != 8 else ""  # own line: labels sit close
        labels.append(f"{width}{s['target']} x MACs\n" + ("peers finetuned\n+search epochs" if s.get("equal_training")
                                                           else "same finetune")
                      + (f"\nDMS_p settle {s['settle']}" if s.get("settle") else ""))
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("top-1 after finetune (%)")
    ax.set_ylim(5 * int(low // 5), 100)
    ax.set_title("Table 4: DMS_p vs Torch-Pruning vs uniform width (digits ResNet-20, mean ± std, seeds as dots)",
                 fontsize=9)
    ax.legend(fontsize=8, ncol=4, loc="lower right")
    same = [k for k in keys if not cache["settings"][k].get("equal_training")
            and cache["settings"][k].get("width", 8) == 8]  # one supernet per panel: the width-8 one
    settled = [k for k in same if cache["settings"][k].get("settle")]  # the library's default since
    _pareto(pareto, cache, settled or same, methods)
    return save_figure(fig, out)


def _pareto(ax: Any, cache: dict[str, Any], keys: list[str], methods: tuple[str, ...]) -> None:
    """Top-1 against the exported MACs (fraction of the supernet) per method across the
    same-finetune settings, mean ± std over the seeds every method finished; the pretrained
    supernet's top-1 at 1.0."""
    pre = []
    for i, m in enumerate(methods):
        pts = []
        for key in keys:
            runs = cache["runs"].get(key, {})
            rs = [runs[s][m] for s in sorted(runs) if all(x in runs[s] for x in methods)]
            if rs:
                pts.append((statistics.mean(r["macs_frac"] for r in rs), *_mean_sd([100 * r["acc"] for r in rs])))
                pre += [100 * r["pretrain_acc"] for r in rs if "pretrain_acc" in r]
        pts.sort()
        ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o",
                    capsize=2, color=f"C{i}", label=m)
    if pre:
        ax.plot([1.0], [statistics.mean(pre)], "k*", ms=9, label="supernet (unpruned, pretrained)")
    ref = list({seed: 100 * r["unpruned"]["acc"] for key in keys  # one per seed: every target shares it
                for seed, r in cache["runs"].get(key, {}).items() if "unpruned" in r}.values())
    if ref:  # the ceiling: the supernet finetuned like every method
        ax.errorbar([1.0], [statistics.mean(ref)], yerr=[_mean_sd(ref)[1]], marker="s", color="k", capsize=2,
                    fillstyle="none", label="supernet + the same finetune")
    ax.set_xlabel("exported MACs / supernet MACs")
    ax.set_ylim(top=100.5)
    ax.set_ylabel("top-1 after the same finetune (%)")
    ax.set_title("accuracy against MACs (same finetune" + (", DMS_p settle " + str(cache["settings"][keys[0]]["settle"])
                 if keys and cache["settings"][keys[0]].get("settle") else "") + ")", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")


def plot_budget(cache: dict[str, Any], out: Path) -> Path:
    """Exported cost / target per (target, mode) of the longest searches: at the search's end
    and exported."""
    epochs = max(r["epochs"] for r in cache["runs"].values())
    rows = [r for r in cache["runs"].values() if r["epochs"] == epochs]
    order = {"soft": 0, "exact": 1, "anneal": 2, "settle": 3}  # bench/budget.py's MODES
    groups = sorted({(r.get("width", 8), r["target"], r["mode"]) for r in rows},
                    key=lambda t: (t[0], -t[1], order.get(t[2], 9), t[2]))
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(7, 1.1 * len(groups)), 4))
    for g, (width, target, mode) in enumerate(groups):
        rs = [r for r in rows if (r.get("width", 8), r["target"], r["mode"]) == (width, target, mode)]
        for j, (field, label) in enumerate((("search_end", "at the search's end (loss alone)"),
                                            ("exported", "exported (after finish + solver)"))):
            vals = [r[field] for r in rs]
            mean, sd = _mean_sd(vals)
            x = g + (j - 0.5) * 0.38
            ax.bar(x, mean, 0.38, yerr=sd, capsize=2, color=f"C{j + 1}", label=label if g == 0 else None)
            ax.plot([x] * len(vals), vals, "k.", ms=3)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(range(len(groups)))
    names = {"settle": "settle+hold", "anneal": "settle,\nanneal alone"}
    ax.set_xticklabels([f"width {w}\ntarget {t}\n{names.get(m, m)}" for w, t, m in groups], fontsize=8)
    ax.axhspan(0.98, 1.0, color="C2", alpha=0.15, lw=0)
    ax.set_ylabel("exact MACs / target")
    ax.set_title(f"Table 6: does the resource loss land on the budget?\n(DMS_np, digits, {epochs:g} "
                 "search epochs; band [0.98, 1.00] shaded)", fontsize=9)
    ax.set_ylim(0.85, max(1.25, max(r["search_end"] for r in rows) + 0.03))
    ax.legend(fontsize=8)
    return save_figure(fig, out)


def plot_yolo(cache: dict[str, Any], out: Path) -> Path:
    """mAP50-95 per arm (seeds as dots) and MACs / YOLOv8n's MACs per arm."""
    arms = list(cache["rows"])
    base = cache["base_macs"]
    imgsz = cache.get("settings", {}).get("data", {}).get("imgsz", 64)
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(8, 3.5))
    for i, arm in enumerate(arms):
        rs = cache["rows"][arm]
        for ax, field, scale in ((ax1, "map50_95", 100.0), (ax2, "macs", 1.0 / base)):
            vals = [scale * r[field] for r in rs]
            mean, sd = _mean_sd(vals)
            ax.bar(i, mean, yerr=sd, capsize=2, color=f"C{i}")
            ax.plot([i] * len(vals), vals, "k.", ms=3)
    for ax in (ax1, ax2):
        ax.set_xticks(range(len(arms)))
        ax.set_xticklabels(arms, fontsize=8)
    ax1.set_ylabel("box mAP50-95 (%)")
    ax1.set_ylim(0, max(1.0, ax1.get_ylim()[1]))
    ax2.axhline(1.0, color="k", lw=0.8, ls="--")
    ax2.set_ylabel(f"MACs / YOLOv8n's ({base / 1e6:.1f} M at {imgsz} px)")
    ratios = [r["macs"] / base for rs in cache["rows"].values() for r in rs]
    ax2.set_ylim(min(0.9, min(ratios) - 0.02), max(1.05, max(ratios) + 0.02))  # bars cropped: the ratio matters
    best = max((r["map50_95"] for rs in cache["rows"].values() for r in rs), default=0.0)
    note = " (no conclusion: all arms under 2 mAP)" if best < 0.02 else ""
    fig.suptitle(f"Table 11 analog: YOLOv8n arms on generated MNIST detection{note}", fontsize=9)
    return save_figure(fig, out)


def _arm_label(name: str) -> str:
    """``end=0.6/width_only_from=0.8`` -> two short lines for a tick label."""
    end, wo = (part.split("=")[1] for part in name.split("/"))
    return f"decay {float(end):.0%}\n" + ("no width-only" if wo == "none" else f"width-only {wo}-1")


def plot_schedule(cache: dict[str, Any], out: Path) -> Path:
    """Table 7: cost at search end and accuracy after retraining per arm (the longest cached runs)."""
    epochs = max(r["epochs"] for r in cache["runs"].values())
    rows = [r for r in cache["runs"].values() if r["epochs"] == epochs]
    arms = list(dict.fromkeys(r["arm"] for r in sorted(rows, key=lambda r: (r["seed"], r["arm"]))))
    arms.sort(key=lambda a: ("none" not in a, a.split("/")[0] != "end=1.0"))
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    panels = (("search_end", 1.0, "exact MACs / target at the search's end (loss alone)"),
              ("acc", 100.0, "top-1 after retraining (%)"))
    for ax, (field, scale, title) in zip(axes, panels):
        for i, arm in enumerate(arms):
            vals = [scale * r[field] for r in rows if r["arm"] == arm]
            mean, sd = _mean_sd(vals)
            ax.bar(i, mean, 0.6, yerr=sd, capsize=3, color=f"C{i}")
            ax.plot([i] * len(vals), vals, "k.", ms=4)
        ax.set_xticks(range(len(arms)))
        ax.set_xticklabels([_arm_label(a) for a in arms], fontsize=7)
        ax.set_title(title, fontsize=9)
    axes[0].axhline(1.0, color="k", lw=0.8, ls="--")
    accs = [100 * r["acc"] for r in rows]
    axes[1].set_ylim(max(0.0, min(accs) - 3), min(100.0, max(accs) + 1.5))
    fig.suptitle(f"Table 7: r_t schedule (DMS_np, digits ResNet-20 w8, 0.5 x MACs, {epochs:g} epochs search "
                 "+ retrain; mean ± std, seeds as dots)", fontsize=9)
    return save_figure(fig, out)


def plot_search_overhead(cache: dict[str, Any], out: Path) -> Path:
    """Table 8: DMS / plain step time (median, q1-q3 of per-round ratios) and peak RSS ratios."""
    rows = list(cache["rows"].values())
    names = [r["name"] for r in rows]
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    for i, r in enumerate(rows):
        t = r["time"]
        settle = "settle_ratio" in t  # rows measured since the settle phase: its step too
        x = i - 0.2 if settle else i
        ax1.bar(x, t["ratio"], 0.4 if settle else 0.6, color="C0",
                label="DMS step (before the settle phase)" if i == 0 else None)
        ax1.plot([x, x], [t["ratio_q1"], t["ratio_q3"]], "k-", lw=1.5)
        if settle:
            ax1.bar(i + 0.2, t["settle_ratio"], 0.4, color="C4",
                    label="DMS step in the settle phase (exact-cost band loss)" if i == 0 else None)
        p, d = r["mem"]["plain"], r["mem"]["dms"]
        added_p = p["peak_mb"] - p["base_mb"]
        ax2.bar(i - 0.2, d["peak_mb"] / p["peak_mb"], 0.4, color="C1", label="peak RSS" if i == 0 else None)
        ax2.bar(i + 0.2, (d["peak_mb"] - d["base_mb"]) / added_p if added_p > 0 else 0.0, 0.4, color="C2",
                label="added over the imported interpreter (peak - base)" if i == 0 else None)
    for ax, title in ((ax1, "step time DMS / plain (median; line: q1-q3 of per-round ratios)"),
                      (ax2, "memory DMS / plain (fresh process per variant)")):
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, fontsize=7, rotation=20)
        ax.set_title(title, fontsize=9)
    ax2.legend(fontsize=7)
    if any("settle_ratio" in r["time"] for r in rows):
        ax1.legend(fontsize=7)
    fig.suptitle(f"Table 8: cost of DMS during training (batch {cache['args']['batch']}, "
                 f"{cache['args']['threads']} thread, CPU)", fontsize=9)
    return save_figure(fig, out)


DEPLOY_SERIES = (("torch", 1), ("torch", 32), ("ort", 1), ("ort", 32))


def latency_ratios(entry: dict[str, Any]) -> dict[tuple[str, int], tuple[float, float, float]]:
    """``{(engine, batch): (ratio of medians, low, high)}`` for one model of ``deploy_latency.json``;
    low/high divide the pruned quartiles by the opposite original quartiles (a crude spread).

    Example:
        >>> e = {"batches": {"1": {"torch_orig": [9, 10, 11], "torch_pruned": [4, 5, 6],
        ...                        "ort_orig": [1, 2, 3], "ort_pruned": [1, 2, 3]}}}
        >>> latency_ratios(e)[("torch", 1)]
        (0.5, 0.36363636363636365, 0.6666666666666666)
    """
    out = {}
    for engine, batch in DEPLOY_SERIES:
        b = entry["batches"].get(str(batch))
        if b is None:
            continue
        o, p = b[f"{engine}_orig"], b[f"{engine}_pruned"]
        out[(engine, batch)] = (p[1] / o[1], p[0] / o[2], p[2] / o[0])
    return out


def plot_deploy_latency(cache: dict[str, Any], out: Path) -> Path:
    """Pruned / original latency per model, engine (PyTorch, onnxruntime) and batch, as bars
    with the crude quartile spread; a black dash at each model's MACs ratio."""
    names = list(cache["models"])
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(DEPLOY_SERIES)
    for g, name in enumerate(names):
        entry = cache["models"][name]
        ratios = latency_ratios(entry)
        for i, key in enumerate(DEPLOY_SERIES):
            if key not in ratios:
                continue
            mid, low, high = ratios[key]
            x = g + (i - (len(DEPLOY_SERIES) - 1) / 2) * width
            ax.bar(x, mid, width, yerr=[[mid - low], [high - mid]], capsize=2, color=f"C{i}",
                   label=f"{'PyTorch' if key[0] == 'torch' else 'onnxruntime'}, batch {key[1]}" if g == 0 else None)
        ax.plot([g - 0.45, g + 0.45], [entry["macs_ratio"]] * 2, "k-", lw=2,
                label="MACs ratio" if g == 0 else None)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([f"{n.split(' ')[0]}\n{cache['models'][n]['size']} px" for n in names], fontsize=8)
    ax.set_ylabel("pruned / original latency (medians)")
    ax.set_title("Deployment latency at half the MACs, 1 CPU thread on a shared machine "
                 "(whiskers: pruned IQR / original IQR)", fontsize=9)
    ax.legend(fontsize=7, ncol=3, loc="upper left")
    ax.set_ylim(0, max(1.6, ax.get_ylim()[1]))
    return save_figure(fig, out)


def plot_llm_baselines(cache: dict[str, Any], out: Path) -> Path:
    """Held-out perplexity (log scale) per parameter target and method: bars after the shared
    finetune, dots before it; the original model (finetuned and not) as lines."""
    rows = cache["rows"]
    methods = [m for m in ("dms", "taylor", "magnitude", "shortgpt") if any(r["method"] == m for r in rows)]
    targets = sorted({r["target"] for r in rows if r["method"] != "original"}, reverse=True)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(methods))
    for j, m in enumerate(methods):
        for g, t in enumerate(targets):
            rs = [r for r in rows if r["method"] == m and r["target"] == t and r["same_finetune"]]
            if not rs:
                continue
            x = g + (j - (len(methods) - 1) / 2) * width
            ax.bar(x, rs[0]["after"]["ppl"], width, color=f"C{j}", label=cache["labels"][m] if g == 0 else None)
            ax.plot(x, rs[0]["before"]["ppl"], "k.", ms=5)
    ax.axhline(cache["original"]["ppl"], color="k", lw=0.8, ls="--", label="original, not finetuned")
    for r in rows:
        if r["method"] == "original" and r["same_finetune"]:
            ax.axhline(r["after"]["ppl"], color="grey", lw=0.8, ls=":", label="original, finetuned")
    ax.set_yscale("log")
    ax.set_xticks(range(len(targets)))
    ax.set_xticklabels([f"{t:.0%} of parameters" for t in targets])
    ax.set_ylabel("held-out perplexity (dots: before finetuning)")
    ax.set_title("Table 5 analog: SmolLM2-135M, same finetune for every arm", fontsize=9)
    ax.legend(fontsize=7)
    return save_figure(fig, out)


PLOTS: dict[str, Callable[[dict[str, Any], Path], Path]] = {
    "peers": plot_peers,
    "budget": plot_budget,
    "yolo_table11": plot_yolo,
    "schedule": plot_schedule,
    "search_overhead": plot_search_overhead,
    "deploy_latency": plot_deploy_latency,
    "llm_baselines": plot_llm_baselines,
}
