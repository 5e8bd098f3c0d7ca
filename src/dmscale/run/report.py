"""The report of a run: ``report.md`` (with the plots of :mod:`dmscale.run.report_plots`)
and the one-screen summary printed at the end; the phrases both use are
:mod:`dmscale.run.report_text` (re-exported here).

Example:
    >>> print(format_count(31_021_952), format_count(512))
    31.02M 512
    >>> read_metrics("/nonexistent-run")
    []
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from dmscale.config.defaults import chosen_lines
from dmscale.cost.registry import format_in
from dmscale.run.report_plots import write_plots
from dmscale.search.search_trace import TRACE_FILE, read_trace
from dmscale.run.report_text import (align_line, width_label, budgets_of, detect_text, format_count, fused_line,
                                     lm_eval_lines, lm_metrics_text, metric_line, metric_name, original_line, posthoc_line,
                                     processes_text, reach_hint)
from dmscale.run.watching import watch_lines, watch_report_lines

__all__ = ["write_report", "format_summary", "align_line", "read_metrics", "format_count", "posthoc_line", "reach_hint",
           "metric_name", "lm_metrics_text"]


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
    trace = read_trace(rd) if (rd / TRACE_FILE).is_file() else None
    plots = write_plots(out, structure, records, language, trace)

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
              f"{state.get('elapsed', 0):.0f} s, {processes_text(summary.get('processes', 1))}",
              f"- result: {metric_line(evals, language)}"]
    cost = original_line(state.get("original"), evals.get("final"))
    if cost:
        lines.append(f"- original -> found: {cost}")
    evaluated = lm_eval_lines(state.get("lm_eval"))
    if evaluated:
        lines.append("- LLM evaluation, original -> found:")
        lines += [f"  - {line}" for line in evaluated]
    lines.append("")
    lines += ["| | supernet | found |", "|---|---:|---:|",
              f"| MACs (one example) | {format_count(sup.get('macs'))} | {format_count(found.get('macs'))} |",
              f"| parameters | {format_count(sup.get('params'))} | {format_count(found.get('params'))} |"]
    for name, b in budgets_of(res).items():  # every budget of the search
        lines.append(f"| {name} budget | {format_in(name, b.get('supernet'))} | {format_in(name, b['hard'])} of target "
                     f"{format_in(name, b['target'])} ({100 * b['hard'] / max(b['target'], 1):.1f}%) |")
    lines.append("")
    aligned = align_line(summary.get("align"))
    if aligned:
        lines += [f"- align: {aligned}", ""]
    fused = fused_line(summary.get("fused_norms"))
    if fused:
        lines += [f"- masked norms: {fused}", ""]
    auto = chosen_lines(summary.get("auto") or {})
    if auto:
        lines += ["- auto options: " + "; ".join(auto), ""]
    posthoc = posthoc_line(state.get("resources_search_end"), res)
    if posthoc:
        lines += [f"- {posthoc}", ""]
    for name, ev in evals.items():
        if name == "final":
            continue
        value = (lm_metrics_text(ev) if language
                 else detect_text(ev) if "map50_95" in ev else f"{100 * ev['acc']:.2f}% accuracy")
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
            lines += ["## Width", "", "| dimension | its layers | supernet | kept |", "|---|---|---:|---:|"]
            lines += [f"| {width_label(w)} | `{w['name']}`"
                      + (f" and {len(w['producers']) - 1} more" if len(w.get("producers") or []) > 1 else "")
                      + f" | {w['size']} | {w['kept']} |" for w in wid]
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


def format_summary(summary: dict[str, Any]) -> str:
    """The one-screen summary printed at the end of a run."""
    counts = summary.get("counts", {})
    sup, found = counts.get("supernet", {}), counts.get("found", {})
    language = summary.get("task_kind") == "language"
    evals = summary.get("evals", {})
    res = summary.get("resources") or {}
    out = [f"dmscale {summary['command']} finished in {summary['elapsed']:.0f} s "
           f"({summary['steps']} steps, {processes_text(summary.get('processes', 1))}, "
           f"phases: {' -> '.join(summary['phases'])})",
           f"  task        {summary['task']}",
           f"  model       {summary['model']}"
           + (f" {summary['model_args']}" if summary.get("model_args") else "")
           + (f", expanded {summary['expand']}" if summary.get("expand") else ""),
           "",
           f"  {'':14}{'supernet':>12}{'found':>12}",
           f"  {'MACs':14}{format_count(sup.get('macs')):>12}{format_count(found.get('macs')):>12}",
           f"  {'parameters':14}{format_count(sup.get('params')):>12}{format_count(found.get('params')):>12}"]
    for name, b in budgets_of(res).items():  # every budget of the search
        ok = b["hard"] <= b["target"] * (1 + 1e-9)
        share = ""
        if b.get("supernet"):
            share = f" ({100 * b['hard'] / b['supernet']:.1f}% of the supernet)"
        out.append(f"  budget        {name} {format_in(name, b['hard'])}{share} "
                   f"{'<=' if ok else 'OVER'} target {format_in(name, b['target'])}")
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
    line = fused_line(summary.get("fused_norms"))
    if line:
        out.append(f"  masked norms  {line}")
    for i, chosen in enumerate(chosen_lines(summary.get("auto") or {})):
        out.append(f"  {'auto options' if i == 0 else '':14}{chosen}")
    out.append("")
    for name, ev in evals.items():
        if name == "final":
            continue
        if language:
            value = lm_metrics_text(ev, long=True)
        elif "map50_95" in ev:
            value = detect_text(ev)
        else:
            value = f"accuracy {100 * ev['acc']:.2f}%"
        note = " (exported, before retraining)" if name == "search" and "retrain" in evals else ""
        out.append(f"  {('after ' + name):13} {value}{note}")
    cost = original_line(summary.get("original"), evals.get("final"))
    if cost:
        out.append(f"  original -> found  {cost}")
    for i, line in enumerate(lm_eval_lines(summary.get("lm_eval"))):
        out.append(f"  {'LLM evaluation' if i == 0 else '':17} {line}")
    out += watch_lines(summary)
    for w in summary.get("warnings", []):
        out.append(f"  warning: {w}")
    out.append("")
    out.append(f"  run directory {summary['run_dir']}")
    if summary.get("report"):
        out.append(f"  report        {summary['report']}")
    return "\n".join(out)
