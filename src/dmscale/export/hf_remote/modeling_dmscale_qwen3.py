"""Qwen3: a width per layer, the format of a DMS-pruned Qwen3 whose layers differ.

Written next to the weights by ``dmscale.save_pretrained`` with ``dmscale_per_layer.py``, and
referenced from ``config.json`` through ``auto_map``, so that::

    AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)

loads the model with nothing but ``torch`` and ``transformers`` installed: transformers' own
``Qwen3ForCausalLM`` whose attention and MLP projections have each layer's sizes
(``layer_sizes``; see ``dmscale_per_layer.py``). The q/k norms act on ``head_dim`` and are
shared by the heads, so they keep their size; ``layer_types`` lists the kept layers.
"""

from __future__ import annotations

from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3Model

from .dmscale_per_layer import PerLayerConfigMixin, PerLayerModelMixin

__all__ = ["DMScaleQwen3Config", "DMScaleQwen3Model", "DMScaleQwen3ForCausalLM"]


class DMScaleQwen3Config(PerLayerConfigMixin, Qwen3Config):
    """``Qwen3Config`` with ``layer_sizes``: ``[heads, kv_heads, intermediate]`` per layer."""

    model_type = "dmscale_qwen3"


class DMScaleQwen3Model(PerLayerModelMixin, Qwen3Model):
    """``Qwen3Model`` whose decoder layers have the sizes of ``config.layer_sizes``."""

    config_class = DMScaleQwen3Config


class DMScaleQwen3ForCausalLM(PerLayerModelMixin, Qwen3ForCausalLM):
    """``Qwen3ForCausalLM`` whose decoder layers have the sizes of ``config.layer_sizes``."""

    config_class = DMScaleQwen3Config
