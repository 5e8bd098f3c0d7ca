"""The ``kv_cache`` resource: bytes of K and V cached per token, exact (``dms.count`` of the
export) and soft (the search's cost model), equal at hard masks; refused without attention."""

from __future__ import annotations

import pytest
import torch

import dmscale as dms
from dmscale.core.errors import ConfigError
from dmscale.cost.kv_cache import kv_cache_bytes, kv_layers


def _llama(layers: int = 3, heads: int = 4, kv_heads: int = 2, head_dim: int = 16):
    dms.ensure_torchvision()
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        tie_word_embeddings=False))


def _qwen2():
    dms.ensure_torchvision()
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))


def test_count_of_a_gqa_llama_is_two_x_kv_heads_x_head_dim_x_bytes_per_layer():
    model = _llama()
    x = torch.randint(0, 64, (1, 8))
    assert dms.count(model, x)["kv_cache"] == 3 * 2 * 2 * 16 * 4  # layers x (K, V) x KV heads x dim x fp32
    assert kv_cache_bytes(model.to(torch.bfloat16)) == 3 * 2 * 2 * 16 * 2
    assert [layer.name for layer in kv_layers(model)] == [f"model.layers.{i}.self_attn" for i in range(3)]


@pytest.mark.parametrize("make", [_llama, _qwen2], ids=["llama_gqa_4q_2kv", "qwen2"])
@pytest.mark.parametrize("depth_ratio, width_ratio", [(0.0, 0.0), (0.4, 0.3), (0.0, 0.6), (0.7, 0.5)])
def test_soft_count_at_hard_masks_is_the_exact_count_of_the_export(make, depth_ratio, width_ratio):
    model = make()
    x = torch.randint(0, 64, (2, 8))
    searcher = dms.prepare(model, x, dms.SearchConfig(resource="kv_cache", target=0.5, importance="index"))
    assert searcher.supernet_cost == dms.count(model, x)["kv_cache"]
    with torch.no_grad():
        for t in searcher.gates.depth:
            t.a.fill_(depth_ratio)
        for t in searcher.gates.width:
            t.a.fill_(width_ratio)
        for t in searcher.gates.width + searcher.gates.depth:
            t.clamp_()
        w, d = searcher.gates.masks("hard")
        soft_at_hard = float(searcher.costs.model_of("kv_cache")(w, d))
    small = searcher.export()
    exact = dms.count(small, x)["kv_cache"]
    assert soft_at_hard == searcher.resources()["hard"] == exact
    if (depth_ratio, width_ratio) != (0.0, 0.0):
        assert exact < searcher.supernet_cost  # the masks did remove cache


def test_a_layer_dropped_by_depth_caches_nothing():
    model = _llama(layers=3)
    x = torch.randint(0, 64, (1, 8))
    searcher = dms.prepare(model, x, dms.SearchConfig(resource="kv_cache", target=0.9, importance="index"))
    with torch.no_grad():
        searcher.gates.depth[0].set_count(2)  # two of the three layers
        for t in searcher.gates.width:
            t.a.fill_(0.0)
    assert searcher.resources()["hard"] == 2 * 2 * 2 * 16 * 4
    # the soft count follows the depth mask too: lower the layer's mask, lower the cost
    cost = searcher.costs.soft("kv_cache")
    cost.backward()
    assert searcher.gates.depth[0].a.grad is not None and float(searcher.gates.depth[0].a.grad) != 0.0


def test_a_model_without_attention_has_no_kv_cache_and_a_budget_on_it_is_refused():
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3))
    x = torch.randn(1, 3, 8, 8)
    assert "kv_cache" not in dms.count(net, x)
    with pytest.raises(ConfigError, match="resource 'kv_cache' needs attention layers.*Sequential"):
        dms.prepare(net, x, dms.SearchConfig(resource="kv_cache", target=0.5))
    assert not hasattr(net, "dms_gates")  # left as it was
    with pytest.raises(ConfigError, match="needs attention layers"):
        dms.prepare(net, x, dms.SearchConfig(targets={"params": 0.5, "kv_cache": 0.5}))
