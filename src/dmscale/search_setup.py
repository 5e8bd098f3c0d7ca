"""Setting a search up on a model: the search space it discovers, the gates it attaches.

Part of :class:`dmscale.search.Searcher` (its ``__init__``): :func:`discover_space` traces
the model and says, with a named error, why when it cannot (the model does not run on the
example inputs, it does not run under the trace, or nothing in it is searchable);
:func:`attach_gates` turns the space and the :class:`~dmscale.search_config.SearchConfig`
into one differentiable top-k per dimension (coarse steps, minimum widths, temperatures,
layer-uniform ties) and attaches them with their mask hooks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .discover import SearchSpace, discover
from .errors import InputError, NothingToSearchError, TraceError, UnsupportedLayerError
from .handlers import handler_for
from .masks import Gates
from .norms import norm_formula
from .search_config import SearchConfig
from .selfcheck import describe_inputs, fails_on
from .uniform import tie_ratios, uniform_groups

__all__ = ["discover_space", "attach_gates"]


def discover_space(model: nn.Module, example_inputs: Any, config: SearchConfig) -> SearchSpace:
    """The search space of ``model`` under ``config`` (exclusions, width and depth switches).

    Raises:
        InputError: the model does not run on the example inputs.
        TraceError: it runs, but not under dmscale's trace.
        NothingToSearchError: every width is fixed and no block can be removed.
    """
    try:
        space = discover(model, example_inputs, config.exclude,
                         depth=config.search_depth if config.search_depth else False)
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


def attach_gates(model: nn.Module, space: SearchSpace, config: SearchConfig) -> tuple[Gates, list[Any]]:
    """Attach one top-k per width and depth dimension of ``space`` to ``model`` (on the
    model's device); returns the gates and the layer-uniform groups (empty without
    ``config.layer_uniform``)."""
    cfg = config
    dims = []
    for d in space.width:
        over = cfg.dim_overrides.get(d.name, {})
        channels = d.kind != "heads"  # coarse steps and min width are for channels
        step = int(over.get("step", cfg.width_step if channels else 1))
        # at least one unit for each layer that writes part of this width
        min_keep = min(d.size, max(int(over.get("min", cfg.min_width if channels else 1)),
                                   len(d.required) * step))
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
            norms[name] = (layer.in_slots, formula.kind, formula.eps)
    branches = {m: (j, i) for j, d in enumerate(space.depth) for i, b in enumerate(d.blocks)
                for m in b.branch_modules}
    gates = Gates.attach(model, dims, depth, consumers, branches,
                         importance=cfg.importance, normalize=cfg.normalize, norms=norms,
                         outputs=outputs, derived=space.derived, gate_factory=cfg.gate_factory,
                         fold_masks=cfg.fold_masks)
    tie_ratios(list(gates.width), groups)
    for d, topk in zip(space.width, gates.width):
        topk.required_groups = [torch.unique(torch.tensor(g) // topk.step) for g in d.required]
    # the gates live where the model lives (prepare may come after model.to(device))
    param = next(iter(model.parameters()), None)
    if param is not None:
        gates.to(param.device)
    return gates, groups


def _without_width(space: SearchSpace) -> SearchSpace:
    layers = {n: type(l)(l.name, l.handler, None, None, l.macs, l.macs_sides, l.virtual, l.masked_norm,
                         l.mask_output) for n, l in space.layers.items()}
    return SearchSpace([], space.depth, layers, space.pinned_reasons, space.total_macs, space.module_macs,
                       example_output=space.example_output)


def _reasons(space: SearchSpace) -> str:
    items = list(space.pinned_reasons.items())[:3]
    return "; ".join(f"{k}: {v}" for k, v in items) or "no layer with searchable channels"
