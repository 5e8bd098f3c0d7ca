"""The key/value cache of a model: bytes of K and V one token adds, summed over its
attention layers (the ``kv_cache`` resource).

A decoder serving a sequence keeps, for every attention layer, each past token's keys and
values: ``2 x kv_heads x head_dim x bytes per element`` per token per sequence. Summed over
the layers, that is what bounds a served model's context length and batch (memory =
kv_cache x tokens x sequences). Grouped-query attention counts its key/value heads, not its
query heads.

Which modules are attention layers is decided by dmscale's own attention handlers
(:mod:`dmscale.trace.handlers.attention`: Hugging Face Llama-family, GPT-2, BERT, timm
``Attention``), the same ones that find the heads of a search, never by class name: a module
whose handler has a ``kv_shape`` is an attention layer, and ``kv_shape`` reads its key/value
heads and head dim from the module as it is (an exported model gives its kept counts). The
bytes per element are those of the layer's parameters' dtype (the cache is kept in the
model's dtype); :func:`kv_cache_bytes` takes another one. For an encoder (BERT, ViT) nothing
is cached in practice; the count is then the K and V activations one token adds.

Example:
    >>> import torch
    >>> import dmscale as dms
    >>> _ = dms.ensure_torchvision()
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> llama = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=32,
    ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16))
    >>> [(a.name, a.kv_heads, a.head_dim, a.bytes_per_element) for a in kv_layers(llama)][:1]
    [('model.layers.0.self_attn', 2, 16, 4)]
    >>> kv_cache_bytes(llama)  # 2 layers x 2 (K and V) x 2 heads x 16 dims x 4 bytes
    512
    >>> kv_cache_bytes(llama, dtype=torch.bfloat16)
    256
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dmscale.core.errors import ConfigError
from dmscale.core.masks import GATES_NAME
from dmscale.trace.handlers.base import handler_for, load_families

__all__ = ["KVLayer", "kv_layers", "kv_cache_bytes", "require_kv_layers"]


@dataclass(frozen=True)
class KVLayer:
    """One attention layer's key/value cache per token: ``bytes`` = 2 x kv_heads x head_dim x
    bytes_per_element."""

    name: str
    kv_heads: int
    head_dim: int
    bytes_per_element: int

    @property
    def bytes(self) -> int:
        return 2 * self.kv_heads * self.head_dim * self.bytes_per_element


def _element_size(module: nn.Module, dtype: torch.dtype | None) -> int:
    if dtype is not None:
        return torch.empty((), dtype=dtype).element_size()
    for p in module.parameters():
        if p.is_floating_point():
            return p.element_size()
    return torch.empty((), dtype=torch.get_default_dtype()).element_size()


def kv_layers(model: nn.Module, dtype: torch.dtype | None = None) -> list[KVLayer]:
    """The attention layers of ``model`` (modules whose handler has a ``kv_shape``), in module
    order, with their key/value heads, head dim and bytes per element (``dtype``, else the
    layer's parameters')."""
    load_families()  # the transformers / timm handlers, when those libraries are imported
    out = []
    for name, module in model.named_modules():
        if name == GATES_NAME or name.startswith(GATES_NAME + "."):
            continue
        handler = handler_for(module)
        if handler is None or handler.kv_shape is None:
            continue
        kv_heads, head_dim = handler.kv_shape(module)
        out.append(KVLayer(name, kv_heads, head_dim, _element_size(module, dtype)))
    return out


def kv_cache_bytes(model: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Bytes of K and V ``model`` caches per token per sequence (0 without attention)."""
    return sum(layer.bytes for layer in kv_layers(model, dtype))


def require_kv_layers(model: nn.Module) -> list[KVLayer]:
    """:func:`kv_layers`, or a :class:`ConfigError` for a model without any: a ``kv_cache``
    budget on it would be a budget on nothing."""
    layers = kv_layers(model)
    if not layers:
        raise ConfigError(
            f"resource 'kv_cache' needs attention layers, and {type(model).__name__} has none that "
            "dmscale knows (Hugging Face Llama-family, GPT-2, BERT or timm attention); budget "
            "'macs', 'params' or 'latency' instead")
    return layers
