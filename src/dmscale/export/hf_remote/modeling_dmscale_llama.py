"""Llama with a width per layer: the format of a DMS-pruned Llama whose layers differ.

Written next to the weights by ``dmscale.save_pretrained`` and referenced from
``config.json`` through ``auto_map``, so that::

    AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)

loads the model with nothing but ``torch`` and ``transformers`` installed.

The config is a ``LlamaConfig`` plus ``layer_sizes``: one
``[num_attention_heads, num_key_value_heads, intermediate_size]`` per decoder layer;
``head_dim`` is explicit and the same in every layer. The model is transformers' own
``LlamaForCausalLM`` whose attention and MLP projections are rebuilt with each layer's sizes:
every other part (rotary embedding, attention kernels, KV cache, ``generate``) is
transformers' code, unchanged. ``num_attention_heads``, ``num_key_value_heads`` and
``intermediate_size`` of the config hold the largest per-layer value (an upper bound, used
only while the layers are built).
"""

from __future__ import annotations

from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel

__all__ = ["DMScaleLlamaConfig", "DMScaleLlamaModel", "DMScaleLlamaForCausalLM"]


class DMScaleLlamaConfig(LlamaConfig):
    """``LlamaConfig`` with ``layer_sizes``: ``[heads, kv_heads, intermediate]`` per layer."""

    model_type = "dmscale_llama"

    def validate(self) -> None:
        """transformers' checks, except that the hidden size must divide by the number of
        heads (``head_dim`` is explicit here), plus the per-layer sizes."""
        for check in getattr(type(self), "__class_validators__", []):
            if check.__name__ != "validate_architecture":
                check(self)
        self.validate_layer_sizes()

    def validate_layer_sizes(self) -> None:
        """Each layer: ``[heads, kv_heads, intermediate]``, heads a multiple of kv_heads."""
        sizes = getattr(self, "layer_sizes", None)
        if not isinstance(sizes, list) or len(sizes) != self.num_hidden_layers:
            raise ValueError(f"layer_sizes must list [heads, kv_heads, intermediate] for each of "
                             f"the {self.num_hidden_layers} layers, got {sizes!r}")
        for i, (heads, kv, _ffn) in enumerate(sizes):
            if kv < 1 or heads % kv:
                raise ValueError(f"layer {i}: {heads} attention heads are not a multiple of "
                                 f"{kv} key-value heads")


def _resize_layers(model: LlamaModel, config: DMScaleLlamaConfig) -> None:
    hidden, bias, mlp_bias = config.hidden_size, config.attention_bias, config.mlp_bias
    for layer, (heads, kv, ffn) in zip(model.layers, config.layer_sizes):
        attn, mlp = layer.self_attn, layer.mlp
        d = attn.head_dim
        attn.q_proj = nn.Linear(hidden, heads * d, bias=bias)
        attn.k_proj = nn.Linear(hidden, kv * d, bias=bias)
        attn.v_proj = nn.Linear(hidden, kv * d, bias=bias)
        attn.o_proj = nn.Linear(heads * d, hidden, bias=bias)
        attn.num_key_value_groups = heads // kv
        mlp.intermediate_size = ffn
        mlp.gate_proj = nn.Linear(hidden, ffn, bias=mlp_bias)
        mlp.up_proj = nn.Linear(hidden, ffn, bias=mlp_bias)
        mlp.down_proj = nn.Linear(ffn, hidden, bias=mlp_bias)


class DMScaleLlamaModel(LlamaModel):
    """``LlamaModel`` whose decoder layers have the sizes of ``config.layer_sizes``."""

    config_class = DMScaleLlamaConfig

    def __init__(self, config: DMScaleLlamaConfig) -> None:
        super().__init__(config)
        _resize_layers(self, config)
        self.post_init()


class DMScaleLlamaForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` whose decoder layers have the sizes of ``config.layer_sizes``."""

    config_class = DMScaleLlamaConfig

    def __init__(self, config: DMScaleLlamaConfig) -> None:
        super().__init__(config)
        _resize_layers(self.model, config)
        self.post_init()
