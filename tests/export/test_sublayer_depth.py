"""Sublayer depth (issue 48, item 2): attention-free and FFN-free layers.

With ``SearchConfig(depth_unit="sublayer")`` each residual branch of a transformer block is a
depth unit of its own. On a tiny Llama, Qwen2 and a timm ViT, hardened with a mix of dropped
attention and dropped FFN branches: open masks reproduce the model, the export computes what
the hardened supernet computes, the cost at hard masks is ``dms.count`` of the export, and a
structure file rebuilds the same export. The Hugging Face per-layer save states the removed
branches as zeros in ``layer_sizes`` and loads back (with a KV cache for ``generate``).
"""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from torch import nn

import dmscale as dms
from dmscale.core.errors import ConfigError
from dmscale.export.hf import hf_layer_sizes
from exact import drop_units, max_abs_diff

dms.ensure_torchvision()
transformers = pytest.importorskip("transformers")


def _tiny_lm(cls: str = "Llama", layers: int = 4) -> nn.Module:
    torch.manual_seed(0)
    config = getattr(transformers, f"{cls}Config")(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    return getattr(transformers, f"{cls}ForCausalLM")(config).eval()


def _tiny_vit() -> nn.Module:
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    return timm.create_model("deit_tiny_patch16_224", pretrained=False, img_size=32, num_classes=4,
                             depth=4).eval()


def _out(model: nn.Module, x) -> torch.Tensor:
    y = model(**x) if isinstance(x, dict) else model(x)
    return y.logits if hasattr(y, "logits") else y


# units per layer: attention (2 i), FFN (2 i + 1); layer 0 without attention, layers 1 and 3
# without FFN, layer 2 whole
MIX = [0, 3, 7]


def _cases():
    ids = {"input_ids": torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))}
    return {"llama": (lambda: _tiny_lm("Llama"), ids), "qwen2": (lambda: _tiny_lm("Qwen2"), ids),
            "vit": (_tiny_vit, torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)))}


@pytest.mark.parametrize("case", ["llama", "qwen2", "vit"])
@pytest.mark.parametrize("resource", ["params", "macs"])
def test_sublayer_exact(case, resource):
    build, x = _cases()[case]
    model = build()
    with torch.no_grad():
        reference = _out(model, x)
    searcher = dms.prepare(model, x, dms.SearchConfig(resource, 1.0, depth_unit="sublayer"))
    (stage,) = searcher.space.depth
    assert len(stage.blocks) == 8 and stage.min_keep == 1
    assert [b.layer.name for b in stage.blocks[:2]] == [stage.blocks[0].layer.name] * 2
    with torch.no_grad(), searcher.hardened():  # all open: the model itself
        torch.testing.assert_close(_out(model, x), reference, atol=1e-5, rtol=1e-5)
    drop_units(searcher, MIX)
    searcher.randomize_importance(0)  # width too: kept channels anywhere
    with torch.no_grad():
        for t in searcher.gates.width:
            t.set_count(max(1, t.n_units * 3 // 4))
    with torch.no_grad(), searcher.hardened():
        hard = _out(model, x)
    small = searcher.export().eval()
    with torch.no_grad():
        assert max_abs_diff(_out(small, x), hard) < 1e-4
    counted = dms.count(small, x)
    assert searcher.resources()["hard"] == counted[resource]
    assert counted["params"] < dms.count(build(), x)["params"]
    # a structure file rebuilds the same export on a fresh copy
    again = dms.apply_structure(build(), json.loads(json.dumps(searcher.structure()))).eval()
    with torch.no_grad():
        assert max_abs_diff(_out(again, x), _out(small, x)) == 0.0


def test_block_depth_is_unchanged():
    model = _tiny_lm()
    x = {"input_ids": torch.randint(0, 64, (2, 7))}
    searcher = dms.prepare(model, x, dms.SearchConfig("params", 1.0))
    (stage,) = searcher.space.depth
    assert [b.name for b in stage.blocks] == [f"model.layers.{i}" for i in range(4)]
    assert all(b.layer is None and not b.members for b in stage.blocks)


def test_both_branches_removed_drops_the_layer():
    model = _tiny_lm()
    x = {"input_ids": torch.randint(0, 64, (2, 7))}
    searcher = dms.prepare(model, x, dms.SearchConfig("params", 1.0, depth_unit="sublayer"))
    drop_units(searcher, [2, 3, 4])  # layer 1 whole, layer 2's attention
    with torch.no_grad(), searcher.hardened():
        hard = model(**x).logits
    small = searcher.export().eval()
    assert len(small.model.layers) == 3 and small.config.num_hidden_layers == 3
    assert [type(small.model.layers[i].self_attn).__name__ for i in range(3)] == \
        ["LlamaAttention", "ZeroBranch", "LlamaAttention"]
    assert small.model.layers[1].self_attn.layer_idx == 1  # renumbered: its KV-cache slot
    with torch.no_grad():
        assert max_abs_diff(small(**x).logits, hard) < 1e-4
    assert searcher.resources()["hard"] == dms.count(small, x)["params"]
    removed = searcher.structure()["removed_blocks"]
    assert [(b["name"], b.get("branch", False)) for b in removed] == \
        [("model.layers.1", False), ("model.layers.2.self_attn", True)]


def test_min_keep_counts_units():
    model = _tiny_lm(layers=2)
    x = {"input_ids": torch.randint(0, 64, (2, 7))}
    searcher = dms.prepare(model, x, dms.SearchConfig("params", 1.0, depth_unit="sublayer"))
    (gate,) = searcher.gates.depth
    gate.set_count(0)
    assert gate.hard_count() == 1  # the stage keeps one branch


def test_shared_norm_keeps_the_block_whole():
    """A parallel block (both branches read one norm) cannot lose one branch alone."""

    class Parallel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.a, self.b = nn.LayerNorm(8), nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.norm(x)
            x = x + self.a(h)
            return x + self.b(h)

    class Serial(Parallel):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.a(self.norm(x))
            return x + self.b(x)

    net = nn.Sequential(nn.Linear(8, 8), Parallel(), Serial())
    space = dms.prepare(net, torch.randn(2, 8), dms.SearchConfig(depth_unit="sublayer")).space
    names = [(b.name, b.layer.name if b.layer else None) for d in space.depth for b in d.blocks]
    assert names == [("1", None), ("2.a", "2"), ("2.b", "2")]


def test_config_checks():
    with pytest.raises(ConfigError, match="depth_unit"):
        dms.SearchConfig(depth_unit="layer")
    with pytest.raises(ConfigError, match="latency"):
        dms.SearchConfig(resource="latency", depth_unit="sublayer")
    x = {"input_ids": torch.randint(0, 64, (2, 7))}
    with pytest.raises(ConfigError, match="depth_unit='block'"):
        dms.prepare(_tiny_lm(), x, dms.SearchConfig(layer_uniform=True, depth_unit="sublayer"))
    # a model without a standard config to keep: layer-uniform widths with sublayer depth
    vit = _tiny_vit()
    s = dms.prepare(vit, torch.randn(1, 3, 32, 32), dms.SearchConfig(layer_uniform=True, depth_unit="sublayer"))
    assert len(s.space.depth[0].blocks) == 8


def _hf_mix(tmp_path):
    """A tiny Llama without attention in layer 0 and without FFN in layers 1 and 3, saved."""
    model = _tiny_lm()
    x = {"input_ids": torch.randint(0, 64, (2, 7))}
    searcher = dms.prepare(model, x, dms.SearchConfig("params", 1.0, depth_unit="sublayer"))
    drop_units(searcher, MIX)
    small = searcher.export().eval()
    sizes = hf_layer_sizes(small)["layers"]
    assert sizes == [[0, 0, 64], [4, 2, 0], [4, 2, 64], [4, 2, 0]]
    dms.save_pretrained(small, tmp_path)  # loads back in this process and compares logits
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "dmscale_llama" and config["layer_sizes"] == sizes
    assert config["zero_modules"][0] == ["self_attn", "input_layernorm"]
    return small


def _incremental_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Logits of the last token, computed after the others through a DynamicCache, with
    the positions taken from the cache's length (no position_ids): what a KV-cache slot
    left empty by a layer without attention would get wrong."""
    out = model(input_ids=ids[:, :-1], use_cache=True)
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return model(input_ids=ids[:, -1:], **{key: out.past_key_values}).logits[:, -1]


def test_save_pretrained_with_removed_branches(tmp_path):
    small = _hf_mix(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True).eval()
    assert sum(p.numel() for p in loaded.parameters()) == sum(p.numel() for p in small.parameters())
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = small(input_ids=ids).logits[:, -1]
        for model in (small, loaded):  # layer 0 has no attention: the cache still counts tokens
            torch.testing.assert_close(_incremental_logits(model, ids), full, atol=1e-5, rtol=1e-5)
        cached = small.generate(ids, max_new_tokens=6, do_sample=False)
        assert torch.equal(cached, small.generate(ids, max_new_tokens=6, do_sample=False, use_cache=False))
        assert torch.equal(loaded.generate(ids, max_new_tokens=6, do_sample=False), cached)


def test_standard_save_refuses_removed_branches(tmp_path):
    small = _hf_mix(tmp_path / "per_layer")
    with pytest.raises(dms.DMScaleError, match="no attention or no FFN"):
        dms.save_pretrained(small, tmp_path / "standard", mode="standard")


@pytest.mark.slow
def test_per_layer_save_loads_without_dmscale(tmp_path):
    from hf_fresh import load_fresh

    small = _hf_mix(tmp_path)
    ids = torch.randint(0, 64, (1, 6))
    (got,) = load_fresh([(str(tmp_path), True)], ids, 8)
    assert not got["dmscale_loaded"]
    with torch.no_grad():
        want = small(input_ids=ids).logits
        tokens = small.generate(ids, max_new_tokens=8, do_sample=False)
    torch.testing.assert_close(got["logits"], want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got["tokens"], tokens)


@pytest.mark.parametrize("resource", ["params", "macs"])
def test_keep_depth_pins_a_branch(resource):
    """``keep_depth`` takes layer 0's attention out of the search: its layer then stays when
    its FFN goes (removed as a branch), and the cost counts the pinned attention as fixed."""
    model = _tiny_lm(layers=3)
    x = {"input_ids": torch.randint(0, 64, (2, 7))}
    searcher = dms.prepare(model, x, dms.SearchConfig(resource, 1.0, depth_unit="sublayer",
                                                      keep_depth=["model.layers.0.self_attn"]))
    (stage,) = searcher.space.depth
    assert [b.name for b in stage.blocks] == ["model.layers.0.mlp"] + [
        f"model.layers.{i}.{p}" for i in (1, 2) for p in ("self_attn", "mlp")]
    assert stage.blocks[0].layer.pinned == ["model.layers.0.self_attn"]
    assert list(searcher.space.split_layers()) == ["model.layers.1", "model.layers.2"]
    drop_units(searcher, [0, 1, 2])  # layer 0's FFN, all of layer 1
    with torch.no_grad(), searcher.hardened():
        hard = _out(model, x)
    small = searcher.export().eval()
    assert len(small.model.layers) == 2
    assert type(small.model.layers[0].self_attn).__name__ == "LlamaAttention"
    assert type(small.model.layers[0].mlp).__name__ == "ZeroBranch"
    with torch.no_grad():
        assert max_abs_diff(_out(small, x), hard) < 1e-4
    assert searcher.resources()["hard"] == dms.count(small, x)[resource]
    assert hf_layer_sizes(small)["layers"] == [[4, 2, 0], [4, 2, 64]]


def test_keep_depth_of_a_whole_block_and_unknown_names():
    model = _tiny_lm(layers=3)
    x = {"input_ids": torch.randint(0, 64, (2, 7))}
    space = dms.prepare(model, x, dms.SearchConfig(keep_depth=["model.layers.1.mlp"])).space
    assert [b.name for b in space.depth[0].blocks] == ["model.layers.0", "model.layers.2"]
    space = dms.prepare(_tiny_lm(layers=3), x, dms.SearchConfig(
        depth_unit="sublayer", keep_depth=["model.layers.1"])).space  # both of its branches
    assert [b.name for b in space.depth[0].blocks] == [f"model.layers.{i}.{p}" for i in (0, 2)
                                                       for p in ("self_attn", "mlp")]
    with pytest.raises(ConfigError, match="model.layers.9"):
        dms.prepare(_tiny_lm(layers=3), x, dms.SearchConfig(keep_depth=["model.layers.9"]))
    # a string reads as on the command line: comma-separated names, not characters
    assert dms.SearchConfig(keep_depth="model.layers.0").keep_depth == ["model.layers.0"]
