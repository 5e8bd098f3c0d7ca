"""Qwen2 / Qwen2.5: a width per layer, the format of a DMS-pruned Qwen2 whose layers differ.

Written next to the weights by ``dmscale.save_pretrained`` with ``dmscale_per_layer.py``, and
referenced from ``config.json`` through ``auto_map``, so that::

    AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)

loads the model with nothing but ``torch`` and ``transformers`` installed: transformers' own
``Qwen2ForCausalLM`` whose attention and MLP projections have each layer's sizes
(``layer_sizes``; see ``dmscale_per_layer.py``). The q/k/v projections keep their bias;
``layer_types`` (full or sliding-window attention) lists the kept layers.
"""

from __future__ import annotations

from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Model

from .dmscale_per_layer import PerLayerConfigMixin, PerLayerModelMixin

__all__ = ["DMScaleQwen2Config", "DMScaleQwen2Model", "DMScaleQwen2ForCausalLM"]


class DMScaleQwen2Config(PerLayerConfigMixin, Qwen2Config):
    """``Qwen2Config`` with ``layer_sizes``: ``[heads, kv_heads, intermediate]`` per layer."""

    model_type = "dmscale_qwen2"


class DMScaleQwen2Model(PerLayerModelMixin, Qwen2Model):
    """``Qwen2Model`` whose decoder layers have the sizes of ``config.layer_sizes``."""

    config_class = DMScaleQwen2Config


class DMScaleQwen2ForCausalLM(PerLayerModelMixin, Qwen2ForCausalLM):
    """``Qwen2ForCausalLM`` whose decoder layers have the sizes of ``config.layer_sizes``."""

    config_class = DMScaleQwen2Config
