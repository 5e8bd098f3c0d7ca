"""What a width dim is called (src/dmscale/trace/naming.py), on real model definitions: the
residual streams of torchvision's ResNet-18 and of a Hugging Face Llama are named as streams,
a layer's own width by its layer."""

from __future__ import annotations

import pytest
import torch

import dmscale as dms
from dmscale.trace.naming import dim_label, residual_stream

torchvision = pytest.importorskip("torchvision")


def _labels(model: torch.nn.Module, x: object) -> dict[str, str]:
    searcher = dms.prepare(model, x, dms.SearchConfig())
    try:
        return {d.name: dim_label(d.name, d.producers) for d in searcher.space.width}
    finally:
        dms.detach(model)


def test_resnet18_residual_streams_are_named_by_their_stage_and_block_count():
    labels = _labels(torchvision.models.resnet18(num_classes=10), torch.randn(1, 3, 32, 32))
    assert labels["conv1"] == "layer1 residual stream, 2 blocks (+ conv1)"
    assert labels["layer3.0.conv2"] == "layer3 residual stream, 2 blocks"
    assert labels["layer4.0.conv2"] == "layer4 residual stream, 2 blocks"
    assert labels["layer3.1.conv1"] == "layer3.1.conv1"  # a block's own inner width
    streams = [n for n, lab in labels.items() if "residual stream" in lab]
    assert streams == ["conv1", "layer2.0.conv2", "layer3.0.conv2", "layer4.0.conv2"]


def test_a_transformers_hidden_size_is_its_decoder_layers_stream():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(cfg).eval()
    labels = _labels(model, torch.randint(0, 64, (1, 8)))
    hidden = [lab for lab in labels.values() if "residual stream" in lab]
    assert hidden == ["model.layers residual stream, 3 blocks (+ model.embed_tokens)"]
    assert labels["model.layers.1.mlp.gate_proj"] == "model.layers.1.mlp.gate_proj"


def test_widths_inside_one_block_are_not_streams():
    assert residual_stream(["layer1.0.conv1"]) is None
    assert residual_stream(["blocks.2.attn.q", "blocks.2.attn.k"]) is None  # two layers, one block
    assert residual_stream(["fc1", "fc2"]) is None  # no repeated container at all
    assert residual_stream(["stages.2.blocks.0.conv3", "stages.2.blocks.0.downsample.conv",
                            "stages.2.blocks.1.conv3"]) == ("stages.2.blocks", 2, [])
