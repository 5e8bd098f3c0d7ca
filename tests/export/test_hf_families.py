"""Per-layer widths of Qwen2, Qwen3, Mistral and Gemma 3 save for ``from_pretrained`` as
Llama's do (issue 32); a family that cannot be saved is refused before a search.

Tiny random models: a search with depth (a layer goes), the export against the hardened
supernet, ``save_pretrained`` (which loads the directory back and compares logits), and the
config's per-layer sizes and attention types; the load without dmscale runs in a fresh
process. The command line's refusal (before its first step, one message under torchrun) is in
``tests/run/test_hf_save_refusal.py``.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

import dmscale as dms
from dmscale.export.hf import check_save_pretrained, hf_layer_sizes
from hf_fresh import load_fresh

dms.ensure_torchvision()
transformers = pytest.importorskip("transformers")

SLIDE = {"sliding_window": 4}
# family: (config class, model class, model_type, config overrides)
FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "qwen2",
              dict(SLIDE, use_sliding_window=True, max_window_layers=2)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "qwen3", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", "mistral", SLIDE),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", "gemma3_text",
               dict(SLIDE, query_pre_attn_scalar=16, layer_types=["sliding_attention", "full_attention"] * 2)),
}


def tiny(family: str, layers: int = 4) -> nn.Module:
    """A random ``family`` causal LM: 64 tokens, hidden 64, 4 heads of 16 in 2 KV groups."""
    cfg_cls, lm_cls, _, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, cfg_cls)(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, **extra)
    return getattr(transformers, lm_cls)(config)


def _search(model: nn.Module, x: dict, steps: int = 8, **config) -> dms.Searcher:
    """A search of ``model`` down to 60% of its parameters (per-layer unless ``config`` says)."""
    searcher = dms.prepare(model, x, dms.SearchConfig(resource="params", target=0.6, **config))
    opt = torch.optim.Adam([{"params": list(searcher.model_parameters()), "lr": 1e-3},
                            {"params": list(searcher.structure_parameters()), "lr": 0.05}])
    model.train()
    for i in range(steps):
        loss = model(**x, labels=x["input_ids"]).loss + searcher.resource_loss(i / (steps - 1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    searcher.meet_target()
    return searcher


def _export(family: str, hidden: int | None = None) -> tuple[dms.Searcher, nn.Module, list]:
    """Search, optionally set the hidden size, export; check the export against the hardened
    supernet. Returns (searcher, export, the attention types of the supernet's layers)."""
    model = tiny(family)
    types = [getattr(layer.self_attn, "layer_type", None) for layer in model.model.layers]
    x = {"input_ids": torch.randint(0, 64, (2, 8))}
    searcher = _search(model, x)
    if hidden is not None:
        with torch.no_grad():
            searcher.gates.width[0].set_count(hidden)  # the embedding's (hidden size) dim
    small = searcher.export().eval()
    ids = (torch.arange(12) * 5 % 64).view(1, -1)  # longer than the sliding window
    with searcher.hardened() as hard, torch.no_grad():
        hard.eval()
        want = hard(input_ids=ids).logits
        torch.testing.assert_close(small(input_ids=ids).logits, want, atol=1e-5, rtol=1e-5)
    return searcher, small, types


@pytest.mark.parametrize("family", list(FAMILIES))
def test_per_layer_widths_save_for_from_pretrained(tmp_path, family):
    hidden = 50 if family == "gemma3" else None  # Gemma 3's embed scale must survive it
    searcher, small, types = _export(family, hidden)
    sizes = hf_layer_sizes(small)
    assert not sizes["uniform"], "the search should give unequal layers"
    check_save_pretrained(tiny(family))  # a per-layer family: nothing to refuse
    dms.save_pretrained(small, tmp_path)  # loads it back in-process and compares logits
    config = json.loads((tmp_path / "config.json").read_text())
    model_type = FAMILIES[family][2]
    assert config["model_type"] == f"dmscale_{model_type}"
    assert config["layer_sizes"] == sizes["layers"]
    stem = "gemma3" if family == "gemma3" else family
    assert config["auto_map"]["AutoModelForCausalLM"].startswith(f"modeling_dmscale_{stem}.")
    assert {"dmscale_per_layer.py", f"modeling_dmscale_{stem}.py"} <= set(os.listdir(tmp_path))
    assert not (tmp_path / "modeling_dmscale_llama.py").exists()
    depth = searcher.structure()["depth"][0]
    kept = [depth["blocks"].index(b) for b in depth["kept"]]
    assert config["num_hidden_layers"] == len(kept) < len(types)
    if types[0] is not None:  # the kept layers keep their sliding or full attention
        assert config["layer_types"] == [types[i] for i in kept]
    if family == "gemma3":
        assert sizes["hidden_size"] == 50 and config["embed_scale"] == 8.0


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_layer_uniform_saves_the_families_own_config(tmp_path, family):
    """Equal layers: the family's own config, the kept layers' attention types; Gemma 3 with a
    pruned hidden size cannot state its embedding scale there: per-layer, with a warning."""
    model = tiny(family)
    types = [layer.self_attn.layer_type for layer in model.model.layers]
    x = {"input_ids": torch.randint(0, 64, (2, 8))}
    searcher = _search(model, x, layer_uniform=True, exclude=["model.embed_tokens"])
    small = searcher.export().eval()
    dms.save_pretrained(small, tmp_path / "std")
    config = json.loads((tmp_path / "std" / "config.json").read_text())
    assert config["model_type"] == FAMILIES[family][2] and "auto_map" not in config
    depth = searcher.structure()["depth"][0]
    assert len(depth["kept"]) < len(types)  # a layer went: layer_types lists the kept ones
    assert config["layer_types"] == [types[depth["blocks"].index(b)] for b in depth["kept"]]
    if family == "gemma3":
        searcher = _search(tiny(family), x, layer_uniform=True, steps=2)
        with torch.no_grad():
            searcher.gates.width[0].set_count(48)  # divisible by the 4 heads: only the scale is off
        with pytest.warns(UserWarning, match="embed_tokens"):
            dms.save_pretrained(searcher.export(), tmp_path / "auto")
        config = json.loads((tmp_path / "auto" / "config.json").read_text())
        assert config["model_type"] == "dmscale_gemma3_text" and config["embed_scale"] == 8.0


def test_qwen2_per_layer_loads_without_dmscale(tmp_path):
    """The issue's case: a per-layer Qwen2 export, saved, then loaded by plain transformers
    in a process where dmscale cannot be imported -- same logits and greedy tokens."""
    _, small, _ = _export("qwen2")
    dms.save_pretrained(small, tmp_path)
    ids = (torch.arange(10) * 3 % 64).view(1, -1)
    (got,) = load_fresh([(str(tmp_path), True)], ids, 4)
    assert not got["dmscale_loaded"] and got["class"] == "DMScaleQwen2ForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(got["logits"], small(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
        assert torch.equal(got["tokens"], small.generate(ids, max_new_tokens=4, do_sample=False))


@pytest.mark.slow
def test_every_per_layer_family_loads_without_dmscale(tmp_path):
    """Qwen3, Mistral and Gemma 3 (pruned hidden size) in one fresh process."""
    families = ["qwen3", "mistral", "gemma3"]
    exports = [_export(f, 50 if f == "gemma3" else None)[1] for f in families]
    for f, small in zip(families, exports):
        dms.save_pretrained(small, tmp_path / f)
    ids = (torch.arange(10) * 3 % 64).view(1, -1)
    got = load_fresh([(str(tmp_path / f), True) for f in families], ids, 4)
    for small, result in zip(exports, got):
        assert not result["dmscale_loaded"]
        with torch.no_grad():
            torch.testing.assert_close(result["logits"], small(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
            assert torch.equal(result["tokens"], small.generate(ids, max_new_tokens=4, do_sample=False))


def test_a_family_without_a_format_is_refused_before_the_search():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    for uniform in (False, True):
        with pytest.raises(dms.UnsupportedLayerError, match=r"'gpt2' model.*qwen2.*dmscale\.save"):
            check_save_pretrained(gpt2, layer_uniform=uniform)
    # a wrapper (the text task's CausalLM) is looked through
    wrapper = nn.Module()
    wrapper.lm = tiny("mistral", layers=1)
    check_save_pretrained(wrapper, layer_uniform=False)
