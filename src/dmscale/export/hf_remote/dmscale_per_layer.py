"""What every ``modeling_dmscale_<family>.py`` shares: a config with one size per layer, and a
model that rebuilds each decoder layer's projections at that size.

Copied next to the weights with the family's file (which imports it as
``from .dmscale_per_layer import ...``; transformers copies relative imports of remote code
with the file), so it imports only ``torch`` and ``transformers``.

The config of a per-layer checkpoint is the family's own config plus ``layer_sizes``: one
``[num_attention_heads, num_key_value_heads, intermediate_size]`` per decoder layer, with
``head_dim`` explicit and the same in every layer; ``[0, 0, intermediate]`` is a layer
without attention (it computes ``x + mlp(norm(x))``), ``[heads, kv_heads, 0]`` one without
FFN (``x + attn(norm(x))``); ``zero_modules``, when present, names per layer the modules of
its removed branches (``["input_layernorm", "self_attn"]``), which compute zeros and have
no weights; ``num_attention_heads``,
``num_key_value_heads`` and ``intermediate_size`` hold the largest per-layer value (an upper
bound, used only while the layers are built). ``embed_scale``, when present, is the factor of
an embedding that scales its output (Gemma 3: the square root of the *original* hidden size,
which a pruned hidden size no longer gives).

The model is the family's own ``*Model`` / ``*ForCausalLM``: after it is built, the attention
(``q/k/v/o_proj``) and MLP (``gate/up/down_proj``) projections of each layer are replaced by
linears of the layer's size, with a bias where the family's had one (Qwen2's q/k/v). Every
other part (norms, q/k norms, rotary embedding, sliding-window layers, attention kernels, KV
cache, ``generate``) is transformers' code, unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["PerLayerConfigMixin", "PerLayerModelMixin", "resize_layers", "NoAttention", "Zeros", "LayerSizesError"]

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


class LayerSizesError(ValueError):
    """A checkpoint's ``layer_sizes`` do not describe its layers. Defined here, not taken from
    ``dmscale.errors``: this file loads next to the weights where dmscale is not installed."""


class PerLayerConfigMixin:
    """Mixed in before a family's config class: its checks, except that the hidden size
    divides by the number of heads (``head_dim`` is explicit here), plus ``layer_sizes``."""

    def validate(self) -> None:
        """transformers' checks of the family's config, then :meth:`validate_layer_sizes`."""
        for check in getattr(type(self), "__class_validators__", []):
            if check.__name__ != "validate_architecture":
                check(self)
        self.validate_layer_sizes()

    def validate_layer_sizes(self) -> None:
        """Each layer: ``[heads, kv_heads, intermediate]``, heads a multiple of kv_heads;
        ``[0, 0, intermediate]`` without attention, ``[heads, kv_heads, 0]`` without FFN."""
        sizes = getattr(self, "layer_sizes", None)
        layers = getattr(self, "num_hidden_layers", None)
        if not isinstance(sizes, list) or len(sizes) != layers:
            raise LayerSizesError(f"layer_sizes must list [heads, kv_heads, intermediate] for each of "
                                  f"the {layers} layers, got {sizes!r}")
        for i, size in enumerate(sizes):
            ok = len(size) == 3 and all(isinstance(n, int) and n >= 0 for n in size) and (
                size[:2] == [0, 0] or (min(size[:2]) >= 1 and size[0] % size[1] == 0))
            if not ok or size[:2] == [0, 0] and size[2] == 0:
                raise LayerSizesError(f"layer {i}: [heads, kv_heads, intermediate] must be positive with "
                                      f"heads a multiple of kv_heads, or [0, 0, intermediate] (no "
                                      f"attention), or [heads, kv_heads, 0] (no FFN), got {size!r}")


class PerLayerModelMixin:
    """Mixed in before a family's ``*Model`` or ``*ForCausalLM``: builds it, then gives each
    decoder layer the sizes of ``config.layer_sizes`` (:func:`resize_layers`)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)  # type: ignore[call-arg]
        resize_layers(self, config)  # type: ignore[arg-type]
        self.post_init()  # type: ignore[attr-defined]


class NoAttention(nn.Module):
    """The attention of a layer without one: returns ``(zeros like its input, None)``.

    It still appends one zero per new token to its KV-cache slot, ``(batch, 1, tokens, 1)``:
    transformers reads the sequence length of the cache from the first layer's slot, which
    an empty slot would report as 0.
    """

    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        cache = next((kwargs[k] for k in ("cache", "past_key_values", "past_key_value")
                      if kwargs.get(k) is not None), None)
        if cache is not None:
            step = hidden_states.new_zeros(hidden_states.shape[0], 1, hidden_states.shape[1], 1)
            cache.update(step, step, self.layer_idx)
        return torch.zeros_like(hidden_states), None


class Zeros(nn.Module):
    """The MLP (or a norm of a removed branch) of a layer without one: zeros like its input."""

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.zeros_like(hidden_states)


def _linear(old: nn.Linear, n_in: int, n_out: int) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=old.bias is not None, device=old.weight.device,
                     dtype=old.weight.dtype)


def resize_layers(model: nn.Module, config: Any) -> None:
    """Rebuild the projections of every decoder layer of ``model`` (``model.layers``, or
    ``model.model.layers``) at the sizes of ``config.layer_sizes``; set ``config.embed_scale``
    on an embedding that scales its output."""
    base = getattr(model, "model", model)
    hidden = config.hidden_size
    zero_modules = getattr(config, "zero_modules", None) or [[] for _ in config.layer_sizes]
    for layer, (heads, kv, ffn), zeros in zip(base.layers, config.layer_sizes, zero_modules):
        attn, mlp = layer.self_attn, layer.mlp
        for name in zeros:  # the modules of a removed branch: its norms too (no weights saved)
            setattr(layer, name, NoAttention(attn.layer_idx) if name == "self_attn" else Zeros())
        if heads == 0:
            layer.self_attn = NoAttention(attn.layer_idx)
        else:
            d = attn.head_dim
            q, k, v, o = (getattr(attn, n) for n in _ATTENTION)
            attn.q_proj, attn.k_proj = _linear(q, hidden, heads * d), _linear(k, hidden, kv * d)
            attn.v_proj, attn.o_proj = _linear(v, hidden, kv * d), _linear(o, heads * d, hidden)
            attn.num_key_value_groups = heads // kv
        if ffn == 0:
            layer.mlp = Zeros()
        else:
            gate, up, down = (getattr(mlp, n) for n in _MLP)
            mlp.gate_proj, mlp.up_proj = _linear(gate, hidden, ffn), _linear(up, hidden, ffn)
            mlp.down_proj = _linear(down, ffn, hidden)
            mlp.intermediate_size = ffn
    scale = getattr(config, "embed_scale", None)
    embed = base.embed_tokens
    if scale is not None and hasattr(embed, "scalar_embed_scale"):
        embed.scalar_embed_scale = float(scale)  # what transformers' weight init fills in
        embed.embed_scale.fill_(float(scale))
