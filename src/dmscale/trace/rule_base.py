"""What every function rule shares: the rule signature, argument lookup, dim normalisation
and :func:`unknown`, the fallback that pins whatever a function without a rule touches.

A rule receives the tracer (typed by :class:`~dmscale.trace.protocol.TraceRecorder`), the
torch function's name, its arguments and its output, and sets the labels of the output.

Example:
    >>> arg((1, 2), {"dim": 5}, 1, "dim"), arg((1, 2), {}, 1, "dim"), arg((1,), {}, 1, "dim", 0)
    (5, 2, 0)
    >>> norm_dim(-1, 4)
    3
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from dmscale.trace.values import tensors_in

if TYPE_CHECKING:
    from dmscale.trace.protocol import TraceRecorder

__all__ = ["Rule", "arg", "norm_dim", "unknown"]

Rule = Callable[["TraceRecorder", str, tuple, dict, Any], None]


def arg(args: tuple, kwargs: dict, pos: int, name: str, default: Any = None) -> Any:
    """Argument ``name`` of a call, passed by keyword or at position ``pos``, else ``default``."""
    if name in kwargs:
        return kwargs[name]
    return args[pos] if len(args) > pos else default


def norm_dim(d: int, n: int) -> int:
    """Dim ``d`` of an ``n``-dim tensor, counted from the front."""
    return d + n if d < 0 else d


def unknown(tr: "TraceRecorder", name: str, args: tuple, kwargs: dict, out: Any) -> None:
    """No rule: every labelled channel it touches is pinned; outputs carry no label."""
    for t in tensors_in(args) + tensors_in(kwargs):
        lab = tr.label_of(t)
        if lab is not None:
            tr.pin_ids(lab.ids, f"function {name!r} has no channel rule")
