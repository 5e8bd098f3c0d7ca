"""Llama (Llama 2/3, SmolLM2): a width per layer, the format of a DMS-pruned Llama whose
layers differ.

Written next to the weights by ``dmscale.save_pretrained`` with ``dmscale_per_layer.py``, and
referenced from ``config.json`` through ``auto_map``, so that::

    AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)

loads the model with nothing but ``torch`` and ``transformers`` installed: transformers' own
``LlamaForCausalLM`` whose attention and MLP projections have each layer's sizes
(``layer_sizes``; see ``dmscale_per_layer.py``).
"""

from __future__ import annotations

from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel

from .dmscale_per_layer import PerLayerConfigMixin, PerLayerModelMixin

__all__ = ["DMScaleLlamaConfig", "DMScaleLlamaModel", "DMScaleLlamaForCausalLM"]


class DMScaleLlamaConfig(PerLayerConfigMixin, LlamaConfig):
    """``LlamaConfig`` with ``layer_sizes``: ``[heads, kv_heads, intermediate]`` per layer."""

    model_type = "dmscale_llama"


class DMScaleLlamaModel(PerLayerModelMixin, LlamaModel):
    """``LlamaModel`` whose decoder layers have the sizes of ``config.layer_sizes``."""

    config_class = DMScaleLlamaConfig


class DMScaleLlamaForCausalLM(PerLayerModelMixin, LlamaForCausalLM):
    """``LlamaForCausalLM`` whose decoder layers have the sizes of ``config.layer_sizes``."""

    config_class = DMScaleLlamaConfig
