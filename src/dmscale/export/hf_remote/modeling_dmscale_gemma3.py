"""Gemma 3 (text): a width per layer, the format of a DMS-pruned Gemma 3 whose layers differ.

Written next to the weights by ``dmscale.save_pretrained`` with ``dmscale_per_layer.py``, and
referenced from ``config.json`` through ``auto_map``, so that::

    AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)

loads the model with nothing but ``torch`` and ``transformers`` installed: transformers' own
``Gemma3ForCausalLM`` whose attention and MLP projections have each layer's sizes
(``layer_sizes``; see ``dmscale_per_layer.py``). Norms, q/k norms and soft-capping are Gemma
3's own; ``layer_types`` lists the kept layers (sliding or global attention) and
``embed_scale`` the factor of the embeddings (the square root of the original hidden size).
"""

from __future__ import annotations

from transformers import Gemma3TextConfig, Gemma3ForCausalLM, Gemma3TextModel

from .dmscale_per_layer import PerLayerConfigMixin, PerLayerModelMixin

__all__ = ["DMScaleGemma3Config", "DMScaleGemma3Model", "DMScaleGemma3ForCausalLM"]


class DMScaleGemma3Config(PerLayerConfigMixin, Gemma3TextConfig):
    """``Gemma3TextConfig`` with ``layer_sizes``: ``[heads, kv_heads, intermediate]`` per layer."""

    model_type = "dmscale_gemma3_text"


class DMScaleGemma3Model(PerLayerModelMixin, Gemma3TextModel):
    """``Gemma3TextModel`` whose decoder layers have the sizes of ``config.layer_sizes``."""

    config_class = DMScaleGemma3Config


class DMScaleGemma3ForCausalLM(PerLayerModelMixin, Gemma3ForCausalLM):
    """``Gemma3ForCausalLM`` whose decoder layers have the sizes of ``config.layer_sizes``."""

    config_class = DMScaleGemma3Config
