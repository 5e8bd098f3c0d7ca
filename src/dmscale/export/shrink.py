"""Physically shrink a model: structure files, ``export`` and ``apply_structure``.

A *structure* is a JSON-able dict that says, per handled layer, which input and output
channels stay, and which residual blocks are removed. It is all :func:`apply_structure`
needs: no example inputs, no trace.

A removed block becomes a torch module wherever one computes what the hardened block did, so
that a ``torch.save`` of the export loads without dmscale: its post-add activation (``nn.ReLU``,
..., made out-of-place) or ``nn.Identity``. Only a block whose caller needs more keeps a
:class:`SkipBlock`: one that returned a tuple, was called with extra arguments, or whose
input or output the model modifies in place afterwards (``nn.Identity`` would then alias
the two). Hugging Face decoder layers are dropped from their ``ModuleList`` instead.

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
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from dmscale.core.errors import StructureError
from dmscale.trace.handlers.base import HANDLERS_BY_NAME, handler_for, load_families
from dmscale.core.masks import detach

if TYPE_CHECKING:
    from dmscale.trace.discover import SearchSpace

__all__ = ["apply_structure", "export_model", "structure_of", "FORMAT", "StructureError", "SkipBlock",
           "ZeroBranch"]

FORMAT = "dmscale.structure/1"

_ACTIVATION_MODULES = {
    "relu": nn.ReLU, "relu6": nn.ReLU6, "silu": nn.SiLU, "gelu": nn.GELU, "hardswish": nn.Hardswish,
}


class SkipBlock(nn.Module):
    """What a removed residual block becomes: ``post(x)`` (its post-add activation, if any),
    packed as the block packed its output (``output``: a template from
    :func:`dmscale.trace.discover.output_template`, e.g. ``(y, None)`` for a block that returned a
    tuple).

    Accepts and ignores the extra arguments the block was called with (attention masks,
    position embeddings, caches of Hugging Face decoder layers).
    """

    def __init__(self, post: nn.Module | None = None, output: dict[str, Any] | None = None) -> None:
        super().__init__()
        if post is not None and getattr(post, "inplace", False):
            post.inplace = False  # the input may still be needed (a shortcut, a concat)
        self.post = post
        self.output = output

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        # a new tensor, like the block's own output: callers may modify it in place
        y = x.clone() if self.post is None else self.post(x)
        if self.output is None:
            return y
        items = [y if isinstance(i, dict) else i for i in self.output["items"]]
        return tuple(items) if self.output["type"] == "tuple" else items


# Pickles (``torch.save`` of an export, YOLO checkpoints) name the class by this stable path,
# the one they had before the package was split into layers; dmscale.export re-exports it.
SkipBlock.__module__ = "dmscale.export"

_CACHE_ARGS = ("cache", "past_key_values", "past_key_value")


class ZeroBranch(nn.Module):
    """What a removed residual branch of a kept block becomes (sublayer depth): zeros shaped
    like its first tensor input, packed as the branch packed its output (``output``, as for
    :class:`SkipBlock`), so the block computes ``x + 0``. A branch that takes no tensor
    (its input a keyword only: ``hidden_states=``) reads the first tensor keyword.

    A removed Hugging Face attention (``layer_idx`` is its KV-cache slot) still appends one
    zero per new token to its cache slot, ``(batch, 1, tokens, 1)``: the cache's sequence
    length, which transformers reads from the first layer's slot, stays right whichever
    layers have attention (a slot left empty would read as length 0).

    Example:
        >>> import torch
        >>> ZeroBranch({"type": "tuple", "items": [{"tensor": True}, None]})(torch.ones(2, 3))
        (tensor([[0., 0., 0.],
                [0., 0., 0.]]), None)
    """

    def __init__(self, output: dict[str, Any] | None = None, layer_idx: int | None = None,
                 layer_type: str | None = None) -> None:
        super().__init__()
        self.output = output
        if layer_idx is not None:  # only then: an HF layer renumbering sets every layer_idx it finds
            self.layer_idx = layer_idx
        if layer_type is not None:  # the attention type of the layer (sliding or full), kept for its config
            self.layer_type = layer_type

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        x = next(t for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor))
        cache = next((kwargs[k] for k in _CACHE_ARGS if kwargs.get(k) is not None), None)
        layer_idx = getattr(self, "layer_idx", None)
        if layer_idx is not None and hasattr(cache, "update"):
            step = x.new_zeros(x.shape[0], 1, x.shape[1], 1)  # (batch, 1 head, tokens, 1)
            cache.update(step, step, layer_idx)
        y = torch.zeros_like(x)
        if self.output is None:
            return y
        items = [y if isinstance(i, dict) else i for i in self.output["items"]]
        return tuple(items) if self.output["type"] == "tuple" else items


ZeroBranch.__module__ = "dmscale.export"


def _validate(model: nn.Module, structure: dict[str, Any]) -> None:
    try:
        _check_fits(model, structure)
    except StructureError as err:
        raise StructureError(f"{err}; apply a structure to the model it was made for (the same "
                             "architecture and sizes, before any shrinking)") from None
    except (KeyError, TypeError, AttributeError) as err:
        raise StructureError(f"malformed structure ({type(err).__name__}: {err}): pass the dict of "
                             "searcher.structure() or the JSON of a structure.json file, unedited") from None


def _check_fits(model: nn.Module, structure: dict[str, Any]) -> None:
    if not isinstance(structure, dict) or structure.get("format") != FORMAT:
        got = structure.get("format") if isinstance(structure, dict) else type(structure).__name__
        raise StructureError(f"expected a structure with format {FORMAT!r}, got {got!r}: pass the dict "
                             "of searcher.structure() or the JSON of a structure.json file")
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
    for pname, spec in structure.get("params", {}).items():
        try:
            actual = list(model.get_parameter(pname).shape)
        except AttributeError:
            raise StructureError(f"structure slices parameter {pname!r}, which the model does not have") from None
        if actual != list(spec["shape"]):
            raise StructureError(f"parameter {pname!r}: structure was made for shape {spec['shape']}, the model has {actual}")
    for block in structure["removed_blocks"]:
        missing = [m for m in block["members"] if m not in modules] if block.get("branch") else []
        if missing:
            raise StructureError(f"structure removes branch {block['name']!r}, whose module {missing[0]!r} "
                                 "the model does not have")
        if not block.get("branch") and block["name"] not in modules:
            raise StructureError(f"structure removes block {block['name']!r}, which the model does not have")


def _zero(model: nn.Module, name: str, output: dict[str, Any] | None) -> ZeroBranch:
    """The :class:`ZeroBranch` that replaces module ``name`` of a removed branch."""
    branch = model.get_submodule(name)
    layer_idx, layer_type = getattr(branch, "layer_idx", None), getattr(branch, "layer_type", None)
    return ZeroBranch(output, layer_idx if isinstance(layer_idx, int) else None,
                      layer_type if isinstance(layer_type, str) else None)


def _replacements(model: nn.Module, removed: list[dict[str, Any]]) -> dict[str, nn.Module]:
    """Module name -> what replaces it: each removed block (:func:`_replacement`) and each
    member of a removed branch of a kept block (``"branch": True``, a :class:`ZeroBranch`)."""
    out: dict[str, nn.Module] = {}
    for b in removed:
        if b.get("branch"):
            out.update({m: _zero(model, m, output) for m, output in b["members"].items()})
        else:
            out[b["name"]] = _replacement(model, b)
    return out


def _replacement(model: nn.Module, block: dict[str, Any]) -> nn.Module:
    """A torch module when one does what the removed block did, else a :class:`SkipBlock`.

    Structures written before the keys ``inputs`` and ``mutated`` existed get a SkipBlock
    (which never aliases its input), as they always did.
    """
    output = block.get("output")
    post: nn.Module | None = None
    if block.get("post_module"):
        post = copy.deepcopy(model.get_submodule(block["post_module"]))
    elif block.get("post_function"):
        post = _ACTIVATION_MODULES[block["post_function"]]()
    if output is None and block.get("inputs") == 1:
        if post is not None:  # returns a new tensor once out of place
            if getattr(post, "inplace", False):
                post.inplace = False
            return post
        if block.get("mutated") is False:
            return nn.Identity()
    return SkipBlock(post, output)


def _tied_groups(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """(module, attribute) pairs that share one Parameter object (tied weights)."""
    by_id: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in model.modules():
        for name, p in m.named_parameters(recurse=False):
            by_id.setdefault(id(p), []).append((m, name))
    return [g for g in by_id.values() if len(g) > 1]


def _retie(groups: list[list[tuple[nn.Module, str]]]) -> None:
    for group in groups:
        first = getattr(*group[0])
        for m, name in group[1:]:
            if getattr(m, name).shape != first.shape:
                raise StructureError(f"tied weight {name} was pruned to two different shapes")
            setattr(m, name, first)


def _owner_config(model: nn.Module, name: str) -> Any:
    """The ``config`` of the closest module above ``name`` that has one (with a layer count)."""
    parts = name.split(".")
    for i in range(len(parts) - 1, -1, -1):
        owner = model.get_submodule(".".join(parts[:i])) if i else model
        config = getattr(owner, "config", None)
        if getattr(config, "num_hidden_layers", None) is not None:
            return config
    return None


def _drop_hf_layers(model: nn.Module, removed: list[str]) -> None:
    """Hugging Face decoder stacks: delete removed layers from the ModuleList and renumber
    ``layer_idx`` (KV cache slots) and ``config.num_hidden_layers`` so generate() works."""
    parents = {name.rpartition(".")[0] for name in removed}
    removed_set = set(removed)
    for parent in parents:
        stack = model.get_submodule(parent)
        config = _owner_config(model, parent)  # the model's, or a wrapped model's
        n_layers = getattr(config, "num_hidden_layers", None)
        if not isinstance(stack, nn.ModuleList) or len(stack) != n_layers:
            continue
        keep = [i for i in range(len(stack)) if (f"{parent}.{i}" if parent else str(i)) not in removed_set]
        layers = [stack[i] for i in keep]
        for new_idx, layer in enumerate(layers):
            for sub in layer.modules():
                if hasattr(sub, "layer_idx"):
                    sub.layer_idx = new_idx
        setattr(model.get_submodule(parent.rpartition(".")[0]) if "." in parent else model,
                parent.rpartition(".")[2], nn.ModuleList(layers))
        types = getattr(config, "layer_types", None)
        if isinstance(types, list) and len(types) == n_layers:
            config.layer_types = [types[i] for i in keep]
        config.num_hidden_layers = len(layers)


def apply_structure(model: nn.Module, structure: dict[str, Any]) -> nn.Module:
    """Shrink ``model`` in place to ``structure`` and return it.

    Everything is checked before anything changes: on a mismatch (another architecture, a
    different size) a :class:`StructureError` names the layer and ``model`` is untouched.
    """
    load_families()
    _validate(model, structure)
    tied = _tied_groups(model)
    replacements = _replacements(model, structure["removed_blocks"])
    for name, spec in structure["layers"].items():
        if any(name == b or name.startswith(b + ".") for b in replacements):
            continue  # the whole block (or branch) goes
        m = model.get_submodule(name)
        keep_in = None if spec["in"] is None else torch.tensor(spec["in"], dtype=torch.long)
        keep_out = None if spec["out"] is None else torch.tensor(spec["out"], dtype=torch.long)
        HANDLERS_BY_NAME[spec["handler"]].prune(m, keep_in, keep_out)
    for pname, spec in structure.get("params", {}).items():
        owner, _, attr = pname.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        p = getattr(module, attr)
        keep = torch.tensor(spec["keep"], dtype=torch.long, device=p.device)
        data = p.data.index_select(spec["dim"], keep).clone()
        setattr(module, attr, nn.Parameter(data, requires_grad=p.requires_grad))
    _retie(tied)
    for name, new in replacements.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
    whole = [b["name"] for b in structure["removed_blocks"] if not b.get("branch")]
    if whole:
        _drop_hf_layers(model, whole)
    return model


def export_model(model: nn.Module, structure: dict[str, Any]) -> nn.Module:
    """A physically smaller copy of ``model`` (hooks and gates removed); ``model`` is untouched."""
    small = copy.deepcopy(model)
    detach(small)
    return apply_structure(small, structure)


def structure_of(model: nn.Module, space: SearchSpace, keep: np.ndarray, keep_depth: np.ndarray,
                 resource: dict[str, Any]) -> dict[str, Any]:
    """The structure (format :data:`FORMAT`) of ``model`` with the width slots ``keep``
    (bool, n_slots + 1) and the blocks ``keep_depth`` (bool, n_blocks) of its search
    ``space`` kept; ``resource`` is recorded as it is (the searcher's costs)."""
    modules = dict(model.named_modules())
    layers = {}
    for name, layer in space.layers.items():
        if layer.virtual:
            continue
        spec_in = _kept(layer.in_slots, keep)
        spec_out = _kept(layer.out_slots, keep)
        if spec_in is None and spec_out is None:
            continue
        m = modules[name]
        shapes = {p: list(t.shape) for p, t in m.named_parameters(recurse=False)}
        layers[name] = {"handler": layer.handler, "in": spec_in, "out": spec_out, "shapes": shapes}
    removed, depth, k = [], [], 0
    units = [b for d in space.depth for b in d.blocks]
    kept_layers = {b.layer.name for b, kept in zip(units, keep_depth)  # split blocks with a branch left
                   if b.layer is not None and (kept or b.layer.pinned)}  # (or a pinned one)
    for d in space.depth:
        kept_blocks = []
        for b in d.blocks:
            if keep_depth[k]:
                kept_blocks.append(b.name)
            elif b.layer is not None and b.layer.name in kept_layers:  # a branch of a kept block
                removed.append({"name": b.name, "branch": True, "members": b.members})
            elif b.layer is None or all(r["name"] != b.layer.name for r in removed):
                removed.append(_removed_block(b.layer or b))
            k += 1
        depth.append({"name": d.name, "blocks": [b.name for b in d.blocks], "kept": kept_blocks})
    width, off = [], 0
    for d in space.width:
        kept_slots = np.nonzero(keep[off:off + d.size])[0].tolist()
        width.append({"name": d.name, "size": d.size, "kept": len(kept_slots), "producers": d.producers})
        off += d.size
    params = {}
    for pname, (dim, slots) in space.params.items():
        kept = _kept(slots, keep)
        if kept is not None:
            params[pname] = {"dim": dim, "keep": kept,
                             "shape": list(model.get_parameter(pname).shape)}
    return {"format": FORMAT, "resource": resource, "width": width, "depth": depth,
            "layers": layers, "params": params, "removed_blocks": removed}


def _removed_block(b: Any) -> dict[str, Any]:
    """A removed whole block's entry of ``removed_blocks`` (``b``: a :class:`Block`)."""
    return {"name": b.name, "post_module": b.post_module, "post_function": b.post_function,
            "output": b.output, "inputs": b.n_inputs, "mutated": b.mutated}


def _kept(slots: np.ndarray | None, keep: np.ndarray) -> list[int] | None:
    if slots is None or (slots < 0).all():
        return None
    mask = (slots < 0) | keep[np.where(slots < 0, 0, slots)]
    return None if mask.all() else np.nonzero(mask)[0].tolist()
