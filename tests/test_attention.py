"""Attention handlers: heads stay fixed where a child mixes all heads at once."""

from __future__ import annotations

import pytest
import torch

import dmscale as dms


def _tiny(name: str):
    dms.ensure_torchvision()
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    if name == "olmo2":
        return transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**common, eos_token_id=None)).eval()
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=8)).eval()


def test_olmo2_q_norm_over_all_heads_fixes_the_heads_and_the_export_is_exact():
    # before: heads were searched and the export crashed in q_norm (64 vs 32 channels)
    model = _tiny("olmo2")
    x = {"input_ids": torch.randint(0, 64, (2, 9))}
    searcher = dms.prepare(model, x, dms.SearchConfig(resource="params", target=0.7))
    assert not any(d.name.endswith(".heads") for d in searcher.space.width)
    assert "q_norm" in " ".join(searcher.space.pinned_reasons.values())
    searcher.randomize_importance(0)  # untrained: random kept heads/channels, not leading ones
    searcher.meet_target()
    small = searcher.export()  # verifies against the hardened supernet
    assert dms.count(small, x)["params"] == searcher.resources()["hard"]


def test_qwen3_per_head_dim_norms_keep_heads_searchable():
    model = _tiny("qwen3")
    x = {"input_ids": torch.randint(0, 64, (2, 9))}
    searcher = dms.prepare(model, x, dms.SearchConfig(resource="params", target=0.7))
    assert sum(d.name.endswith(".heads") for d in searcher.space.width) == 2
