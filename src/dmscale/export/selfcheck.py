"""The search's self-checks on the example inputs: all masks open reproduce the model, and
the export computes what the hardened supernet computes; both name the first layer that
diverges (tolerances in :mod:`dmscale.export.verify`). They take what they check as plain
values: the model, its example inputs and its gates (or its hardened context and the
structure's layers), not the searcher.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from dmscale.export.selfcheck import describe_inputs, run_example
    >>> describe_inputs((torch.zeros(2, 3), {"mask": torch.ones(2)}))
    '(a tensor of shape (2, 3), keywords mask=a tensor of shape (2,))'
    >>> run_example(nn.Linear(3, 1), torch.zeros(2, 3)).shape
    torch.Size([2, 1])
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager

import torch
from torch import nn

from dmscale.core.errors import VerificationError
from dmscale.trace.handlers.base import handler_for
from dmscale.core.masks import GATES_NAME
from dmscale.core.modes import eval_mode
from dmscale.trace.values import split_inputs
from dmscale.export.verify import compare, describe, first_divergence, flat_outputs

__all__ = ["run_example", "verify_open", "verify_export", "describe_inputs", "fails_on"]


def run_example(model: nn.Module, inputs: Any) -> Any:
    """``model`` on the example ``inputs``: no grad, eval mode (restored afterwards)."""
    args, kwargs = split_inputs(inputs)
    with torch.no_grad(), eval_mode(model):
        return model(*args, **kwargs)


def verify_open(model: nn.Module, inputs: Any, gates: Any, reference: Any) -> None:
    """With every mask of ``gates`` open, ``model`` on ``inputs`` must reproduce ``reference``
    (its output before the gates were attached: the trace's)."""
    def open_run() -> Any:
        with gates.use("open"):
            return run_example(model, inputs)

    bad = compare(flat_outputs(open_run()), flat_outputs(reference))
    if bad is None:
        return
    with gates.use(enabled=False):
        where = first_divergence(lambda: run_example(model, inputs), model, open_run, model, skip=GATES_NAME)
    layer = "no single layer (only the final output)" if where is None else \
        f"{describe(model, where[0])} (differs by {where[1]:.3g}, allowed {where[2]:.3g})"
    fix = "" if where is None else (
        f" Exclude it to keep its channels fixed (SearchConfig(exclude=[{where[0]!r}]) or "
        f"--exclude {where[0]}), or register a handler that knows what it computes "
        "(dmscale.register_handler).")
    raise VerificationError(
        f"with all masks open {type(model).__name__} no longer computes its own output "
        f"(output {bad[0]} differs by {bad[1]:.3g}, allowed {bad[2]:.3g}): dmscale does not "
        f"handle some layer exactly. First layer whose output diverges: {layer}.{fix} "
        "SearchConfig(verify=False) skips this check.")


def verify_export(model: nn.Module, inputs: Any, hardened: Callable[[], ContextManager[Any]],
                  layers: dict[str, Any], small: nn.Module) -> None:
    """The export ``small`` must compute on ``inputs`` what ``model`` computes under
    ``hardened()`` (its 0/1 masks); ``layers``: the structure's per-layer kept channels, to
    compare the layers of the two models channel by channel."""
    def hard_run() -> Any:
        with hardened():
            return run_example(model, inputs)

    try:
        got = flat_outputs(run_example(small, inputs))
    except Exception as err:
        raise VerificationError(
            f"the export fails on the example inputs ({type(err).__name__}: {err}); the model "
            "was not changed. This is a dmscale bug or a custom handler's: please report it "
            "with the model; excluding the layer named in the error keeps its channels "
            "fixed. export(verify=False) skips this check.") from err
    bad = compare(got, flat_outputs(hard_run()))
    if bad is None:
        return
    modules = dict(model.named_modules())
    align = {name: (handler_for(modules[name]).channel_dim, spec["out"])
             for name, spec in layers.items()
             if spec["out"] is not None and handler_for(modules[name]) is not None}
    where = first_divergence(hard_run, model, lambda: run_example(small, inputs), small,
                             skip=GATES_NAME, align=align)
    layer = "none of equal shape (only the final output)" if where is None else \
        f"{describe(small, where[0])} (differs by {where[1]:.3g}, allowed {where[2]:.3g})"
    fix = "" if where is None else (
        f" Excluding {where[0]!r} (SearchConfig(exclude=[...])) keeps its channels fixed.")
    raise VerificationError(
        f"the export does not compute what the hardened supernet computes (output {bad[0]} "
        f"differs by {bad[1]:.3g}, allowed {bad[2]:.3g}); the model was not changed. First "
        f"layer whose output diverges: {layer}.{fix} This is a dmscale bug or a custom "
        "handler's: please report it with the model. export(verify=False) skips this check.")


def describe_inputs(inputs: Any) -> str:
    """Shapes of the example inputs, for error messages."""
    if isinstance(inputs, torch.Tensor):
        return f"a tensor of shape {tuple(inputs.shape)}"
    if isinstance(inputs, dict):
        return "keywords " + ", ".join(f"{k}={describe_inputs(v)}" for k, v in inputs.items())
    if isinstance(inputs, (tuple, list)):
        return "(" + ", ".join(describe_inputs(v) for v in inputs) + ")"
    return type(inputs).__name__


def fails_on(model: nn.Module, inputs: Any) -> bool:
    """Whether the plain model (a copy: BatchNorm statistics stay as they are) raises on
    ``inputs``; tells a wrong input from a tracing problem."""
    import copy

    args, kwargs = split_inputs(inputs)
    try:
        with torch.no_grad():
            copy.deepcopy(model)(*args, **kwargs)
    except Exception:
        return True
    return False
