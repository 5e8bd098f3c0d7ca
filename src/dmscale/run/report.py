"""The report of a run: ``report.md`` with PNG plots, and the one-screen summary.

Plots (matplotlib, Agg backend), written to ``<run>/plots/``:

* ``width.png``: kept width of every searched dimension against the supernet's (like the
  paper's Figure 4), from ``structure.json``;
* ``depth.png``: removable residual blocks per stage, supernet vs kept;
* ``cost.png``: the resource during the search (soft and hard) against the scheduled target
  r_t and the final target, from ``metrics.jsonl``;
* ``training.png``: task loss and accuracy (bits per character for language) per phase.

Example:
    >>> print(format_count(31_021_952), format_count(512))
    31.02M 512
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from dmscale.run.watching import watch_lines, watch_report_lines

__all__ = ["write_report", "format_summary", "align_line", "read_metrics", "format_count", "posthoc_line", "reach_hint",
           "metric_name", "lm_metrics_text"]

# How far (lr x steps) the structure parameters must be able to move for the search itself to
# reach a budget: a ratio moves 0.2-0.5 to halve a network's MACs, and Adam moves it by about
# the learning rate per step (bench/results/table16.md: 110 steps at lr 5e-4 never reached
# the target, at 5e-3 every run did).
REACH = 0.3

PHASE_COLORS = {"pretrain": "tab:gray", "search": "tab:blue", "finish": "tab:purple",
                "retrain": "tab:green"}


def format_count(value: float | None) -> str:
    """A count with a K/M/G suffix."""
    if value is None:
        return "-"
    for unit, div in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= div:
            return f"{value / div:.2f}{unit}"
    return f"{value:.0f}"


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of ``metrics.jsonl`` (a torn last line is skipped)."""
    p = Path(run_dir) / "metrics.jsonl"
    out = []
    if p.is_file():
        for line in p.read_text(encoding="utf-8").splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _plot_width(structure: dict[str, Any], path: Path) -> bool:
    width = structure.get("width") or []
    if not width:
        return False
    plt = _plt()
    names = [w["name"] for w in width]
    sizes = [w["size"] for w in width]
    kept = [w["kept"] for w in width]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.32 * len(names) + 2), 4.2))
    xs = range(len(names))
    ax.bar(xs, sizes, color="#d0d7e1", label="supernet")
    ax.bar(xs, kept, color="tab:blue", label="kept")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(names, rotation=70, ha="right", fontsize=7 if len(names) > 20 else 8)
    ax.set_ylabel("width (channels / features)")
    ax.set_title("Kept width per searched dimension")
    ax.legend(frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def metric_name(evals: list[dict[str, Any]], language: bool) -> str:
    """What the evaluations of a run measure, for plot labels.

    Example:
        >>> metric_name([{"bpb": 2.1, "ppl": 150.0}], language=True)
        'bits per byte'
        >>> metric_name([{"map50_95": 0.3}], language=False)
        'box mAP50-95'
    """
    first = evals[0] if evals else {}
    if language:
        return "bits per byte" if "bpb" in first else "bits per character"
    return "box mAP50-95" if "map50_95" in first else "accuracy"


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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _detect_text(ev: dict[str, Any]) -> str:
    """A detection evaluation (``--task detect``): box mAP on the val split."""
    return f"box mAP50-95 {100 * ev['map50_95']:.2f}, mAP50 {100 * ev['map50']:.2f}"


def lm_metrics_text(ev: dict[str, Any], long: bool = False) -> str:
    """A language model's metrics: bits per byte (``--task text``, tokens) or per character.

    Example:
        >>> lm_metrics_text({"bpb": 1.2345, "ppl": 20.0, "acc": 0.4})
        'perplexity 20.00, 1.234 bits/byte'
    """
    if "bpb" in ev:
        text = f"perplexity {ev['ppl']:.2f}, {ev['bpb']:.3f} bits/byte"
        return text + (f", next-token acc {100 * ev['acc']:.1f}%" if long else "")
    text = f"{ev['bpc']:.3f} bits/char, perplexity {ev['ppl']:.2f}"
    return text + (f", next-char acc {100 * ev['acc']:.1f}%" if long else "")


def _metric_line(evals: dict[str, Any], language: bool) -> str:
    final = evals.get("final")
    if not final:
        return "-"
    if "map50_95" in final:
        return _detect_text(final) + " (val)"
    if language:
        return lm_metrics_text(final, long=True)
    return f"{100 * final['acc']:.2f}% test accuracy"


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Write ``report.md`` and ``plots/*.png`` for a run; returns the report's path."""
    rd = Path(run_dir)
    out = Path(out_dir) if out_dir is not None else rd
    (out / "plots").mkdir(parents=True, exist_ok=True)
    cfg = yaml.safe_load((rd / "config.yaml").read_text(encoding="utf-8")) if (rd / "config.yaml").is_file() else {}
    structure = json.loads((rd / "structure.json").read_text()) if (rd / "structure.json").is_file() else None
    state = json.loads((rd / "state.json").read_text()) if (rd / "state.json").is_file() else {}
    summary = json.loads((rd / "summary.json").read_text()) if (rd / "summary.json").is_file() else {}
    records = read_metrics(rd)
    language = (cfg.get("task_info") or {}).get("kind") == "language"
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

    counts = state.get("counts", {})
    sup, found = counts.get("supernet", {}), counts.get("found", {})
    evals = state.get("evals", {})
    res = state.get("resources") or {}
    lines = [f"# dmscale run: {rd.name}", ""]
    lines += [f"- command: `dmscale {cfg.get('command', '?')}`"
              + (f", pipeline `{cfg.get('pipeline')}`" if cfg.get("command") == "search" else ""),
              f"- task: {summary.get('task', cfg.get('task'))}",
              f"- model: `{cfg.get('model')}`" + (f" {cfg.get('model_args')}" if cfg.get("model_args") else "")
              + (f", expanded {cfg.get('expand')}" if cfg.get("expand") else ""),
              f"- status: {state.get('status', '?')}, {state.get('global_step', 0)} steps, "
              f"{state.get('elapsed', 0):.0f} s, {_processes(summary.get('processes', 1))}",
              f"- result: {_metric_line(evals, language)}", ""]
    lines += ["| | supernet | found |", "|---|---:|---:|",
              f"| MACs (one example) | {format_count(sup.get('macs'))} | {format_count(found.get('macs'))} |",
              f"| parameters | {format_count(sup.get('params'))} | {format_count(found.get('params'))} |"]
    if res:
        lines.append(f"| {res['resource']} budget | | {format_count(res['hard'])} of target "
                     f"{format_count(res['target'])} ({100 * res['hard'] / max(res['target'], 1):.1f}%) |")
    lines.append("")
    aligned = align_line(summary.get("align"))
    if aligned:
        lines += [f"- align: {aligned}", ""]
    posthoc = posthoc_line(state.get("resources_search_end"), res)
    if posthoc:
        lines += [f"- {posthoc}", ""]
    for name, ev in evals.items():
        if name == "final":
            continue
        value = (lm_metrics_text(ev) if language
                 else _detect_text(ev) if "map50_95" in ev else f"{100 * ev['acc']:.2f}% accuracy")
        note = " (the exported model, BatchNorm statistics re-estimated, before retraining)" if name == "search" else ""
        lines.append(f"- after {name}{note}: {value}")
    lines += watch_report_lines(summary)
    for w in state.get("warnings", []):
        lines.append(f"- **warning**: {w}")
    lines.append("")
    if structure is not None:
        dep = structure.get("depth") or []
        if dep:
            lines += ["## Depth", "", "| stage | removable blocks | kept |", "|---|---:|---:|"]
            lines += [f"| {d['name']} | {len(d['blocks'])} | {len(d['kept'])} |" for d in dep]
            lines.append("")
        wid = structure.get("width") or []
        if wid:
            lines += ["## Width", "", "| dimension | supernet | kept |", "|---|---:|---:|"]
            lines += [f"| {w['name']} | {w['size']} | {w['kept']} |" for w in wid]
            lines.append("")
    if plots:
        lines += ["## Plots", ""]
        for title, rel in plots:
            lines += [f"### {title}", "", f"![{title}]({rel})", ""]
    lines += ["## Configuration", "", "```yaml",
              yaml.safe_dump({k: v for k, v in cfg.items() if k != "task_info"}, sort_keys=False).rstrip(),
              "```", ""]
    path = out / "report.md"
    tmp = path.with_name("report.md.tmp")
    tmp.write_text("\n".join(lines), encoding="utf-8")
    tmp.replace(path)
    return path


def posthoc_line(search_end: dict[str, Any] | None, final: dict[str, Any] | None) -> str | None:
    """How far the steps after the search (finish phase, budget solver) moved the exported
    cost, or None when they did not change it.

    Example:
        >>> posthoc_line({"hard": 110.0, "target": 100.0}, {"hard": 99.0, "target": 100.0})
        'the search ended at 1.100 x target; the finish phase and budget solver changed the structure to 0.990 x target'
        >>> posthoc_line({"hard": 99.0, "target": 100.0}, {"hard": 99.0, "target": 100.0}) is None
        True
    """
    if not search_end or not final or search_end["hard"] == final["hard"]:
        return None
    t = search_end["target"]
    return (f"the search ended at {search_end['hard'] / t:.3f} x target; the finish phase and "
            f"budget solver changed the structure to {final['hard'] / t:.3f} x target")


def reach_hint(structure_lr: float, steps: int, ended: float) -> str | None:
    """A warning when the search ended over its target (``ended`` = hard cost / target) and its
    structure learning rate let each ratio move only about ``structure_lr x steps`` (Adam's
    step is about its learning rate whatever the gradient's scale): the structure then comes
    from the finish phase and budget solver, not from the search. None otherwise.

    Example:
        >>> reach_hint(5e-4, 110, 1.85)[:72]
        'the search ended at 1.85 x target: with --structure-lr 0.0005 over 110 s'
        >>> reach_hint(0.01, 110, 1.85) is None, reach_hint(5e-4, 110, 1.0) is None
        (True, True)
    """
    if ended <= 1.02 or structure_lr * steps >= REACH:
        return None
    return (f"the search ended at {ended:.2f} x target: with --structure-lr {structure_lr:g} over {steps} "
            f"steps each width or depth ratio can move only about {structure_lr * steps:.2g}, so the "
            "finish phase and budget solver chose the structure, not the search; use --structure-lr "
            f"{REACH / max(steps, 1):.2g} or more, or search longer")


def _processes(n: int) -> str:
    """``1 process``, ``2 processes`` (data-parallel ranks of a torchrun job)."""
    return f"{n} process" + ("es" if n != 1 else "")


def align_line(align: dict[str, Any] | None) -> str:
    """What a search run's widths were aligned to (``summary["align"]``; "" when it has none:
    another command, or a run from before alignment existed).

    Example:
        >>> align_line({"multiple": 8, "unaligned": ["fc2"]})
        'searched widths are multiples of 8, except 1 dim whose size is not: fc2'
        >>> align_line({"multiple": 1, "unaligned": []})
        'off (multiple 1: every width size allowed)'
    """
    if not align:
        return ""
    if int(align.get("multiple", 1)) <= 1:
        return "off (multiple 1: every width size allowed)"
    n, left = int(align["multiple"]), list(align.get("unaligned", []))
    text = f"searched widths are multiples of {n}"
    if left:
        names = ", ".join(left[:4]) + (" ..." if len(left) > 4 else "")
        text += f", except {len(left)} dim{'s' if len(left) > 1 else ''} whose size is not: {names}"
    return text


def format_summary(summary: dict[str, Any]) -> str:
    """The one-screen summary printed at the end of a run."""
    counts = summary.get("counts", {})
    sup, found = counts.get("supernet", {}), counts.get("found", {})
    language = summary.get("task_kind") == "language"
    evals = summary.get("evals", {})
    res = summary.get("resources") or {}
    out = [f"dmscale {summary['command']} finished in {summary['elapsed']:.0f} s "
           f"({summary['steps']} steps, {_processes(summary.get('processes', 1))}, "
           f"phases: {' -> '.join(summary['phases'])})",
           f"  task        {summary['task']}",
           f"  model       {summary['model']}"
           + (f" {summary['model_args']}" if summary.get("model_args") else "")
           + (f", expanded {summary['expand']}" if summary.get("expand") else ""),
           "",
           f"  {'':14}{'supernet':>12}{'found':>12}",
           f"  {'MACs':14}{format_count(sup.get('macs')):>12}{format_count(found.get('macs')):>12}",
           f"  {'parameters':14}{format_count(sup.get('params')):>12}{format_count(found.get('params')):>12}"]
    if res:
        ok = res["hard"] <= res["target"] * (1 + 1e-9)
        share = ""
        if res.get("supernet"):
            share = f" ({100 * res['hard'] / res['supernet']:.1f}% of the supernet)"
        out.append(f"  budget        {res['resource']} {format_count(res['hard'])}{share} "
                   f"{'<=' if ok else 'OVER'} target {format_count(res['target'])}")
    posthoc = posthoc_line(summary.get("resources_search_end"), res)
    if posthoc:
        out.append(f"  post-hoc      {posthoc}")
    st = summary.get("structure")
    if st:
        if st.get("depth"):
            out.append("  depth         " + ", ".join(f"{n}: {k}/{t}" for n, t, k in st["depth"])
                       + " removable blocks kept")
        if st.get("width"):
            kept = sum(k for _, _, k in st["width"])
            total = sum(t for _, t, _ in st["width"])
            ws = " ".join(f"{k}/{t}" for _, t, k in st["width"][:12])
            more = " ..." if len(st["width"]) > 12 else ""
            out.append(f"  width         {kept}/{total} kept over {len(st['width'])} dims: {ws}{more}")
    line = align_line(summary.get("align"))
    if line:
        out.append(f"  align         {line}")
    out.append("")
    for name, ev in evals.items():
        if name == "final":
            continue
        if language:
            value = lm_metrics_text(ev, long=True)
        elif "map50_95" in ev:
            value = _detect_text(ev)
        else:
            value = f"accuracy {100 * ev['acc']:.2f}%"
        note = " (exported, before retraining)" if name == "search" and "retrain" in evals else ""
        out.append(f"  {('after ' + name):14}{value}{note}")
    out += watch_lines(summary)
    for w in summary.get("warnings", []):
        out.append(f"  warning: {w}")
    out.append("")
    out.append(f"  run directory {summary['run_dir']}")
    if summary.get("report"):
        out.append(f"  report        {summary['report']}")
    return "\n".join(out)
