"""The sizes of an exported Hugging Face causal LM's decoder layers, as a config states them.

:func:`hf_layer_sizes` reads ``[heads, kv_heads, intermediate]`` per layer (``0`` for a branch
that a sublayer-depth search removed: :class:`~dmscale.export.shrink.ZeroBranch`);
:func:`check_uniform_depth` refuses before a search what no standard config could state.
Part of :mod:`dmscale.export.hf`, which re-exports these names.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from dmscale.core.errors import ConfigError, StructureError, UnsupportedLayerError
from dmscale.core.masks import GATES_NAME
from dmscale.export.shrink import ZeroBranch

__all__ = ["hf_layer_sizes", "find_hf_model", "check_uniform_depth", "scaled_embeddings", "STANDARD_FAMILIES"]

STANDARD_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")


def check_uniform_depth(model: nn.Module, layer_uniform: bool, depth_unit: str) -> None:
    """Refuse, before a search, ``layer_uniform=True`` with ``depth_unit="sublayer"`` on a
    Hugging Face model: a layer-uniform search is for the standard config, which has no
    layer without attention or without FFN, and sublayer depth would make one.

    Raises:
        ConfigError: naming the two options and the two ways out.
    """
    if not (layer_uniform and depth_unit == "sublayer"):
        return
    kinds = [type(model), *(type(m) for m in model.children())]
    if any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
           for k in kinds for c in k.__mro__):
        raise ConfigError(
            f"{type(model).__name__}: layer_uniform=True (--layer-uniform) is for a standard Hugging "
            "Face config, which cannot state a layer without attention or without FFN, and "
            "depth_unit='sublayer' (--depth-unit sublayer) may remove either; search with "
            "depth_unit='block' to keep the standard format, or without layer_uniform to save "
            "the per-layer format (from_pretrained with trust_remote_code=True, GGUF 'deci')")


def scaled_embeddings(model: nn.Module) -> list[str]:
    """The names (in ``model``) of a Hugging Face causal LM's input embedding when it scales its
    output by a factor its standard config derives from the hidden size (Gemma 3: sqrt(hidden),
    also llama.cpp's ``gemma3`` graph); else ``[]``. A layer-uniform search, whose result is
    for the standard config and GGUF, keeps that hidden size (``SearchConfig.exclude``): a
    pruned one would leave the standard format unable to state the model's scale.

    Example:
        >>> import torch
        >>> scaled_embeddings(torch.nn.Linear(2, 2))
        []
    """
    try:
        lm = find_hf_model(model)
    except (UnsupportedLayerError, ImportError):
        return []
    embed = lm.get_input_embeddings()
    if getattr(embed, "scalar_embed_scale", None) is None:
        return []
    return [name for name, m in model.named_modules() if m is embed][:1]


def find_hf_model(model: nn.Module) -> Any:
    """``model`` when it is a ``transformers.PreTrainedModel``, else its only top-level child
    that is one (a wrapper such as the text task's ``CausalLM``)."""
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel):
        return model
    found = [m for m in model.children() if isinstance(m, PreTrainedModel)]
    if len(found) != 1:
        raise UnsupportedLayerError(
            f"save_pretrained needs a Hugging Face PreTrainedModel, got {type(model).__name__} "
            f"with {len(found)} PreTrainedModel children; pass the Hugging Face model itself, or "
            "save with dmscale.save (loads with dmscale.load)")
    return found[0]


def hf_layer_sizes(model: nn.Module) -> dict[str, Any]:
    """The sizes a config must state for ``model`` (an export of a causal LM of those families).

    Returns ``{"hidden_size", "head_dim", "layers": [[heads, kv_heads, intermediate], ...],
    ...`` (``[0, 0, intermediate]`` for a layer whose attention a sublayer-depth search
    removed, ``[heads, kv_heads, 0]`` for one without FFN; export :class:`ZeroBranch`),
    "uniform", "layer_types", "embed_scale"}``: ``layer_types`` the attention type of each
    layer (None when the family has none), ``embed_scale`` the factor of an embedding that
    scales its output (Gemma 3) or None. Raises :class:`UnsupportedLayerError` naming the layer when the model is
    not a Llama-family decoder (q/k/v/o_proj attention, gate/up/down_proj MLP) or when it is
    still prepared for a search.
    """
    lm = find_hf_model(model)
    if hasattr(lm, GATES_NAME) or hasattr(model, GATES_NAME):
        raise StructureError("the model is still prepared for a search (it has dms_gates): save "
                             "searcher.export(), the physically smaller copy")
    config = lm.config
    stack = getattr(getattr(lm, "model", None), "layers", None)
    if not isinstance(stack, nn.ModuleList):
        raise UnsupportedLayerError(
            f"{type(lm).__name__} ({config.model_type}): no decoder stack at model.layers; "
            f"save_pretrained supports {', '.join(STANDARD_FAMILIES)}. Save with dmscale.save "
            "(loads with dmscale.load) instead")
    hidden = lm.get_input_embeddings().embedding_dim
    head_dims, layers, types = set(), [], []
    for i, layer in enumerate(stack):
        attn = getattr(layer, "self_attn", None)
        heads, kv, d = (0, 0, None) if isinstance(attn, ZeroBranch) else _attention_size(i, layer, hidden)
        ffn = 0 if isinstance(getattr(layer, "mlp", None), ZeroBranch) else _ffn_size(i, layer, hidden)
        if d is not None:
            head_dims.add(d)
        layers.append([heads, kv, ffn])
        types.append(getattr(attn, "layer_type", None))
    if len(head_dims) > 1:
        raise StructureError(f"head_dim differs between layers ({sorted(head_dims)}); no config "
                             "format states that")
    return {"hidden_size": hidden, "head_dim": head_dims.pop() if head_dims else None,
            "layers": layers, "uniform": all(s == layers[0] for s in layers),
            "layer_types": types if types and None not in types else None,
            "embed_scale": getattr(lm.get_input_embeddings(), "scalar_embed_scale", None)}


def _not_llama(i: int, layer: nn.Module) -> UnsupportedLayerError:
    return UnsupportedLayerError(
        f"model.layers.{i} ({type(layer).__name__}) is not a Llama-family decoder layer "
        "(self_attn.q/k/v/o_proj, mlp.gate/up/down_proj); save with dmscale.save instead")


def _attention_size(i: int, layer: nn.Module, hidden: int) -> tuple[int, int, int]:
    """``(heads, kv_heads, head_dim)`` of decoder layer ``i``'s q/k/v/o attention."""
    attn = getattr(layer, "self_attn", None)
    parts = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    if not all(isinstance(p, nn.Linear) for p in parts) or not hasattr(attn, "head_dim"):
        raise _not_llama(i, layer)
    q, k, v, o = parts
    d = int(attn.head_dim)
    heads, kv = q.out_features // d, k.out_features // d
    if (q.out_features % d or k.out_features % d or v.out_features != k.out_features or not kv
            or o.in_features != q.out_features or heads % kv or o.out_features != hidden
            or any(p.in_features != hidden for p in (q, k, v))):
        raise StructureError(
            f"model.layers.{i}: inconsistent projection shapes (q {tuple(q.weight.shape)}, k "
            f"{tuple(k.weight.shape)}, v {tuple(v.weight.shape)}, o {tuple(o.weight.shape)}, "
            f"head_dim {d}, hidden {hidden}); this model was not produced by a dmscale export")
    return heads, kv, d


def _ffn_size(i: int, layer: nn.Module, hidden: int) -> int:
    """The intermediate size of decoder layer ``i``'s gate/up/down MLP."""
    mlp = getattr(layer, "mlp", None)
    parts = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(p, nn.Linear) for p in parts):
        raise _not_llama(i, layer)
    gate, up, down = parts
    ffn = gate.out_features
    if (up.out_features != ffn or down.in_features != ffn or down.out_features != hidden
            or any(p.in_features != hidden for p in (gate, up))):
        raise StructureError(
            f"model.layers.{i}: inconsistent MLP shapes (gate {tuple(gate.weight.shape)}, up "
            f"{tuple(up.weight.shape)}, down {tuple(down.weight.shape)}, hidden {hidden}); this "
            "model was not produced by a dmscale export")
    return ffn
