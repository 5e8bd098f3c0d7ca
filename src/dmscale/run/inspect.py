"""``dmscale inspect`` and ``dmscale show``: a model's search space before any training, and
a finished run's summary again.

:func:`inspect_space` builds the task's model exactly as ``dmscale search`` would (same
options), prepares a searcher and reports what the search could change: every width and
depth dimension, what is fixed and why, and the cost range the search space reaches (its
smallest structure to the supernet) against the target. Nothing is trained or written.

Example:
    >>> from dmscale.config.run_config import RunConfig
    >>> cfg = RunConfig(command="search", task="digits", model="smallcnn",
    ...                 model_args={"width": 4, "blocks": 1}, train_limit=64, test_limit=32)
    >>> space = inspect_space(cfg)
    >>> space["resource"], space["cost"]["min"] < space["cost"]["target"] < space["cost"]["max"]
    ('macs', True)
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import dmscale as dms
from dmscale.config.run_config import ConfigError, RunConfig
from dmscale.engine.rundir import fmt_count
from dmscale.cost.registry import format_in
from dmscale.run.report import format_summary
from dmscale.run.saved_runs import make_searcher
from dmscale.search.search_trace import TRACE_FILE, read_trace
from dmscale.tasks.registry import build_model, build_task
from dmscale.trace.naming import dim_label

__all__ = ["inspect_space", "format_space", "show_run", "search_trace_summary", "format_search_trace"]


def inspect_space(cfg: RunConfig) -> dict[str, Any]:
    """The search space of ``cfg``'s model on its task, as plain data (JSON-serialisable)."""
    cfg = cfg.resolved()
    task = build_task(cfg)
    model, exclude = build_model(cfg, task.info)
    example = task.example_inputs()
    # the whole space at target 1 (any target is valid there); the target is compared below,
    # so an unreachable one is reported instead of refused
    searcher = make_searcher(replace(cfg, target=1.0), model, example, exclude)
    try:
        space, gates = searcher.space, searcher.gates
        width = [{"name": d.name, "label": dim_label(d.name, d.producers), "kind": d.kind, "size": d.size,
                  "unit": int(g.step), "layers": len(d.producers)} for d, g in zip(space.width, gates.width)]
        depth = [{"name": d.name, "blocks": len(d.blocks), "min_keep": d.min_keep} for d in space.depth]
        reach = searcher.costs.profile()
        target = cfg.budgets[cfg.resource]  # the primary budget's
        counts = dms.count(model, example)
        return {
            "model": cfg.model, "task": cfg.task, "resource": cfg.resource,
            "supernet": {"macs": counts["macs"], "params": counts["params"]},
            "cost": {"min": reach["min"], "max": reach["max"],
                     "target": target * reach["max"] if target <= 1 else float(target)},
            "width": width, "depth": depth, "fixed": dict(space.pinned_reasons),
            "align": int(searcher.align), "excluded": list(exclude) + list(cfg.exclude or []),
        }
    finally:
        dms.detach(model)


def format_space(space: dict[str, Any], limit: int = 40) -> str:
    """The text ``dmscale inspect`` prints for :func:`inspect_space`'s result."""
    cost, res = space["cost"], space["resource"]
    reachable = cost["min"] <= cost["target"] <= cost["max"]
    out = [f"dmscale inspect: {space['model'] or 'default model'} on task {space['task']}",
           f"  supernet      {fmt_count(space['supernet']['macs'])} MACs, "
           f"{fmt_count(space['supernet']['params'])} parameters",
           f"  {res:<13} reachable {format_in(res, cost['min'])} .. {format_in(res, cost['max'])}, target "
           f"{format_in(res, cost['target'])} ({'reachable' if reachable else 'NOT reachable: below the smallest structure'})",
           f"  align         widths in multiples of {space['align']}", "",
           f"  {len(space['width'])} width dimensions (elements, unit, layers that write them):"]
    for d in space["width"][:limit]:
        what = f" ({d['label']})" if d.get("label", d["name"]) != d["name"] else ""
        out.append(f"    {d['name']:<40} {d['kind']:<6} {d['size']:>6} x{d['unit']:<3} {d['layers']} layer(s){what}")
    if len(space["width"]) > limit:
        out.append(f"    ... {len(space['width']) - limit} more")
    out += ["", f"  {len(space['depth'])} depth dimensions (removable blocks, kept at least):"]
    out += [f"    {d['name']:<40} {d['blocks']:>3} blocks, >= {d['min_keep']}" for d in space["depth"][:limit]]
    fixed = space["fixed"]
    out += ["", f"  fixed (never searched): {len(fixed)}"]
    out += [f"    {name}: {why}" for name, why in list(fixed.items())[:limit]]
    if space["excluded"]:
        out.append(f"  excluded      {', '.join(space['excluded'])}")
    return "\n".join(out)


def show_run(run_dir: str | Path) -> str:
    """The end-of-run summary of a finished run directory, printed again."""
    path = Path(run_dir) / "summary.json"
    if not path.is_file():
        state = Path(run_dir) / "state.json"
        status = json.loads(state.read_text()).get("status") if state.is_file() else None
        raise ConfigError(f"{run_dir} has no summary.json"
                          + (f" (its state is {status!r}: continue it with --resume)" if status else
                             ": not a finished dmscale run directory"))
    return format_summary(json.loads(path.read_text()))


def search_trace_summary(run_dir: str | Path, phase: str = "search") -> list[dict[str, Any]]:
    """Per dim of a run's search trace (:mod:`dmscale.search.search_trace`), over the traced
    steps of ``phase``: what it is, its size, the kept count at the first and last traced step,
    the mean task- and resource-loss gradients on its ratio (d loss / d a: positive pushes ``a``
    down, keeping elements; negative pushes it up, removing them), the cost per element and the mean raw importance per unit, both at the last step."""
    try:
        dims, records = read_trace(run_dir)
    except FileNotFoundError:
        raise ConfigError(f"{run_dir} has no {TRACE_FILE}: only a `dmscale search` run writes one "
                          "(not with --no-search-trace, nor before this version)") from None
    rows = [r for r in records if r["phase"] == phase] or records
    if not rows:
        raise ConfigError(f"{Path(run_dir) / TRACE_FILE} holds no traced step yet")
    last = rows[-1]

    def mean(key: str, i: int) -> float:
        return sum(r[key][i] for r in rows) / len(rows)
    return [{"name": d["name"], "label": d["label"], "kind": d["kind"], "size": d["size"],
             "layers": d["layers"], "kept_first": rows[0]["kept"][i], "kept_last": last["kept"][i],
             "grad_task": mean("grad_task", i), "grad_resource": mean("grad_resource", i),
             "cost_per_element": last["cost_per_element"][i],
             "importance_mean": last["importance_mean"][i]} for i, d in enumerate(dims)]


def format_search_trace(run_dir: str | Path, limit: int = 60) -> str:
    """The table ``dmscale inspect RUN --search-trace`` prints (:func:`search_trace_summary`):
    gradients as d(loss)/d(a), so a positive task term keeps elements and a negative resource
    term removes them; importance relative to the median dim's."""
    rows = search_trace_summary(run_dir)
    imps = sorted(r["importance_mean"] for r in rows if r["importance_mean"] > 0)
    median = imps[len(imps) // 2] if imps else 0.0
    width = max(12, min(48, max(len(r["label"]) for r in rows)))
    out = [f"search trace of {run_dir} ({TRACE_FILE}; means over the search phase's traced steps)",
           "  d(loss)/d(a) of the task and resource losses: > 0 keeps elements (the ratio a falls), < 0 "
           "removes them; cost per element in the budget's resource; importance per unit over the median dim's",
           "", f"  {'dimension':<{width}} {'size':>5} {'kept':>9} {'task':>9} {'resource':>9} "
           f"{'cost/elem':>10} {'importance':>10}"]
    for r in rows[:limit]:
        rel = f"{r['importance_mean'] / median:.2f}x" if median else "-"
        out.append(f"  {r['label'][:width]:<{width}} {r['size']:>5} {str(r['kept_first']) + '->' + str(r['kept_last']):>9} "
                   f"{r['grad_task']:>+9.3g} {r['grad_resource']:>+9.3g} {fmt_count(r['cost_per_element']):>10} {rel:>10}")
    if len(rows) > limit:
        out.append(f"  ... {len(rows) - limit} more (--out FILE writes them all as JSON)")
    return "\n".join(out)
