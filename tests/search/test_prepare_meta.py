"""``dms.prepare`` of a model on the ``meta`` device (shapes only, no weights): the same search
space, gates and costs as the real model, so the memory plan counts the gates of a model that
was never loaded."""

from __future__ import annotations

import torch

import dmscale as dms


def _llama(device: str) -> torch.nn.Module:
    dms.ensure_torchvision()
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    with torch.device(device):
        return LlamaForCausalLM(cfg)


def _space(searcher: dms.Searcher) -> tuple:
    s = searcher.space
    return ([(d.name, d.kind, d.size) for d in s.width], [(d.name, len(d.blocks)) for d in s.depth],
            s.pinned_reasons, s.total_macs)


def test_a_meta_model_is_prepared_as_the_real_one():
    x = {"input_ids": torch.zeros(1, 8, dtype=torch.long)}
    real, meta = _llama("cpu"), _llama("meta")
    a = dms.prepare(real, x, dms.SearchConfig("params", 0.7))
    b = dms.prepare(meta, {"input_ids": x["input_ids"].to("meta")}, dms.SearchConfig("params", 0.7))
    assert _space(a) == _space(b)  # the norms are recognised, the residual blocks found
    assert (a.supernet_cost, a.target_cost) == (b.supernet_cost, b.target_cost)
    gates = {n: (tuple(t.shape), t.dtype) for n, t in real.state_dict().items() if n.startswith("dms_gates")}
    assert gates == {n: (tuple(t.shape), t.dtype) for n, t in meta.state_dict().items() if n.startswith("dms_gates")}
    assert all(t.device.type == "cpu" for n, t in meta.state_dict().items() if n.startswith("dms_gates"))
    assert all(p.device.type == "meta" for n, p in meta.named_parameters() if not n.startswith("dms_gates"))
