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
from dmscale.run.report import format_summary
from dmscale.run.saved_runs import make_searcher
from dmscale.tasks.registry import build_model, build_task

__all__ = ["inspect_space", "format_space", "show_run"]


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
        width = [{"name": d.name, "kind": d.kind, "size": d.size, "unit": int(g.step),
                  "layers": len(d.producers)} for d, g in zip(space.width, gates.width)]
        depth = [{"name": d.name, "blocks": len(d.blocks), "min_keep": d.min_keep} for d in space.depth]
        reach = searcher.profile()
        target = cfg.target[cfg.resource] if isinstance(cfg.target, dict) else cfg.target  # the first budget
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
           f"  {res:<13} reachable {fmt_count(cost['min'])} .. {fmt_count(cost['max'])}, target "
           f"{fmt_count(cost['target'])} ({'reachable' if reachable else 'NOT reachable: below the smallest structure'})",
           f"  align         widths in multiples of {space['align']}", "",
           f"  {len(space['width'])} width dimensions (elements, unit, layers that write them):"]
    for d in space["width"][:limit]:
        out.append(f"    {d['name']:<40} {d['kind']:<6} {d['size']:>6} x{d['unit']:<3} {d['layers']} layer(s)")
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
