"""GGUF exports run in llama.cpp itself (slow): the real SmolLM2-135M searched to 0.85x its
parameters (importance from 8 batches of Shakespeare training windows), per-layer (``deci``)
and layer-uniform (``llama``), a per-layer Qwen2 (SmolLM2's weights with random q/k/v
biases, in Qwen2's classes) and a layer-uniform Qwen3 (SmolLM2's weights with random q/k norms,
in Qwen3's classes; llama.cpp's ``qwen3``). llama.cpp's greedy continuation equals
transformers' ``generate(do_sample=False)`` token for token, ``llama-perplexity`` on held-out
Shakespeare is within 1 % of transformers' perplexity over the very same tokens (read from
llama.cpp's own logits file) with the same window convention, and llama.cpp tokenizes that text
as the Hugging Face tokenizer does.

The binaries come from ``bash scripts/build_llamacpp.sh`` (cached under
``DMSCALE_LLAMACPP_DIR``, default ``~/.cache/dmscale/llama.cpp``); the tests skip without them.
"""

from __future__ import annotations

import copy

import pytest
import torch

import dmscale as dms
from dmscale.export.gguf import gguf_architecture, gguf_layer_sizes
from llamacpp import (CTX, accumulate_importance, greedy_equal, held_out, load_smollm2, perplexities,
                      train_windows)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    return load_smollm2()


def _pruned(model, tokenizer, uniform: bool, batches: int = 8):
    """``model`` searched to 0.85x its parameters (hidden size kept): importance from
    ``batches`` batches of Shakespeare training windows, then meet_target."""
    model = copy.deepcopy(model)
    windows = train_windows(tokenizer, batches)
    searcher = dms.prepare(model, {"input_ids": windows[0][:1]}, dms.SearchConfig(
        "params", 0.85, layer_uniform=uniform, exclude=["model.embed_tokens"]))
    accumulate_importance(model, windows)
    searcher.meet_target()
    return searcher.export().eval()


@pytest.mark.parametrize("uniform", [False, True], ids=["per_layer", "layer_uniform"])
def test_smollm2_export_runs_in_llamacpp(smollm2, uniform, tmp_path):
    base, tokenizer, source = smollm2
    small = _pruned(base, tokenizer, uniform)
    sizes = gguf_layer_sizes(small)[1]
    assert (len({tuple(s) for s in sizes}) == 1) == uniform
    assert gguf_architecture(small) == ("llama" if uniform else "deci")
    path = dms.save_gguf(small, tmp_path / "model.gguf", tokenizer=source, gguf_type="f32")
    text = greedy_equal(small, tokenizer, path)
    ppl_cpp, ppl_hf, tokens = perplexities(small, path, tmp_path, bos=None)
    print(f"SmolLM2 {'uniform' if uniform else 'per-layer'}: {text!r}; perplexity llama.cpp "
          f"{ppl_cpp:.4f}, transformers {ppl_hf:.4f} ({len(tokens)} tokens, ctx {CTX})")
    assert abs(ppl_cpp / ppl_hf - 1) < 0.01
    # llama.cpp tokenized the held-out text as the Hugging Face tokenizer does
    assert tokens == tokenizer(held_out())["input_ids"][:len(tokens)]


def _smollm2_as_qwen2(base, layers: int = 12):
    """SmolLM2's first ``layers`` layers in Qwen2's classes, with random q/k/v biases."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    c = base.config
    config = Qwen2Config(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                         num_hidden_layers=layers, num_attention_heads=c.num_attention_heads,
                         num_key_value_heads=c.num_key_value_heads, rms_norm_eps=c.rms_norm_eps,
                         max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    torch.manual_seed(0)
    qwen = Qwen2ForCausalLM(config).eval()
    state = {k: v for k, v in base.state_dict().items()
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    missing, _ = qwen.load_state_dict(state, strict=False)
    assert all(k.endswith("_proj.bias") for k in missing) and missing
    with torch.no_grad():
        for layer in qwen.model.layers:
            for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                p.bias.normal_(0, 0.3)
    return qwen


def test_per_layer_qwen2_with_biases_runs_in_llamacpp(smollm2, tmp_path):
    base, tokenizer, source = smollm2
    small = _pruned(_smollm2_as_qwen2(base), tokenizer, uniform=False, batches=1)  # random biases: no sense to find
    assert small.model.layers[0].self_attn.q_proj.bias is not None
    assert gguf_architecture(small) == "deci"
    path = dms.save_gguf(small, tmp_path / "model.gguf", tokenizer=source, gguf_type="f32")
    text = greedy_equal(small, tokenizer, path)
    ppl_cpp, ppl_hf, _ = perplexities(small, path, tmp_path, bos=None)
    print(f"Qwen2 per-layer: {text!r}; perplexity llama.cpp {ppl_cpp:.4f}, transformers {ppl_hf:.4f}")
    assert abs(ppl_cpp / ppl_hf - 1) < 0.01


def _smollm2_as_qwen3(base, layers: int = 12):
    """SmolLM2's first ``layers`` layers in Qwen3's classes, with random q/k norm weights."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    c = base.config
    config = Qwen3Config(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                         num_hidden_layers=layers, num_attention_heads=c.num_attention_heads,
                         num_key_value_heads=c.num_key_value_heads, head_dim=c.hidden_size // c.num_attention_heads,
                         rms_norm_eps=c.rms_norm_eps, max_position_embeddings=c.max_position_embeddings,
                         tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    torch.manual_seed(0)
    qwen = Qwen3ForCausalLM(config).eval()
    state = {k: v for k, v in base.state_dict().items()
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    missing, _ = qwen.load_state_dict(state, strict=False)
    assert missing and all(k.endswith(("q_norm.weight", "k_norm.weight")) for k in missing), missing
    with torch.no_grad():  # q/k norms that differ per dim: llama.cpp must apply them as written
        for layer in qwen.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.uniform_(0.5, 1.5)
    return qwen


def test_layer_uniform_qwen3_runs_in_llamacpp(smollm2, tmp_path):
    base, tokenizer, source = smollm2
    small = _pruned(_smollm2_as_qwen3(base), tokenizer, uniform=True, batches=1)
    assert gguf_architecture(small) == "qwen3"
    assert len({tuple(s) for s in gguf_layer_sizes(small)[1]}) == 1
    path = dms.save_gguf(small, tmp_path / "model.gguf", tokenizer=source, gguf_type="f32")
    text = greedy_equal(small, tokenizer, path)
    ppl_cpp, ppl_hf, _ = perplexities(small, path, tmp_path, bos=None)
    print(f"Qwen3 layer-uniform: {text!r}; perplexity llama.cpp {ppl_cpp:.4f}, transformers {ppl_hf:.4f}")
    assert abs(ppl_cpp / ppl_hf - 1) < 0.01
