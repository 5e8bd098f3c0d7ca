"""The plots of a run's report (matplotlib, Agg backend), written to ``<run>/plots/``:

* ``width.png``: kept width of every searched dimension against the supernet's (like the
  paper's Figure 4), from ``structure.json``;
* ``depth.png``: removable residual blocks per stage, supernet vs kept;
* ``cost.png``: the resource during the search (soft and hard) against the scheduled target
  r_t and the final target, from ``metrics.jsonl``;
* ``training.png``: task loss and accuracy (bits per character for language) per phase;
* ``search_trace.png``: per searched dimension over the search, its kept fraction and the task-
  and resource-loss gradients on its ratio (:mod:`dmscale.search.search_trace`), residual
  streams drawn apart.

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> out = Path(tempfile.mkdtemp()); (out / "plots").mkdir()
    >>> write_plots(out, {"width": [{"name": "fc1", "size": 8, "kept": 4}]}, [], language=False)
    [('Kept width per layer (supernet in grey)', 'plots/width.png')]
    >>> (out / "plots" / "width.png").is_file()
    True
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dmscale.run.report_text import metric_name, width_label

__all__ = ["PHASE_COLORS", "write_plots"]

PHASE_COLORS = {"pretrain": "tab:gray", "search": "tab:blue", "finish": "tab:purple",
                "retrain": "tab:green"}


def write_plots(out: Path, structure: dict[str, Any] | None, records: list[dict[str, Any]],
                language: bool, trace: tuple[list[dict[str, Any]], list[dict[str, Any]]] | None = None
                ) -> list[tuple[str, str]]:
    """Write the plots that the run's files allow into ``out / "plots"`` (which must exist);
    returns (title, path relative to ``out``) of each, in the report's order. ``trace``: the
    run's search trace (:func:`dmscale.search.search_trace.read_trace`), if any."""
    plots: list[tuple[str, str]] = []
    if structure is not None and _plot_width(structure, out / "plots" / "width.png"):
        plots.append(("Kept width per layer (supernet in grey)", "plots/width.png"))
    if structure is not None and _plot_depth(structure, out / "plots" / "depth.png"):
        plots.append(("Blocks per stage", "plots/depth.png"))
    if _plot_cost(records, out / "plots" / "cost.png"):
        plots.append(("Cost against the target during the search", "plots/cost.png"))
    if _plot_training(records, out / "plots" / "training.png", language):
        name = metric_name([r for r in records if r.get("event") == "eval"], language)
        plots.append((f"Task loss and {name}", "plots/training.png"))
    if trace is not None and _plot_trace(trace, out / "plots" / "search_trace.png"):
        plots.append(("What moved each dimension during the search (search_trace.jsonl)",
                      "plots/search_trace.png"))
    return plots


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: Path) -> bool:
    """Lay ``fig`` out, write it to ``path`` and close it (True: a plot was written)."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _plot_width(structure: dict[str, Any], path: Path) -> bool:
    width = structure.get("width") or []
    if not width:
        return False
    plt = _plt()
    names = [width_label(w) for w in width]
    sizes = [w["size"] for w in width]
    kept = [w["kept"] for w in width]
    # the labels stand at 70 degrees: room below the bars for the longest ("... residual stream, ...")
    fig, ax = plt.subplots(figsize=(max(6.0, 0.32 * len(names) + 2), 3.0 + 0.075 * max(len(n) for n in names)))
    xs = range(len(names))
    ax.bar(xs, sizes, color="#d0d7e1", label="supernet")
    ax.bar(xs, kept, color="tab:blue", label="kept")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(names, rotation=70, ha="right", fontsize=7 if len(names) > 20 else 8)
    ax.set_ylabel("width (channels / features)")
    ax.set_title("Kept width per searched dimension")
    ax.legend(frameon=False)
    return _save(plt, fig, path)


def _plot_depth(structure: dict[str, Any], path: Path) -> bool:
    depth = structure.get("depth") or []
    if not depth:
        return False
    plt = _plt()
    names = [d["name"] for d in depth]
    total = [len(d["blocks"]) for d in depth]
    kept = [len(d["kept"]) for d in depth]
    fig, ax = plt.subplots(figsize=(max(4.5, 0.8 * len(names) + 2), 3.6))
    xs = range(len(names))
    ax.bar(xs, total, color="#d0d7e1", label="supernet")
    ax.bar(xs, kept, color="tab:orange", label="kept")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(names)
    ax.set_ylabel("removable residual blocks")
    ax.set_title("Blocks per stage")
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.legend(frameon=False)
    return _save(plt, fig, path)


def _plot_cost(records: list[dict[str, Any]], path: Path) -> bool:
    rows = [r for r in records if "cost_soft" in r and r.get("event") is None]
    if not rows:
        return False
    plt = _plt()
    search_steps = max((r["step"] for r in rows if r["phase"] == "search"), default=0)
    xs = [r["step"] + (search_steps if r["phase"] == "finish" else 0) for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.plot(xs, [r["cost_soft"] for r in rows], label="soft cost r_c", color="tab:blue")
    ax.plot(xs, [r["cost_hard"] for r in rows], label="hard cost (exported)", color="tab:red", lw=1)
    ax.plot(xs, [r["cost_target"] for r in rows], "--", label="target r_t", color="black")
    ax.axhline(rows[-1]["cost_final"], ls=":", color="gray", label="final target")
    if any(r["phase"] == "finish" for r in rows):
        ax.axvline(search_steps, color="tab:purple", lw=0.8, label="structure-only finish")
    ax.set_xlabel("search step")
    ax.set_ylabel(rows[-1].get("resource", "cost") if "resource" in rows[-1] else "cost")
    ax.set_title("Resource during the search")
    ax.legend(frameon=False, fontsize=8)
    return _save(plt, fig, path)


def _plot_training(records: list[dict[str, Any]], path: Path, language: bool) -> bool:
    rows = [r for r in records if r.get("event") is None and "task_loss" in r]
    if not rows:
        return False
    evals = [r for r in records if r.get("event") == "eval"]
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for phase in PHASE_COLORS:
        pr = [r for r in rows if r["phase"] == phase]
        if pr:
            ax1.plot([r["global_step"] for r in pr], [r["task_loss"] for r in pr],
                     color=PHASE_COLORS[phase], label=phase, lw=1)
            if not language:
                ax2.plot([r["global_step"] for r in pr], [100 * r["train_acc"] for r in pr],
                         color=PHASE_COLORS[phase], alpha=0.35, lw=1)
        pe = [r for r in evals if r["phase"] == phase]
        if pe:
            key = ("bpb" if "bpb" in pe[0] else "bpc") if language else ("map50_95" if "map50_95" in pe[0] else "acc")
            scale = 1 if language else 100
            ax2.plot([r["global_step"] for r in pe], [scale * r[key] for r in pe], "o-",
                     color=PHASE_COLORS[phase], label=f"{phase} (test)")
    ax1.set_xlabel("step")
    ax1.set_ylabel("task loss")
    ax1.set_title("Task loss")
    ax1.legend(frameon=False, fontsize=8)
    ax2.set_xlabel("step")
    name = metric_name(evals, language)
    ax2.set_ylabel(f"{name} (test)" if language else f"{name} % (faint: training batches)")
    ax2.set_title(name[0].upper() + name[1:])
    ax2.legend(frameon=False, fontsize=8)
    return _save(plt, fig, path)


def _plot_trace(trace: tuple[list[dict[str, Any]], list[dict[str, Any]]], path: Path) -> bool:
    """Kept fraction of every dim over the search (residual streams and depth in colour, a
    layer's own width in grey), and each dim's mean task / resource gradient on its ratio."""
    dims, records = trace
    rows = [r for r in records if r["phase"] == "search"]
    if not dims or len(rows) < 2:
        return False
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 3.4 + 0.075 * max(len(d["label"]) for d in dims)))
    steps = [r["step"] for r in rows]
    for i, d in enumerate(dims):
        shared = d["label"] != d["name"] or d["kind"] == "depth"
        frac = [r["kept"][i] / d["size"] for r in rows]
        ax1.plot(steps, frac, lw=1.6 if shared else 0.7, color=None if shared else "#b0b8c4",
                 label=d["label"] if shared else None)
    ax1.set_xlabel("search step")
    ax1.set_ylabel("kept / supernet")
    ax1.set_title("Kept fraction (grey: a layer's own width)")
    ax1.legend(frameon=False, fontsize=7)
    xs = range(len(dims))
    task = [sum(r["grad_task"][i] for r in rows) / len(rows) for i in xs]
    res = [sum(r["grad_resource"][i] for r in rows) / len(rows) for i in xs]
    ax2.bar([x - 0.2 for x in xs], task, width=0.4, color="tab:green", label="task loss (> 0 keeps)")
    ax2.bar([x + 0.2 for x in xs], res, width=0.4, color="tab:red", label="resource loss (< 0 removes)")
    ax2.axhline(0, color="black", lw=0.6)
    ax2.set_xticks(list(xs))
    ax2.set_xticklabels([d["label"] for d in dims], rotation=70, ha="right", fontsize=6 if len(dims) > 20 else 7)
    ax2.set_ylabel("mean d(loss)/d(a)")
    ax2.set_title("Gradient on each dimension's ratio")
    ax2.legend(frameon=False, fontsize=7)
    return _save(plt, fig, path)
