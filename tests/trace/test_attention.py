"""Attention handlers: heads stay fixed where a child mixes all heads at once."""

from __future__ import annotations

import pytest
import torch

import dmscale as dms
from dmscale.export.shrink import export_model


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


# ----------------------------------------------------------------------------- timm head dims


def _timm_attention_cls():
    dms.ensure_torchvision()
    timm = pytest.importorskip("timm")
    from timm.layers.attention import Attention

    return timm, Attention


@pytest.fixture(scope="module")
def vit_search():
    """A timm ViT searched to half its MACs with random importance: (model, x, searcher, export)."""
    timm, _ = _timm_attention_cls()
    torch.manual_seed(0)
    model = timm.create_model("deit_tiny_patch16_224", pretrained=False, img_size=32, num_classes=4,
                              depth=4).eval()
    x = torch.randn(2, 3, 32, 32)
    searcher = dms.prepare(model, x, dms.SearchConfig(resource="macs", target=0.5))
    searcher.randomize_importance(0)  # random kept heads and head dims, not leading ones
    searcher.meet_target()
    return model, x, searcher, searcher.export().eval()


def _hardened_output(model, x, searcher) -> torch.Tensor:
    model.eval()
    with torch.no_grad(), searcher.hardened():
        return model(x)


def _attention_pairs(model, small):
    """(original, exported) timm Attention modules, by name, of the blocks the export kept."""
    _, Attention = _timm_attention_cls()
    kept = dict(small.named_modules())
    return [(m, kept[n]) for n, m in model.named_modules() if isinstance(m, Attention) and n in kept]


def test_timm_head_dim_export_keeps_fused_attn_and_matches_the_hardened_supernet(vit_search):
    # before: an export with a changed head dim set fused_attn = False (the slow explicit
    # path on GPU) to keep the supernet's softmax scale
    timm, _ = _timm_attention_cls()
    model, x, searcher, small = vit_search
    pairs = _attention_pairs(model, small)
    assert pairs and any(new.head_dim != old.head_dim for old, new in pairs)
    assert all(old.fused_attn == timm.layers.use_fused_attn() for old, _ in pairs)
    assert [new.fused_attn for _, new in pairs] == [old.fused_attn for old, _ in pairs]
    for _, new in pairs:
        assert new.scale == pytest.approx(new.head_dim ** -0.5)
        assert new.qkv.weight.shape[0] == 3 * new.num_heads * new.head_dim == 3 * new.attn_dim
    y = _hardened_output(model, x, searcher)
    with torch.no_grad():
        torch.testing.assert_close(small(x), y, atol=1e-5, rtol=1e-5)  # fused SDPA
        try:
            for _, new in pairs:
                new.fused_attn = False
            torch.testing.assert_close(small(x), y, atol=1e-5, rtol=1e-5)  # explicit path, m.scale
        finally:
            for old, new in pairs:
                new.fused_attn = old.fused_attn


def test_timm_scale_fold_does_not_depend_on_the_order_of_the_structure_layers(vit_search):
    """The attention's update scales the q rows of qkv once, before or after qkv is sliced."""
    model, x, searcher, small = vit_search
    structure = searcher.structure()
    names = list(structure["layers"])
    assert any(n.endswith(".attn") for n in names) and any(n.endswith(".attn.qkv") for n in names)
    # reversed: each attention is updated in the other order relative to its qkv slicing
    reordered = {**structure, "layers": {n: structure["layers"][n] for n in reversed(names)}}
    other = export_model(model, reordered).eval()
    with torch.no_grad():
        torch.testing.assert_close(other(x), small(x), atol=1e-6, rtol=1e-6)


def test_timm_scale_fold_of_an_explicit_supernet_uses_its_stored_scale():
    """A supernet on the explicit path (fused_attn False, custom m.scale) keeps it, exactly."""
    timm, Attention = _timm_attention_cls()
    torch.manual_seed(1)
    model = timm.create_model("deit_tiny_patch16_224", pretrained=False, img_size=32, num_classes=4,
                              depth=2).eval()
    for m in model.modules():
        if isinstance(m, Attention):
            m.fused_attn, m.scale = False, 0.05  # not head_dim ** -0.5
    x = torch.randn(2, 3, 32, 32)
    searcher = dms.prepare(model, x, dms.SearchConfig(resource="macs", target=0.5))
    searcher.randomize_importance(1)
    searcher.meet_target()
    small = searcher.export().eval()
    pairs = _attention_pairs(model, small)
    assert any(new.head_dim != old.head_dim for old, new in pairs)
    assert not any(new.fused_attn for _, new in pairs)
    with torch.no_grad():
        torch.testing.assert_close(small(x), _hardened_output(model, x, searcher), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_timm_scale_fold_scales_only_the_q_rows_in_the_weight_dtype(dtype):
    from dmscale.trace.handlers.attention import _update_timm

    _, Attention = _timm_attention_cls()
    torch.manual_seed(0)
    m = Attention(16, num_heads=2, qkv_bias=True).to(dtype)  # head_dim 8
    w, b = m.qkv.weight.detach().clone(), m.qkv.bias.detach().clone()
    fused = m.fused_attn
    _update_timm(m, 2, 2)  # head dim 8 -> 2: q rows x (8 ** -0.5) / (2 ** -0.5) = 0.5
    assert (m.head_dim, m.num_heads, m.attn_dim, m.fused_attn) == (2, 2, 4, fused)
    assert m.scale == pytest.approx(2 ** -0.5)
    assert m.qkv.weight.dtype == m.qkv.bias.dtype == dtype
    torch.testing.assert_close(m.qkv.weight[:16], (w[:16].double() * 0.5).to(dtype), atol=0, rtol=0)
    torch.testing.assert_close(m.qkv.bias[:16], (b[:16].double() * 0.5).to(dtype), atol=0, rtol=0)
    assert torch.equal(m.qkv.weight[16:], w[16:]) and torch.equal(m.qkv.bias[16:], b[16:])
