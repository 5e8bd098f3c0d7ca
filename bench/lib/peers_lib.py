"""Baselines for the DMS_p vs Torch-Pruning vs uniform-width table (issue 10, table 4).

Every method starts from the same pretrained supernet and ends as a *source run directory*
(``config.yaml`` of the pretrain run, ``structure.json``, ``model.safetensors``) that the
project's own ``dmscale retrain`` phase finetunes, so all methods get exactly the same
optimizer, epochs, lr schedule, batches and evaluation.

* :func:`tp_prune` -- Torch-Pruning (the real package) ``MagnitudePruner`` with global
  pruning and magnitude (L2) or Taylor importance, stepped iteratively until the model's
  exact MACs (:func:`dmscale.count`) are at or under the target.
* :func:`uniform_structure` -- one width multiplier for the whole network, solved by
  bisection to the largest multiplier whose exact MACs fit the target; keeps the *first*
  channels of every dimension.
* :func:`structure_from_shapes` -- a dmscale structure whose kept counts are the shapes of
  an already pruned module, so its weights load into ``dms.apply_structure(supernet, ...)``.

Example:
    >>> import torch
    >>> from dmscale.tasks.models import ResNetCifar
    >>> m = ResNetCifar(width=4, in_channels=1)
    >>> x = torch.randn(1, 1, 8, 8)
    >>> s, mult = uniform_structure(m, x, 0.5)
    >>> 0.45 < macs(apply(m, s), x) / macs(m, x) <= 0.5
    True
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

import dmscale as dms
from dmscale.export.files import save_weights

__all__ = ["macs", "fast_macs", "apply", "template_structure", "structure_from_shapes", "uniform_structure",
           "tp_prune", "write_source_run"]


_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)  # one output value costs weight[0].numel() MACs (groups included)


def macs(model: nn.Module, example: torch.Tensor) -> int:
    """Exact MACs of ``model`` on ``example`` with the project's one counter (``dms.count``)."""
    return int(dms.count(model, example)["macs"])


def fast_macs(model: nn.Module, example: torch.Tensor) -> int:
    """MACs of the convolutions (1-, 2- and 3-d) and ``nn.Linear`` layers from forward hooks
    (per example).

    Cheap enough to call after every pruning step; the result of a search is always checked
    against :func:`macs` (on conv/linear-only models such as ResNet-20 or the causal-conv
    CharCNN the two agree exactly).
    """
    total = 0

    def hook(m: nn.Module, inp: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        nonlocal total
        per_out = m.weight[0].numel() if isinstance(m, _CONVS) else m.in_features
        total += out.numel() // example.shape[0] * per_out

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, (*_CONVS, nn.Linear))]
    try:
        with torch.no_grad():
            was = model.training
            model.eval()
            model(example)
            model.train(was)
    finally:
        for h in handles:
            h.remove()
    return total


def _checked(model: nn.Module, example: torch.Tensor) -> int:
    """:func:`macs`, after checking that :func:`fast_macs` agreed with it."""
    exact, fast = macs(model, example), fast_macs(model, example)
    if exact != fast:
        raise RuntimeError(f"the hook counter ({fast} MACs) disagrees with dms.count ({exact}) on this model")
    return exact


def apply(model: nn.Module, structure: dict[str, Any]) -> nn.Module:
    """A shrunk copy of ``model`` (``dms.apply_structure`` on a deep copy)."""
    return dms.apply_structure(copy.deepcopy(model), structure)


def template_structure(model: nn.Module, example: torch.Tensor) -> dict[str, Any]:
    """The full-width structure of ``model``: every prunable layer with its handler and shapes."""
    work = copy.deepcopy(model)
    # untrained, all kept (a = 0): "index" says so; only the layout is read
    searcher = dms.prepare(work, example, dms.SearchConfig(resource="macs", target=0.5, importance="index"))
    structure = searcher.structure()  # widths/depth entries; lists only pruned layers
    modules = dict(work.named_modules())
    layers = {}
    for name, layer in searcher.space.layers.items():
        sides = []
        for slots in (layer.in_slots, layer.out_slots):
            if slots is not None and (slots < 0).any() and not (slots < 0).all():
                raise ValueError(f"{name}: mixes fixed and searchable channels on one side")
            sides.append(None if slots is None or (slots < 0).all() else list(range(len(slots))))
        if layer.virtual or sides == [None, None]:
            continue
        shapes = {p: list(t.shape) for p, t in modules[name].named_parameters(recurse=False)}
        layers[name] = {"handler": layer.handler, "in": sides[0], "out": sides[1], "shapes": shapes}
    structure["layers"] = layers
    dms.detach(work)
    return structure


def _resize(structure: dict[str, Any], sizes: Callable[[str, dict[str, Any]], tuple[int | None, int | None]]
            ) -> dict[str, Any]:
    """A copy of ``structure`` keeping the first ``sizes(name, spec)`` inputs / outputs of each
    layer (``None``: that side is not pruned), every block kept."""
    out = copy.deepcopy(structure)
    for name, spec in out["layers"].items():
        k_in, k_out = sizes(name, spec)
        spec["in"] = None if k_in is None else list(range(k_in))
        spec["out"] = None if k_out is None else list(range(k_out))
    out["removed_blocks"] = []
    for d in out.get("depth", []):
        d["kept"] = list(d["blocks"])
    return out


def _full(spec: dict[str, Any], side: str) -> int | None:
    """Full size of ``side`` ("in"/"out") of a template layer, None when it is not prunable."""
    return None if spec[side] is None else len(spec[side])


def structure_from_shapes(template: dict[str, Any], pruned: nn.Module) -> dict[str, Any]:
    """The structure whose layers have the shapes of ``pruned`` (a physically pruned copy of
    the template's model with the same module names), keeping the first channels, so
    ``pruned.state_dict()`` loads into ``apply_structure(supernet, result)``.

    Raises:
        ValueError: a layer of ``pruned`` changed on a side the template does not prune.
    """
    def sizes(name: str, spec: dict[str, Any]) -> tuple[int | None, int | None]:
        m = pruned.get_submodule(name)
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            k_in = k_out = m.num_features
        elif isinstance(m, (nn.Conv2d, nn.Linear)):
            k_out, k_in = m.weight.shape[0], m.weight.shape[1] * getattr(m, "groups", 1)
        else:
            raise ValueError(f"{name}: no shape rule for {type(m).__name__}")
        got = []
        for side, k in (("in", k_in), ("out", k_out)):
            full = _full(spec, side)
            if full is None:
                if k != spec["shapes"]["weight"][1 if side == "in" and len(spec["shapes"]["weight"]) > 1
                                                    else 0]:
                    raise ValueError(f"{name}: the pruned model changed its fixed {side} side to {k}")
                got.append(None)
            else:
                got.append(int(k))
        return got[0], got[1]

    out = _resize(template, sizes)
    kept = {}
    for name, spec in out["layers"].items():
        if spec["out"] is not None:
            kept[name] = len(spec["out"])
    for w in out.get("width", []):
        w["kept"] = kept.get(w["producers"][0], w["size"])
    return out


def uniform_structure(model: nn.Module, example: torch.Tensor, target: float) -> tuple[dict[str, Any], float]:
    """One width multiplier for every dimension (each keeps ``max(1, round(mult * size))``
    first channels, halves rounded up), the largest whose exact MACs are at or under
    ``target`` x the model's (binary search over the multipliers at which a width changes).

    Returns:
        ``(structure, multiplier)``.
    """
    template = template_structure(model, example)
    budget = target * _checked(model, example)
    sizes = sorted({n for spec in template["layers"].values() for n in (_full(spec, "in"), _full(spec, "out"))
                    if n is not None})

    def k(n: int | None, mult: float) -> int | None:
        return None if n is None else max(1, math.floor(mult * n + 0.5 + 1e-9))

    def at(mult: float) -> dict[str, Any]:
        return _resize(template, lambda name, spec: (k(_full(spec, "in"), mult), k(_full(spec, "out"), mult)))

    # the multipliers at which some width grows by one; MACs only change there
    candidates = sorted({0.0} | {(j - 0.5) / n for n in sizes for j in range(2, n + 1)} | {1.0})
    lo, hi = 0, len(candidates)  # candidates[lo] fits (all widths 1); find the last that fits
    if fast_macs(apply(model, at(0.0)), example) > budget:
        raise ValueError(f"target {target}: even width 1 everywhere costs more")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fast_macs(apply(model, at(candidates[mid])), example) <= budget:
            lo = mid
        else:
            hi = mid
    mult = candidates[lo]
    structure = at(mult)
    _checked(apply(model, structure), example)
    for w in structure.get("width", []):
        w["kept"] = k(w["size"], mult)
    return structure, mult


def tp_prune(model: nn.Module, example: torch.Tensor, target: float, importance: str,
             batches: Iterator[tuple[torch.Tensor, torch.Tensor]] | None = None,
             loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
             iterative_steps: int = 200, taylor_batches: int = 1) -> dict[str, Any]:
    """Torch-Pruning global pruning of a copy of ``model`` to ``target`` x its exact MACs.

    ``MagnitudePruner`` with ``global_pruning=True`` and ``pruning_ratio=1.0`` split over
    ``iterative_steps``; :meth:`step` is called until ``dms.count`` MACs are at or under the
    target (Torch-Pruning's own progressive pruning, with the project's counter). Taylor
    importance takes the gradient of ``loss_fn`` on ``taylor_batches`` training batches
    before every step. The classifier (last ``nn.Linear``) is never pruned.

    Returns:
        ``{"model", "macs", "steps", "seconds"}``: the pruned copy and what it took.
    """
    import torch_pruning as tp

    work = copy.deepcopy(model)
    if importance == "magnitude":
        imp = tp.importance.MagnitudeImportance(p=2)
    elif importance == "taylor":
        imp = tp.importance.TaylorImportance()
        if batches is None or loss_fn is None:
            raise ValueError("Taylor importance needs batches and loss_fn")
    else:
        raise ValueError(f"importance must be 'magnitude' or 'taylor', got {importance!r}")
    linears = [m for m in work.modules() if isinstance(m, nn.Linear)]
    t0 = time.perf_counter()
    pruner = tp.pruner.MagnitudePruner(work, example, importance=imp, global_pruning=True,
                                       pruning_ratio=1.0, iterative_steps=iterative_steps,
                                       ignored_layers=linears[-1:])
    budget = target * _checked(model, example)
    steps = 0
    while fast_macs(work, example) > budget:
        if steps >= iterative_steps:
            raise RuntimeError(f"Torch-Pruning did not reach {budget:.0f} MACs in {iterative_steps} steps")
        if importance == "taylor":
            work.train()
            work.zero_grad()
            for _ in range(taylor_batches):
                x, y = next(batches)
                loss_fn(work(x), y).backward()
        pruner.step()
        steps += 1
    work.zero_grad()
    seconds = time.perf_counter() - t0
    return {"model": work, "macs": _checked(work, example), "steps": steps, "seconds": seconds}


def write_source_run(out: Path, pretrain_run: Path, structure: dict[str, Any],
                     weights: nn.Module) -> Path:
    """A run directory ``dmscale retrain --source`` reads: the pretrain run's config, the
    given structure and ``weights``' state (which must fit ``apply_structure(supernet, structure)``)."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(pretrain_run / "config.yaml", out / "config.yaml")
    (out / "structure.json").write_text(json.dumps(structure), encoding="utf-8")
    save_weights(weights, out / "model.safetensors")
    return out
