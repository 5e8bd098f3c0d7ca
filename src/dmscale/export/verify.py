"""Self-checks: open masks reproduce the model, and an export reproduces the hardened supernet.

Both run on the search's example inputs in eval mode. When a check fails, the model is run
again with a forward hook on every module to find the *first* module (in the order modules
finish) whose output differs, and the :class:`~dmscale.core.errors.VerificationError` names it.

Tolerance: outputs ``a`` and reference ``b`` agree when
``max |a - b| <= tol * (1 + max |b|)``, with ``tol`` = :data:`TOLERANCE` (1e-4) for float32
and float64 outputs and :data:`HALF_TOLERANCE` (2e-2) for float16 / bfloat16 outputs.

Example:
    >>> import torch
    >>> compare([torch.ones(3)], [torch.ones(3) + 1e-7]) is None
    True
    >>> compare([torch.ones(3)], [torch.zeros(3)])
    (0, 1.0, 0.0001)
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import nn

from dmscale.trace.values import tensors_in

__all__ = ["TOLERANCE", "HALF_TOLERANCE", "flat_outputs", "compare", "record_outputs",
           "first_divergence"]

TOLERANCE = 1e-4
HALF_TOLERANCE = 2e-2


def flat_outputs(out: Any) -> list[torch.Tensor]:
    """Every floating-point tensor of a model output (tensor, tuple, dict, ModelOutput)."""
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    return [t for t in tensors_in(out) if t.is_floating_point()]


def tolerance(t: torch.Tensor) -> float:
    return HALF_TOLERANCE if t.dtype in (torch.float16, torch.bfloat16) else TOLERANCE


def compare(got: list[torch.Tensor], ref: list[torch.Tensor]) -> tuple[int, float, float] | None:
    """None when every tensor agrees; else ``(index, max abs diff, allowed diff)`` of the
    first that does not (a shape or count mismatch reports ``inf``)."""
    if len(got) != len(ref):
        return (min(len(got), len(ref)), float("inf"), 0.0)
    for i, (a, b) in enumerate(zip(got, ref)):
        allowed = tolerance(b) * (1.0 + (float(b.detach().abs().max()) if b.numel() else 0.0))
        if a.shape != b.shape:
            return (i, float("inf"), allowed)
        diff = float((a.detach().float() - b.detach().float()).abs().max()) if a.numel() else 0.0
        if not diff <= allowed:  # NaN fails too
            return (i, diff, allowed)
    return None


@contextlib.contextmanager
def record_outputs(model: nn.Module, skip: str = "") -> Iterator[list[tuple[str, list[torch.Tensor]]]]:
    """Record ``(module name, its floating-point outputs)`` in the order modules finish."""
    calls: list[tuple[str, list[torch.Tensor]]] = []
    handles = []
    for name, m in model.named_modules():
        if skip and (name == skip or name.startswith(skip + ".")):
            continue

        def hook(mod: nn.Module, args: Any, out: Any, name: str = name) -> None:
            calls.append((name, [t.detach().clone() for t in flat_outputs(out)]))

        handles.append(m.register_forward_hook(hook))
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def first_divergence(run_a: Callable[[], Any], model_a: nn.Module, run_b: Callable[[], Any],
                     model_b: nn.Module, skip: str = "",
                     align: dict[str, tuple[int, list[int]]] | None = None) -> tuple[str, float, float] | None:
    """Run both and return ``(module name, diff, allowed)`` of the first module whose
    outputs differ, comparing calls of the same name in order.

    ``align``: per module of ``model_a`` (a supernet), ``(channel dim, kept channels)``: its
    first output is sliced to the kept channels before it is compared with ``model_b``'s (an
    export). Other outputs are compared where the shapes agree.
    """
    align = align or {}
    with record_outputs(model_a, skip) as calls_a:
        run_a()
    with record_outputs(model_b, skip) as calls_b:
        run_b()
    by_name: dict[str, list[list[torch.Tensor]]] = {}
    for name, outs in calls_b:
        by_name.setdefault(name, []).append(outs)
    seen: dict[str, int] = {}
    for name, outs in calls_a:
        i = seen.get(name, 0)
        seen[name] = i + 1
        others = by_name.get(name, [])
        if name in align and outs:
            dim, keep = align[name]
            idx = torch.tensor(keep, dtype=torch.long, device=outs[0].device)
            outs = [outs[0].index_select(dim % outs[0].dim(), idx)] + outs[1:]
        if i >= len(others) or [t.shape for t in outs] != [t.shape for t in others[i]]:
            continue  # pruned channels or a removed block: not comparable here
        bad = compare(outs, others[i])
        if bad is not None:
            return name or "<model>", bad[1], bad[2]
    return None


def describe(model: nn.Module, name: str) -> str:
    """``'name' (ClassName)`` of a module, for messages."""
    try:
        m = model.get_submodule("" if name == "<model>" else name)
        return f"{name!r} ({type(m).__name__})"
    except AttributeError:
        return repr(name)
