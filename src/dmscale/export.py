"""Physically shrink a model: structure files, ``export`` and ``apply_structure``.

A *structure* is a JSON-able dict that says, per handled layer, which input and output
channels stay, and which residual blocks are removed (replaced by their post-add activation,
or by ``nn.Identity``). It is all :func:`apply_structure` needs: no example inputs, no trace.

Example:
    >>> import torch
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> structure = {"format": FORMAT, "layers": {
    ...     "0": {"handler": "linear", "in": None, "out": [0, 3, 5], "shapes": {"weight": [8, 4], "bias": [8]}},
    ...     "2": {"handler": "linear", "in": [0, 3, 5], "out": None, "shapes": {"weight": [2, 8], "bias": [2]}}},
    ...     "removed_blocks": []}
    >>> small = apply_structure(net, structure)
    >>> small[0].weight.shape, small[2].weight.shape
    (torch.Size([3, 4]), torch.Size([2, 3]))
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from .handlers import HANDLERS_BY_NAME, handler_for
from .masks import detach

__all__ = ["apply_structure", "export_model", "FORMAT", "StructureError"]

FORMAT = "dmscale.structure/1"

_ACTIVATION_MODULES = {
    "relu": nn.ReLU, "relu6": nn.ReLU6, "silu": nn.SiLU, "gelu": nn.GELU, "hardswish": nn.Hardswish,
}


class StructureError(ValueError):
    """A structure does not fit the model it is applied to."""


def _validate(model: nn.Module, structure: dict[str, Any]) -> None:
    if not isinstance(structure, dict) or structure.get("format") != FORMAT:
        got = structure.get("format") if isinstance(structure, dict) else type(structure).__name__
        raise StructureError(f"expected a structure with format {FORMAT!r}, got {got!r}")
    modules = dict(model.named_modules())
    for name, spec in structure["layers"].items():
        if name not in modules:
            raise StructureError(f"structure names layer {name!r}, which the model does not have")
        m = modules[name]
        handler = handler_for(m)
        if handler is None or handler.name != spec["handler"]:
            raise StructureError(
                f"layer {name!r}: structure expects a {spec['handler']!r} layer, the model "
                f"has {type(m).__name__}"
            )
        for pname, shape in spec.get("shapes", {}).items():
            p = getattr(m, pname, None)
            actual = list(p.shape) if isinstance(p, torch.Tensor) else None
            if actual != list(shape):
                raise StructureError(
                    f"layer {name!r}.{pname}: structure was made for shape {list(shape)}, "
                    f"the model has {actual}"
                )
    for block in structure["removed_blocks"]:
        if block["name"] not in modules:
            raise StructureError(f"structure removes block {block['name']!r}, which the model does not have")


def _replacement(model: nn.Module, block: dict[str, Any]) -> nn.Module:
    if block.get("post_module"):
        return copy.deepcopy(model.get_submodule(block["post_module"]))
    if block.get("post_function"):
        return _ACTIVATION_MODULES[block["post_function"]]()
    return nn.Identity()


def apply_structure(model: nn.Module, structure: dict[str, Any]) -> nn.Module:
    """Shrink ``model`` in place to ``structure`` and return it.

    Everything is checked before anything changes: on a mismatch (another architecture, a
    different size) a :class:`StructureError` names the layer and ``model`` is untouched.
    """
    _validate(model, structure)
    replacements = {b["name"]: _replacement(model, b) for b in structure["removed_blocks"]}
    for name, spec in structure["layers"].items():
        if any(name.startswith(b + ".") for b in replacements):
            continue  # the whole block goes
        m = model.get_submodule(name)
        keep_in = None if spec["in"] is None else torch.tensor(spec["in"], dtype=torch.long)
        keep_out = None if spec["out"] is None else torch.tensor(spec["out"], dtype=torch.long)
        HANDLERS_BY_NAME[spec["handler"]].prune(m, keep_in, keep_out)
    for name, new in replacements.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
    return model


def export_model(model: nn.Module, structure: dict[str, Any]) -> nn.Module:
    """A physically smaller copy of ``model`` (hooks and gates removed); ``model`` is untouched."""
    small = copy.deepcopy(model)
    detach(small)
    return apply_structure(small, structure)
