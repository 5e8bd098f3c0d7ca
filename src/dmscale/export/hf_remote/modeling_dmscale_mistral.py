"""Mistral: a width per layer, the format of a DMS-pruned Mistral whose layers differ.

Written next to the weights by ``dmscale.save_pretrained`` with ``dmscale_per_layer.py``, and
referenced from ``config.json`` through ``auto_map``, so that::

    AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)

loads the model with nothing but ``torch`` and ``transformers`` installed: transformers' own
``MistralForCausalLM`` whose attention and MLP projections have each layer's sizes
(``layer_sizes``; see ``dmscale_per_layer.py``). ``sliding_window`` stays the family's own
(every layer).
"""

from __future__ import annotations

from transformers import MistralConfig, MistralForCausalLM, MistralModel

from .dmscale_per_layer import PerLayerConfigMixin, PerLayerModelMixin

__all__ = ["DMScaleMistralConfig", "DMScaleMistralModel", "DMScaleMistralForCausalLM"]


class DMScaleMistralConfig(PerLayerConfigMixin, MistralConfig):
    """``MistralConfig`` with ``layer_sizes``: ``[heads, kv_heads, intermediate]`` per layer."""

    model_type = "dmscale_mistral"


class DMScaleMistralModel(PerLayerModelMixin, MistralModel):
    """``MistralModel`` whose decoder layers have the sizes of ``config.layer_sizes``."""

    config_class = DMScaleMistralConfig


class DMScaleMistralForCausalLM(PerLayerModelMixin, MistralForCausalLM):
    """``MistralForCausalLM`` whose decoder layers have the sizes of ``config.layer_sizes``."""

    config_class = DMScaleMistralConfig
