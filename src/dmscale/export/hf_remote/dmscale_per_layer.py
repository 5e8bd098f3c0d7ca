"""What every ``modeling_dmscale_<family>.py`` shares: a config with one size per layer, and a
model that rebuilds each decoder layer's projections at that size.

Copied next to the weights with the family's file (which imports it as
``from .dmscale_per_layer import ...``; transformers copies relative imports of remote code
with the file), so it imports only ``torch`` and ``transformers``.

The config of a per-layer checkpoint is the family's own config plus ``layer_sizes``: one
``[num_attention_heads, num_key_value_heads, intermediate_size]`` per decoder layer, with
``head_dim`` explicit and the same in every layer; ``num_attention_heads``,
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

from torch import nn

__all__ = ["PerLayerConfigMixin", "PerLayerModelMixin", "resize_layers"]

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


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
        """Each layer: ``[heads, kv_heads, intermediate]``, heads a multiple of kv_heads."""
        sizes = getattr(self, "layer_sizes", None)
        layers = getattr(self, "num_hidden_layers", None)
        if not isinstance(sizes, list) or len(sizes) != layers:
            raise ValueError(f"layer_sizes must list [heads, kv_heads, intermediate] for each of "
                             f"the {layers} layers, got {sizes!r}")
        for i, size in enumerate(sizes):
            if len(size) != 3 or min(size) < 1 or size[0] % size[1]:
                raise ValueError(f"layer {i}: [heads, kv_heads, intermediate] must be positive with "
                                 f"heads a multiple of kv_heads, got {size!r}")


class PerLayerModelMixin:
    """Mixed in before a family's ``*Model`` or ``*ForCausalLM``: builds it, then gives each
    decoder layer the sizes of ``config.layer_sizes`` (:func:`resize_layers`)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)  # type: ignore[call-arg]
        resize_layers(self, config)  # type: ignore[arg-type]
        self.post_init()  # type: ignore[attr-defined]


def _linear(old: nn.Linear, n_in: int, n_out: int) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=old.bias is not None, device=old.weight.device,
                     dtype=old.weight.dtype)


def resize_layers(model: nn.Module, config: Any) -> None:
    """Rebuild the projections of every decoder layer of ``model`` (``model.layers``, or
    ``model.model.layers``) at the sizes of ``config.layer_sizes``; set ``config.embed_scale``
    on an embedding that scales its output."""
    base = getattr(model, "model", model)
    hidden = config.hidden_size
    for layer, (heads, kv, ffn) in zip(base.layers, config.layer_sizes):
        attn, mlp = layer.self_attn, layer.mlp
        d = attn.head_dim
        q, k, v, o = (getattr(attn, n) for n in _ATTENTION)
        attn.q_proj, attn.k_proj = _linear(q, hidden, heads * d), _linear(k, hidden, kv * d)
        attn.v_proj, attn.o_proj = _linear(v, hidden, kv * d), _linear(o, heads * d, hidden)
        attn.num_key_value_groups = heads // kv
        gate, up, down = (getattr(mlp, n) for n in _MLP)
        mlp.gate_proj, mlp.up_proj = _linear(gate, hidden, ffn), _linear(up, hidden, ffn)
        mlp.down_proj = _linear(down, ffn, hidden)
        mlp.intermediate_size = ffn
    scale = getattr(config, "embed_scale", None)
    embed = base.embed_tokens
    if scale is not None and hasattr(embed, "scalar_embed_scale"):
        embed.scalar_embed_scale = float(scale)  # what transformers' weight init fills in
        embed.embed_scale.fill_(float(scale))
