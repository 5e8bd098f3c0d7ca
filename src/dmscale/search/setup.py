"""Setting a search up on a model: the search space it discovers, the gates it attaches.

Part of :class:`dmscale.search.searcher.Searcher` (its ``__init__``): :func:`discover_space` traces
the model and says, with a named error, why when it cannot (the model does not run on the
example inputs, it does not run under the trace, or nothing in it is searchable);
:func:`attach_gates` turns the space and the :class:`~dmscale.search.config.SearchConfig`
into one differentiable top-k per dimension (coarse steps, hardware-aligned widths
(:func:`dim_unit`), minimum widths, temperatures, layer-uniform ties) and attaches them with their mask hooks.
"""

from __future__ import annotations

import fnmatch
import math
from typing import Any

import torch
from torch import nn

from dmscale.trace.discover import SearchSpace, WidthDim, discover
from dmscale.core.errors import ConfigError, InputError, NothingToSearchError, TraceError, UnsupportedLayerError
from dmscale.trace.handlers.base import handler_for
from dmscale.core.masks import Gates
from dmscale.trace.handlers.norms import norm_formula
from dmscale.trace.naming import RESIDUAL, residual_stream
from dmscale.search.config import SearchConfig, resolve_align
from dmscale.export.selfcheck import describe_inputs, fails_on
from dmscale.core.ratios import stack_ratios
from dmscale.search.uniform import tie_ratios, uniform_groups

__all__ = ["discover_space", "attach_gates", "dim_unit", "held_whole", "unaligned_dims", "model_device"]


def discover_space(model: nn.Module, example_inputs: Any, config: SearchConfig) -> SearchSpace:
    """The search space of ``model`` under ``config`` (exclusions, width and depth switches).

    Raises:
        InputError: the model does not run on the example inputs.
        TraceError: it runs, but not under dmscale's trace.
        NothingToSearchError: every width is fixed and no block can be removed.
    """
    try:
        space = discover(model, example_inputs, config.exclude,
                         depth=config.search_depth if config.search_depth else False,
                         depth_unit=config.depth_unit, keep_depth=config.keep_depth)
    except Exception as err:
        if not isinstance(err, ValueError) and fails_on(model, example_inputs):
            raise InputError(
                f"{type(model).__name__} does not run on the example inputs "
                f"({describe_inputs(example_inputs)}): {type(err).__name__}: "
                f"{str(err).splitlines()[0] if str(err) else ''}; pass inputs the model's forward "
                "accepts (a tensor, a tuple of positional inputs or a dict of keyword inputs)"
            ) from err
        if not isinstance(err, ValueError):
            raise TraceError(
                f"{type(model).__name__} runs on the example inputs but not under dmscale's trace "
                f"(forward hooks and a TorchFunctionMode): {type(err).__name__}: "
                f"{str(err).splitlines()[0] if str(err) else ''}; pass the plain nn.Module (not "
                "torch.compile'd or scripted), or exclude the module that fails "
                "(SearchConfig(exclude=[...]))") from err
        raise
    if not config.search_width:
        space = _without_width(space)
    if not space.width and not space.depth:
        raise NothingToSearchError(
            f"found nothing to search in {type(model).__name__}: every width is fixed "
            f"({_reasons(space)}) and no residual block has an identity shortcut; "
            + ("a function with no channel rule fixes the widths it touches: keep it out of "
               "the hidden layers, or teach dmscale what it computes (dms.register_handler)"
               if "no channel rule" in _reasons(space) else
               "search a model with hidden layers, or exclude fewer modules")
        )
    return space


def attach_gates(model: nn.Module, space: SearchSpace, config: SearchConfig,
                 align: int | None = None) -> tuple[Gates, list[Any]]:
    """Attach one top-k per width and depth dimension of ``space`` to ``model`` (on the
    model's device); returns the gates and the layer-uniform groups (empty without
    ``config.layer_uniform``). ``align``: the resolved width multiple (None: resolve
    ``config.align`` on the model's device, :func:`~dmscale.search.config.resolve_align`)."""
    cfg = config
    align = resolve_align(cfg.align, model_device(model)) if align is None else align
    dims = []
    held = held_whole(space, cfg.keep_width)
    for d in space.width:
        step, min_keep = dim_unit(d, cfg, align)
        min_keep = d.size if d.name in held else min_keep
        temperature = cfg.depth_temperature if d.kind == "heads" else cfg.width_temperature
        dims.append((d.size, step, min_keep, temperature))
    groups = uniform_groups([d.name for d in space.width],
                            [(d.kind,) + s for d, s in zip(space.width, dims)]) \
        if cfg.layer_uniform else []
    depth = [(len(d.blocks), 1, d.min_keep, cfg.depth_temperature) for d in space.depth]
    modules = dict(model.named_modules())
    consumers, norms, outputs = {}, {}, {}
    for name, layer in space.layers.items():
        if layer.mask_output and layer.out_slots is not None and (layer.out_slots >= 0).any():
            outputs[name] = (handler_for(modules[name]).channel_dim, layer.out_slots)
        if layer.virtual or layer.in_slots is None or (layer.in_slots < 0).all():
            continue
        if "in" in layer.macs_sides:
            consumers[name] = (handler_for(modules[name]).channel_dim, layer.in_slots)
        elif layer.masked_norm:
            formula = norm_formula(modules[name])
            if formula is None:
                raise UnsupportedLayerError(
                    f"layer {name!r} ({type(modules[name]).__name__}) asks for a masked norm "
                    "but does not compute a LayerNorm or RMSNorm over its last dim; exclude "
                    f"it (SearchConfig(exclude=[{name!r}])) or give its handler masked_norm=False")
            norms[name] = (layer.in_slots, formula.kind, formula.eps, formula.offset)
    branches = {m: (j, i) for j, d in enumerate(space.depth) for i, b in enumerate(d.blocks)
                for m in b.branch_modules}
    depth_folds = {m: layer for d in space.depth for b in d.blocks for m, layer in b.fold_layers.items()}
    gates = Gates.attach(model, dims, depth, consumers, branches,
                         importance=cfg.importance, normalize=cfg.normalize, norms=norms,
                         outputs=outputs, derived=space.derived, gate_factory=cfg.gate_factory,
                         fold_masks=cfg.fold_masks, depth_folds=depth_folds)
    gates.fuse_norms = cfg.fuse_norms
    tie_ratios(list(gates.width), groups)
    if groups:  # one entry per distinct ratio
        stack_ratios(gates, list(gates.width))
    for d, topk in zip(space.width, gates.width):
        topk.required_groups = [torch.unique(torch.tensor(g) // topk.step) for g in d.required]
    # the gates live where the model lives (prepare may come after model.to(device)); a
    # model on the meta device (shapes only) keeps its few MB of gates on the CPU, so that
    # the search's costs can still be computed
    device = model_device(model)
    gates.to(torch.device("cpu") if device.type == "meta" else device)
    return gates, groups


def held_whole(space: SearchSpace, keep_width: list[str]) -> set[str]:
    """The width dims of ``space`` that ``keep_width`` holds at their full size: a dim one of
    whose producers matches a pattern (a module name or glob), or, for ``"residual"``, every
    dim that two or more blocks write (:func:`~dmscale.trace.naming.residual_stream`).

    Raises:
        ConfigError: a pattern that holds no width dim (a typo, or ``"residual"`` on a model
            without residual streams).
    """
    held: set[str] = set()
    for pattern in keep_width:
        hits = {d.name for d in space.width
                if (residual_stream(d.producers) is not None if pattern == RESIDUAL
                    else any(fnmatch.fnmatchcase(p, pattern) for p in d.producers))}
        if not hits:
            what = ("no width dim is written by two or more blocks" if pattern == RESIDUAL else
                    f"no searched width dim has a producer matching {pattern!r}")
            raise ConfigError(f"keep_width {pattern!r}: {what}; the searched dims are "
                              f"{[d.name for d in space.width][:8]} (`dmscale inspect` lists them with "
                              "their producers)")
        held |= hits
    return held


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (CPU for a model without parameters)."""
    param = next(iter(model.parameters()), None)
    return param.device if param is not None else torch.device("cpu")


def aligns(d: WidthDim, align: int) -> bool:
    """Whether ``align`` applies to width dim ``d``: a channel dim (not a head count) whose
    size is a multiple of ``align`` (1: alignment off, nothing to do)."""
    return align > 1 and d.kind != "heads" and d.size % align == 0


def unaligned_dims(space: SearchSpace, align: int) -> list[str]:
    """The channel dims of ``space`` that ``align`` cannot keep aligned: their size is not a
    multiple of it (so neither is their full width); they are searched as without ``align``.

    Example:
        >>> from dmscale.trace.discover import WidthDim
        >>> dims = [WidthDim("fc1", 64, ["fc1"]), WidthDim("fc2", 10, ["fc2"]),
        ...         WidthDim("attn.heads", 6, ["attn"], kind="heads")]
        >>> unaligned_dims(SearchSpace(dims, [], {}, {}, 0, {}), 8)
        ['fc2']
    """
    if align <= 1:
        return []
    return [d.name for d in space.width if d.kind != "heads" and not aligns(d, align)]


def dim_unit(d: WidthDim, config: SearchConfig, align: int) -> tuple[int, int]:
    """(elements per unit, smallest kept width) of width dim ``d`` under ``config`` with the
    resolved width multiple ``align`` (:func:`~dmscale.search.config.resolve_align`).

    Channels: ``dim_overrides`` step, else ``width_step``; with ``align`` (a dim whose size is
    a multiple of it) the default step becomes ``lcm(width_step, align)`` and an override step
    must be a multiple of ``align``, so every unit, and every kept width, is a multiple of it.
    Heads: one at a time unless overridden. The smallest width is the ``min`` override (else
    ``min_width``, 1 for heads), at least one unit per layer that writes part of the width,
    at most the size; the gate rounds it up to whole units.

    Example:
        >>> from dmscale.trace.discover import WidthDim
        >>> ffn = WidthDim("mlp.fc1", 1536, ["mlp.fc1"])
        >>> dim_unit(ffn, SearchConfig(), 8), dim_unit(ffn, SearchConfig(width_step=12), 8)
        ((8, 1), (24, 1))
        >>> dim_unit(WidthDim("fc2", 10, ["fc2"]), SearchConfig(width_step=4), 8)  # unaligned
        (4, 1)

    Raises:
        ConfigError: a ``dim_overrides`` step of an aligned dim is not a multiple of ``align``.
    """
    over = config.dim_overrides.get(d.name, {})
    channels = d.kind != "heads"  # coarse steps and min width are for channels
    step = int(over.get("step", config.width_step if channels else 1))
    if aligns(d, align):
        if "step" in over and step % align:
            raise ConfigError(
                f"dim_overrides[{d.name!r}] step {step} is not a multiple of align {align}: every "
                f"searched width is kept at a multiple of {align}, so its unit must be one too; "
                f"pass a step of {math.lcm(step, align)} (or another multiple of {align}), or "
                "align=1")
        step = step if "step" in over else math.lcm(step, align)
    # at least one unit for each layer that writes part of this width
    min_keep = min(d.size, max(int(over.get("min", config.min_width if channels else 1)),
                               len(d.required) * step))
    return step, min_keep


def _without_width(space: SearchSpace) -> SearchSpace:
    layers = {n: type(l)(l.name, l.handler, None, None, l.macs, l.macs_sides, l.virtual, l.masked_norm,
                         l.mask_output) for n, l in space.layers.items()}
    return SearchSpace([], space.depth, layers, space.pinned_reasons, space.total_macs, space.module_macs,
                       example_output=space.example_output)


def _reasons(space: SearchSpace) -> str:
    items = list(space.pinned_reasons.items())[:3]
    return "; ".join(f"{k}: {v}" for k, v in items) or "no layer with searchable channels"
