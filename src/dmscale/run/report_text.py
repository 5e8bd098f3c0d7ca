"""The phrases a run's report and its one-screen summary share: counts with a K/M/G suffix,
evaluation metrics (accuracy, box mAP, bits per byte or character), the alignment of the
searched widths, what the steps after the search changed, and the warning for a structure
learning rate too small to reach the budget.

Example:
    >>> print(format_count(31_021_952), format_count(512))
    31.02M 512
    >>> processes_text(2)
    '2 processes'
"""

from __future__ import annotations

from typing import Any

from dmscale.cost.registry import format_value
from dmscale.trace.naming import dim_label

__all__ = ["REACH", "format_count", "metric_name", "detect_text", "lm_metrics_text", "metric_line", "original_line",
           "lm_eval_lines",
           "posthoc_line", "reach_hint", "processes_text", "align_line", "fused_line", "budgets_of", "width_label"]

# How far (lr x steps) the structure parameters must be able to move for the search itself to
# reach a budget: a ratio moves 0.2-0.5 to halve a network's MACs, and Adam moves it by about
# the learning rate per step.
REACH = 0.3


# a count with a K/M/G suffix (``-`` for None): the registry's display of counts
format_count = format_value


def budgets_of(resources: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """Every budget of a search's ``resources()`` (a run's ``state.json`` / ``summary.json``):
    ``{resource: {"soft", "hard", "target", "supernet"}}``, the one budget of a single-budget
    search included.

        >>> budgets_of({"resource": "params", "hard": 9.0, "target": 10.0})
        {'params': {'resource': 'params', 'hard': 9.0, 'target': 10.0}}
        >>> list(budgets_of({"resource": "params", "budgets": {"params": {}, "kv_cache": {}}}))
        ['params', 'kv_cache']
    """
    if not resources:
        return {}
    return dict(resources.get("budgets") or {resources["resource"]: resources})


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


def detect_text(ev: dict[str, Any]) -> str:
    """A detection evaluation (``--task detect``): box mAP on the val split.

    Example:
        >>> detect_text({"map50_95": 0.3, "map50": 0.5})
        'box mAP50-95 30.00, mAP50 50.00'
    """
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


def metric_line(evals: dict[str, Any], language: bool) -> str:
    """The result line of a report: the final evaluation, or "-" without one.

    Example:
        >>> metric_line({"final": {"acc": 0.9123}}, language=False), metric_line({}, language=False)
        ('91.23% test accuracy', '-')
    """
    final = evals.get("final")
    if not final:
        return "-"
    if "map50_95" in final:
        return detect_text(final) + " (val)"
    if language:
        return lm_metrics_text(final, long=True)
    return f"{100 * final['acc']:.2f}% test accuracy"


def original_line(original: dict[str, Any] | None, found: dict[str, Any] | None) -> str | None:
    """What pruning cost an ``hf:`` run: the original model's perplexity and bits per byte,
    then the found model's, on the same held-out tokens; None without both.

    Example:
        >>> original_line({"ppl": 156.04, "bpb": 1.5}, {"ppl": 3319.2, "bpb": 2.75})
        'perplexity 156.04 -> 3,319.20, 1.500 -> 2.750 bits/byte'
        >>> original_line(None, {"ppl": 3.0, "bpb": 1.0}) is None
        True
    """
    if not original or not found or "bpb" not in original or "bpb" not in found:
        return None
    return (f"perplexity {original['ppl']:,.2f} -> {found['ppl']:,.2f}, "
            f"{original['bpb']:.3f} -> {found['bpb']:.3f} bits/byte")


def lm_eval_lines(record: dict[str, Any] | None) -> list[str]:
    """One line per metric of an LLM evaluation (:mod:`dmscale.run.lm_evaluation`): the
    original's value -> the found model's, accuracies in percent with their standard error.

    Example:
        >>> rec = {"original": {"arc_easy": {"acc": 0.5, "acc_stderr": 0.05, "examples": 100},
        ...                     "wikitext2": {"ppl": 20.0, "window": 128, "protocol": "llm-pruner"}},
        ...        "found": {"arc_easy": {"acc": 0.4, "acc_stderr": 0.049, "examples": 100},
        ...                  "wikitext2": {"ppl": 25.5, "window": 128, "protocol": "llm-pruner"}}}
        >>> print("\\n".join(lm_eval_lines(rec)))
        arc_easy acc (100 examples): 50.00 +- 5.00 -> 40.00 +- 4.90
        wikitext2 perplexity (llm-pruner, 128-token windows): 20.00 -> 25.50
    """
    if not record or not record.get("found"):
        return []
    original, found = record.get("original") or {}, record["found"]
    lines = []
    for name, values in found.items():
        before = original.get(name, {})
        if "ppl" in values:
            lines.append(f"{name} perplexity ({values['protocol']}, {values['window']}-token windows): "
                         f"{before.get('ppl', float('nan')):,.2f} -> {values['ppl']:,.2f}")
            continue
        for metric in ("acc", "acc_norm"):
            if metric not in values:
                continue
            def pct(v: dict[str, Any]) -> str:
                if metric not in v:
                    return "-"
                return f"{100 * v[metric]:.2f} +- {100 * v.get(metric + '_stderr', 0.0):.2f}"
            n = f" ({values['examples']:,} examples)" if "examples" in values else ""
            lines.append(f"{name} {metric}{n}: {pct(before)} -> {pct(values)}")
    return lines


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


def processes_text(n: int) -> str:
    """``1 process``, ``2 processes`` (data-parallel ranks of a torchrun job)."""
    return f"{n} process" + ("es" if n != 1 else "")


def fused_line(fused: dict[str, Any] | None) -> str:
    """How a search run's masked norms ran (``summary["fused_norms"]``; "" when they ran
    eagerly as always, or the run had none).

    Example:
        >>> fused_line({"compiled": ["layer_norm"], "failure": None})
        'compiled into fused kernels (layer_norm)'
        >>> fused_line({"compiled": [], "failure": "BackendCompilerFailed: no compiler"})
        'eager: compiling them failed (BackendCompilerFailed: no compiler)'
    """
    if not fused:
        return ""
    if fused.get("failure"):
        return f"eager: compiling them failed ({fused['failure']})"
    return f"compiled into fused kernels ({', '.join(fused.get('compiled') or [])})"


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


def width_label(width: dict[str, Any]) -> str:
    """What a ``structure.json`` width entry is: ``"layer3 residual stream, 3 blocks"`` for a
    width that several blocks write, else its name (:func:`dmscale.trace.naming.dim_label`)."""
    return dim_label(width["name"], width.get("producers") or [width["name"]])
