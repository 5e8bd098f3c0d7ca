"""Find a model's structural dimensions by running it once on example inputs.

The :class:`~dmscale.trace.tracer.Tracer` runs the model under a ``TorchFunctionMode`` and forward hooks. Handled
layers (conv, linear, norms, ... see :mod:`dmscale.trace.handlers.base`) are opaque operations; every
other torch function is mapped by :mod:`dmscale.trace.rules`. Layers without a handler are traced
through: a parameter that meets channels element-wise (a layer scale) is sliced with them,
unless some other function also reads it; whatever no rule understands fixes the channels it
touches. The result, a :class:`SearchSpace`, holds:

* width dimensions: sets of channels that must be kept or removed together (a conv's output
  channels tied through residual adds, SE gates, depthwise convs and norms);
* depth dimensions: per stage (parent module), the residual blocks ``y = act(x + f(x))``
  whose branch f can be removed;
* per handled layer, the dimension slot of each of its input and output channels.

This module runs the trace and refuses what it cannot trace; :mod:`dmscale.trace.blocks` finds
the residual blocks and stages, :mod:`dmscale.trace.slots` builds the search space from the
trace and :mod:`dmscale.trace.space` holds its classes (re-exported here).

Example:
    >>> import torch
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 1))
    >>> space = discover(net, (torch.randn(1, 3, 8, 8),))
    >>> [(d.name, d.size) for d in space.width]
    [('0', 8)]
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from dmscale.core.errors import ConfigError, UnsupportedLayerError
from dmscale.core.modes import eval_mode
from dmscale.trace.blocks import find_blocks, pin_units, split_branches
from dmscale.trace.flops import ForwardFlopCounter
from dmscale.trace.handlers.base import handler_for, load_families
from dmscale.trace.slots import build_space
from dmscale.trace.space import Block, DepthDim, SearchSpace, WidthDim
from dmscale.trace.tracer import Tracer
from dmscale.trace.values import output_template

__all__ = ["discover", "SearchSpace", "WidthDim", "DepthDim", "Block", "Tracer", "UnsupportedLayerError",
           "output_template"]


# ---------------------------------------------------------------------- unsupported layers


def refuse_script_modules(model: nn.Module) -> None:
    """Raise :class:`UnsupportedLayerError` naming the first TorchScript submodule: its
    forward runs outside Python, so neither hooks nor the trace can see it."""
    for name, m in model.named_modules():
        if isinstance(m, torch.jit.ScriptModule):
            where = f"layer {name!r}" if name else "the model"
            raise UnsupportedLayerError(
                f"{where} is a TorchScript module ({type(m).__name__}), which dmscale cannot trace "
                "(no hooks, no Python forward): pass the nn.Module from before torch.jit.script / "
                "torch.jit.trace, and script the exported model afterwards")


def check_traced_through(tr: Tracer) -> None:
    """Raise for a layer without a handler whose own parameters no traced function read.

    Layers without a handler are traced through: their functions go through the rule table,
    parameters that meet channels element-wise are sliced with them and anything else fixes
    the channels it touches. That is safe only if the trace saw the parameters being used;
    a forward that runs outside PyTorch's function dispatch (TorchScript, a kernel that reads
    the weights itself) hides how they meet the channels.
    """
    called = {c.name for c in tr.calls}
    for name, m in tr.model.named_modules():
        if name not in called or tr._excluded(name) or handler_for(m) is not None:
            continue
        own = [(n, p) for n, p in m.named_parameters(recurse=False)]
        if not own or any(tr.params.get(id(p)) in tr.param_seen for _, p in own):
            continue
        raise UnsupportedLayerError(
            f"layer {name!r} ({type(m).__name__}) has weights {[n for n, _ in own]} that no "
            "traced PyTorch function read (its forward runs outside torch's function "
            "dispatch, e.g. TorchScript or a custom kernel), so dmscale cannot tell how they "
            f"meet the channels. Exclude it (SearchConfig(exclude=[{name!r}]) or --exclude "
            f"{name}) to keep its widths fixed, or register a handler with "
            "dmscale.register_handler."
        )


# ---------------------------------------------------------------------- search space


def discover(model: nn.Module, example_inputs: Any, exclude: Iterable[str] = (),
             depth: bool | Iterable[str] = True, depth_unit: str = "block",
             keep_depth: Iterable[str] = ()) -> SearchSpace:
    """Trace ``model`` once (eval mode, no grad) and build its :class:`SearchSpace`.

    Args:
        exclude: module names (or prefixes) whose widths stay fixed and that are not traced.
        depth: True to find residual stages automatically, False for none, or an explicit
            list of stage (parent module) names to search.
        depth_unit: "block" (a block is one depth unit) or "sublayer" (each residual branch
            of a block that chains several is one, :func:`~dmscale.trace.blocks.split_branches`).
        keep_depth: module names whose depth units (the block, or with sublayer depth the
            branch, that holds each) are no units: never removed (:func:`~dmscale.trace.blocks.pin_units`).

    Raises:
        ConfigError: a ``depth`` stage or a ``keep_depth`` name that the model does not have.
    """
    load_families()
    exclude, keep_depth = tuple(exclude), list(keep_depth)
    unknown = [k for k in keep_depth if k not in dict(model.named_modules())]
    if unknown:
        raise ConfigError(f"keep_depth names {unknown}, not modules of {type(model).__name__}: name the "
                          "modules whose depth units must stay (e.g. 'model.layers.0.self_attn')")
    refuse_script_modules(model)
    tr = Tracer(model, exclude)
    with eval_mode(model), torch.no_grad():
        out, counter = tr.run(example_inputs)
    check_traced_through(tr)
    module_macs = _module_macs(model, counter)
    blocks = find_blocks(tr) if depth else []
    if depth is not True and depth:
        wanted = set(depth)
        blocks = [(p, b) for p, b in blocks if p in wanted]
        missing = wanted - {p for p, _ in blocks}
        if missing:
            raise ConfigError(f"depth stages {sorted(missing)} have no residual block with an identity "
                              "shortcut: name stages whose children are residual blocks, or pass depth=True")
    blocks = [(p, b) for p, b in blocks if not tr._excluded(b.name)]
    space = build_space(tr, blocks, module_macs, counter.get_total_flops() // 2)
    if depth_unit == "sublayer":
        space.depth = split_branches(tr, space.depth)
    elif depth_unit != "block":
        raise ConfigError(f"depth_unit must be 'block' or 'sublayer', got {depth_unit!r}")
    if keep_depth:
        space.depth = pin_units(space.depth, keep_depth)
    space.example_output = out
    return space


def _module_macs(model: nn.Module, counter: ForwardFlopCounter) -> dict[str, int]:
    root = type(model).__name__
    out: dict[str, int] = {}
    for key, ops in counter.get_flop_counts().items():
        if key == root:
            out[""] = sum(ops.values()) // 2
        elif key.startswith(root + "."):
            out[key[len(root) + 1:]] = sum(ops.values()) // 2
    return out
