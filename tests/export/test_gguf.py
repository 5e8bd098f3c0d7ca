"""GGUF export (dmscale.export.gguf): what the file says, read back by another reader.

Uniform Llama and Qwen2 exports load back with transformers' own GGUF reader (it undoes
llama.cpp's q/k permutation) to the same logits; per-layer exports write llama.cpp's ``deci``
with one size per layer (removed attention / FFN included); the tokenizer is embedded as
llama.cpp's converter does; configurations llama.cpp cannot run are refused, from Python and
before the first step of an ``hf:`` search with ``--export gguf``. The runs in llama.cpp
itself are in ``test_gguf_llamacpp.py`` (slow).
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import dmscale as dms
from dmscale.core.errors import UnsupportedLayerError
from dmscale.export.gguf import _permute, check_gguf, gguf_layer_sizes, save_gguf
from dmscale.export.gguf_vocab import pre_tokenizer_name

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.filterwarnings("ignore:save_gguf without a tokenizer", "ignore:Initializing zero-element")
dms.ensure_torchvision()
transformers = pytest.importorskip("transformers")


def tiny(family: str = "llama", layers: int = 3, tie: bool = False, vocab: int = 64) -> nn.Module:
    names = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral", "gemma3": "Gemma3Text"}
    torch.manual_seed(0)
    config = getattr(transformers, f"{names[family]}Config")(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=tie)
    cls = "Gemma3ForCausalLM" if family == "gemma3" else f"{names[family]}ForCausalLM"
    return getattr(transformers, cls)(config).eval()


def per_layer(lm: nn.Module) -> nn.Module:
    """``lm`` with its layers cut to different widths by hand (heads and FFN units)."""
    for i, layer in enumerate(lm.model.layers):
        keep_kv = 1 if i % 2 else 2  # kv heads 2 / 1, query heads 4 / 2
        attn, mlp = layer.self_attn, layer.mlp
        for name, rows in (("q_proj", keep_kv * 2 * 16), ("k_proj", keep_kv * 16), ("v_proj", keep_kv * 16)):
            _cut_rows(attn, name, rows)
        _cut_cols(attn, "o_proj", keep_kv * 2 * 16)
        ffn = 96 - 16 * (i + 1)
        _cut_rows(mlp, "gate_proj", ffn)
        _cut_rows(mlp, "up_proj", ffn)
        _cut_cols(mlp, "down_proj", ffn)
        attn.num_key_value_groups = 2
    return lm


def _cut_rows(module: nn.Module, name: str, rows: int) -> None:
    old = getattr(module, name)
    new = nn.Linear(old.in_features, rows, bias=old.bias is not None)
    new.weight.data = old.weight.data[:rows].clone()
    if old.bias is not None:
        new.bias.data = old.bias.data[:rows].clone()
    setattr(module, name, new)


def _cut_cols(module: nn.Module, name: str, cols: int) -> None:
    old = getattr(module, name)
    new = nn.Linear(cols, old.out_features, bias=old.bias is not None)
    new.weight.data = old.weight.data[:, :cols].clone()
    setattr(module, name, new)


def fields(path) -> dict:
    reader = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}, \
        {t.name: t for t in reader.tensors}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_uniform_export_loads_back_in_transformers_to_the_same_logits(family, tmp_path):
    lm = tiny(family)
    path = save_gguf(lm, tmp_path / "m.gguf", gguf_type="f32")
    kv, tensors = fields(path)
    assert kv["general.architecture"] == family and kv[f"{family}.block_count"] == 3
    assert kv[f"{family}.attention.head_count"] == 4 and kv[f"{family}.feed_forward_length"] == 96
    assert "output.weight" in tensors and not any(p.name.startswith(".m.gguf") for p in tmp_path.iterdir())
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32)
    ids = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(back.eval()(ids).logits, lm(ids).logits, atol=1e-5, rtol=1e-5)


def test_types_tied_embeddings_and_q8_fallback(tmp_path):
    lm = tiny("llama", tie=True)
    for kind, want in (("f16", "F16"), ("bf16", "BF16"), ("q8_0", "Q8_0"), ("f32", "F32")):
        kv, tensors = fields(save_gguf(lm, tmp_path / f"{kind}.gguf", gguf_type=kind))
        assert tensors["blk.0.attn_q.weight"].tensor_type.name == want
        assert tensors["blk.0.attn_norm.weight"].tensor_type.name == "F32"  # norms stay f32
        assert "output.weight" not in tensors  # tied lm_head: llama.cpp reuses token_embd
    # q8_0 needs rows of whole 32-blocks: the FFN's down projection of 96 -> 80 columns falls back
    lm2 = per_layer(tiny("llama"))
    _, tensors = fields(save_gguf(lm2, tmp_path / "q8.gguf", gguf_type="q8_0"))
    assert tensors["blk.0.ffn_down.weight"].tensor_type.name == "F16"  # 80 columns: not a multiple of 32
    assert tensors["blk.1.ffn_down.weight"].tensor_type.name == "Q8_0"  # 64 columns
    with pytest.raises(UnsupportedLayerError, match="gguf_type"):
        save_gguf(lm, tmp_path / "x.gguf", gguf_type="q4_0")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_per_layer_export_writes_deci_with_one_size_per_layer(family, tmp_path):
    lm = per_layer(tiny(family))
    assert gguf_layer_sizes(lm)[1] == [[4, 2, 80], [2, 1, 64], [4, 2, 48]]
    kv, tensors = fields(save_gguf(lm, tmp_path / "m.gguf", gguf_type="f32"))
    assert kv["general.architecture"] == "deci"
    assert kv["deci.attention.head_count"] == [4, 2, 4] and kv["deci.attention.head_count_kv"] == [2, 1, 2]
    assert kv["deci.feed_forward_length"] == [80, 64, 48] and kv["deci.attention.key_length"] == 16
    assert kv["deci.rope.dimension_count"] == 16
    q = lm.model.layers[1].self_attn.q_proj.weight.detach()
    # llama.cpp's deci rotates pairs: the converter's permutation of q (2 heads here), and Qwen2's biases
    got = torch.from_numpy(tensors["blk.1.attn_q.weight"].data.copy()).reshape(q.shape)
    assert torch.equal(got, _permute(q, 2)) and not torch.equal(got, q)
    assert ("blk.1.attn_q.bias" in tensors) == (family == "qwen2")
    assert list(tensors["blk.1.ffn_gate.weight"].shape) == [64, 64]


def test_layers_without_attention_or_ffn(tmp_path):
    lm = tiny("llama", layers=3)
    attn, mlp = lm.model.layers[1].self_attn, lm.model.layers[2].mlp
    for name in ("q_proj", "k_proj", "v_proj"):
        _cut_rows(attn, name, 0)
    _cut_cols(attn, "o_proj", 0)
    for name in ("gate_proj", "up_proj"):
        _cut_rows(mlp, name, 0)
    _cut_cols(mlp, "down_proj", 0)
    assert gguf_layer_sizes(lm)[1] == [[4, 2, 96], [0, 0, 96], [4, 2, 0]]
    kv, tensors = fields(save_gguf(lm, tmp_path / "m.gguf", gguf_type="f32"))
    assert kv["general.architecture"] == "deci" and kv["deci.attention.head_count"] == [4, 0, 4]
    assert not any(n.startswith("blk.1.attn") for n in tensors)  # no attention at all in layer 1
    # deci skips a layer with n_ff = 0 entirely (its attention too): one FFN unit of zeros instead
    assert kv["deci.feed_forward_length"] == [96, 96, 1]
    assert not tensors["blk.2.ffn_down.weight"].data.any() and "blk.2.ffn_norm.weight" in tensors
    first = tiny("llama", layers=2)
    for name in ("q_proj", "k_proj", "v_proj"):
        _cut_rows(first.model.layers[0].self_attn, name, 0)
    _cut_cols(first.model.layers[0].self_attn, "o_proj", 0)
    with pytest.raises(UnsupportedLayerError, match="first layer"):
        save_gguf(first, tmp_path / "first.gguf")


def test_refusals_name_the_fix():
    for family in ("qwen3", "gemma3"):
        lm = tiny(family)
        lm.config.query_pre_attn_scalar = lm.config.head_dim  # Gemma 3's own choice (llama.cpp's scale)
        check_gguf(lm, layer_uniform=True)  # equal layers: its own architecture
        with pytest.raises(UnsupportedLayerError, match="--layer-uniform"):
            check_gguf(lm, layer_uniform=False)
    gemma = tiny("gemma3")  # query_pre_attn_scalar 256, head_dim 16: a scale llama.cpp would not compute
    with pytest.raises(UnsupportedLayerError, match="query_pre_attn_scalar"):
        check_gguf(gemma, layer_uniform=True)
    with pytest.raises(UnsupportedLayerError, match="llama3|rotary scaling"):
        lm = tiny("qwen2")
        lm.config.rope_parameters = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}
        check_gguf(lm, layer_uniform=True)


def test_tokenizer_bpe_and_copied_from_a_gguf(tmp_path):
    from tiny_hf import tiny_tokenizer
    from dmscale.data.shakespeare import shakespeare_text

    tok = tiny_tokenizer(shakespeare_text(max_chars=20_000))
    lm = tiny("llama", vocab=len(tok))
    path = save_gguf(lm, tmp_path / "a.gguf", tokenizer=tok, gguf_type="f32")
    kv, _ = fields(path)
    assert kv["tokenizer.ggml.model"] == "gpt2" and kv["tokenizer.ggml.pre"] == "gpt-2"
    assert kv["tokenizer.ggml.tokens"][:1] == ["<s>"] and kv["tokenizer.ggml.token_type"][0] == 3
    assert len(kv["tokenizer.ggml.merges"]) > 0 and kv["tokenizer.ggml.bos_token_id"] == 0
    # the most exact route: a source GGUF's tokenizer.* copied verbatim
    kv2, _ = fields(save_gguf(lm, tmp_path / "b.gguf", tokenizer=path, gguf_type="f32"))
    assert {k: v for k, v in kv2.items() if k.startswith("tokenizer.")} == \
        {k: v for k, v in kv.items() if k.startswith("tokenizer.")}
    with pytest.raises(UnsupportedLayerError, match="not this model's tokenizer"):
        save_gguf(tiny("llama", vocab=len(tok) + 1), tmp_path / "c.gguf", tokenizer=path)
    assert not (tmp_path / "c.gguf").exists()  # nothing half-written


def test_pre_tokenizer_names():
    split = lambda rx: {"type": "Split", "pattern": {"Regex": rx}, "behavior": "Isolated"}  # noqa: E731
    byte = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}
    llama3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
    assert pre_tokenizer_name({"type": "Sequence", "pretokenizers": [split(llama3), byte]}) == "llama-bpe"
    qwen2 = llama3.replace(r"\p{N}{1,3}", r"\p{N}")
    assert pre_tokenizer_name({"type": "Sequence", "pretokenizers": [split(qwen2), byte]}) == "qwen2"
    smol = {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True},
                                                  {**byte, "use_regex": True}]}
    assert pre_tokenizer_name(smol) == "smollm"
    assert pre_tokenizer_name({"type": "Metaspace"}) is None


def test_hf_search_asking_for_gguf_is_refused_before_its_first_step(tmp_path, capsys):
    """A per-layer Qwen3 search with --export gguf: refused before any step, naming --layer-uniform."""
    from dmscale.cli import main
    from tiny_hf import tiny_tokenizer
    from dmscale.data.shakespeare import shakespeare_text

    tok = tiny_tokenizer(shakespeare_text(max_chars=20_000))
    model_dir = tmp_path / "qwen3"
    tiny("qwen3", vocab=len(tok)).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    run = tmp_path / "run"
    args = ["search", "--model", f"hf:{model_dir}", "--task", "text", "--pipeline", "p-", "--epochs", "0.01",
            "--resource", "params", "--target", "0.8", "--seq-len", "16", "--batch-size", "2",
            "--train-limit", "2000", "--test-limit", "200", "--threads", "1", "--export", "gguf", "--out", str(run)]
    rc = main(args)
    err = capsys.readouterr().err
    assert rc == 2 and "--layer-uniform" in err and "model.gguf" in err, err
    assert not (run / "checkpoint.pt").exists() and not (run / "metrics.jsonl").exists()
    state = json.loads((run / "state.json").read_text()) if (run / "state.json").exists() else {}
    assert state.get("step", 0) == 0
    assert main(["search", "--model", "llama", "--task", "shakespeare", "--export", "gguf"]) == 2
    assert "--export gguf" in capsys.readouterr().err


def test_hf_search_writes_model_gguf_and_export_rewrites_it(tmp_path, capsys):
    """--export gguf on a tiny hf: Llama search writes RUN/model.gguf; `dmscale export --format
    gguf --gguf-type q8_0` writes another from the run, with the directory's BPE tokenizer."""
    from dmscale.cli import main
    from tiny_hf import make_tiny_hf

    model_dir, data = make_tiny_hf(tmp_path / "tiny", 20_000)
    run = tmp_path / "run"
    rc = main(["search", "--model", f"hf:{model_dir}", "--task", "text", "--data", str(data),
               "--pipeline", "p-", "--epochs", "0.02", "--resource", "params", "--target", "0.8",
               "--seq-len", "16", "--batch-size", "4", "--test-limit", "64", "--threads", "1",
               "--export", "gguf", "--out", str(run)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert (run / "model.gguf").is_file() and (run / "hf" / "config.json").is_file(), out
    kv, _ = fields(run / "model.gguf")
    assert kv["general.architecture"] in ("deci", "llama") and kv["tokenizer.ggml.pre"] == "gpt-2"
    assert kv["general.file_type"] == 1  # f16
    assert main(["export", str(run), "--format", "gguf", "--gguf-type", "q8_0", "--out", str(tmp_path / "q.gguf")]) == 0
    kv2, _ = fields(tmp_path / "q.gguf")
    assert kv2["general.file_type"] == 7 and kv2["tokenizer.ggml.tokens"] == kv["tokenizer.ggml.tokens"]


def test_sublayer_search_keeps_the_first_attention_for_gguf(tmp_path):
    """A sublayer search that drops the least important branches removes layer 0's attention
    (its GGUF refused, naming keep_depth); with ``keep_depth=gguf_keep_depth(model)`` the
    same search keeps it and the export saves."""
    from dmscale.export.gguf import gguf_keep_depth

    x = {"input_ids": torch.randint(0, 64, (2, 7))}
    exports = []
    for keep in ([], gguf_keep_depth(tiny("llama"))):
        lm = tiny("llama")
        searcher = dms.prepare(lm, x, dms.SearchConfig("params", 1.0, depth_unit="sublayer", keep_depth=keep))
        (gate,) = searcher.gates.depth
        with torch.no_grad():  # the attention branches least important: two of three go
            gate.importance.copy_(torch.tensor([float(i) + 10 * b.name.endswith("mlp")
                                                for i, b in enumerate(searcher.space.depth[0].blocks)]))
            gate.set_count(gate.n_units - 2)
        exports.append(searcher.export().eval())
    assert gguf_keep_depth(tiny("llama")) == ["model.layers.0.self_attn"]
    assert gguf_layer_sizes(exports[0])[1] == [[0, 0, 96], [0, 0, 96], [4, 2, 96]]
    with pytest.raises(UnsupportedLayerError, match="keep_depth"):
        save_gguf(exports[0], tmp_path / "a.gguf")
    with pytest.raises(UnsupportedLayerError, match="keep_depth"):
        check_gguf(exports[0], layer_uniform=False)  # as a retrain of that structure checks it
    assert not (tmp_path / "a.gguf").exists()
    assert gguf_layer_sizes(exports[1])[1] == [[4, 2, 96], [0, 0, 96], [0, 0, 96]]  # 1 and 2 went
    kv, _ = fields(save_gguf(exports[1], tmp_path / "b.gguf", gguf_type="f32"))
    assert kv["deci.attention.head_count"] == [4, 0, 0]


def test_hf_sublayer_search_with_gguf_pins_the_first_attention(tmp_path, capsys):
    """--depth-unit sublayer --export gguf: layer 0's attention is no depth unit of the search
    (structure.json), so the found model always writes RUN/model.gguf."""
    from dmscale.cli import main
    from tiny_hf import make_tiny_hf

    model_dir, data = make_tiny_hf(tmp_path / "tiny", 20_000)
    run = tmp_path / "run"
    rc = main(["search", "--model", f"hf:{model_dir}", "--task", "text", "--data", str(data),
               "--pipeline", "p-", "--epochs", "0.02", "--resource", "params", "--target", "0.8",
               "--seq-len", "16", "--batch-size", "4", "--test-limit", "64", "--threads", "1",
               "--depth-unit", "sublayer", "--export", "gguf", "--gguf-type", "f32", "--out", str(run)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    (stage,) = json.loads((run / "structure.json").read_text())["depth"]
    assert stage["blocks"] == ["lm.model.layers.0.mlp", "lm.model.layers.1.self_attn", "lm.model.layers.1.mlp"]
    kv, _ = fields(run / "model.gguf")
    assert kv["general.architecture"] in ("deci", "llama")
    heads = kv.get("deci.attention.head_count", kv.get("llama.attention.head_count"))
    assert (heads[0] if isinstance(heads, list) else heads) > 0


def test_ffn_free_layer_of_a_sublayer_search_writes_ffn_norm(tmp_path):
    """A removed FFN branch takes its norm with it (a ZeroBranch), but llama.cpp's deci loads
    ``ffn_norm`` for the one-unit zero FFN of a layer with attention: it is written as ones."""
    from exact import drop_units

    lm = tiny("llama")
    x = {"input_ids": torch.randint(0, 64, (2, 7))}
    searcher = dms.prepare(lm, x, dms.SearchConfig("params", 1.0, depth_unit="sublayer"))
    drop_units(searcher, [3, 4])  # layer 1's FFN, layer 2's attention
    small = searcher.export().eval()
    assert type(small.model.layers[1].post_attention_layernorm).__name__ == "ZeroBranch"
    kv, tensors = fields(save_gguf(small, tmp_path / "m.gguf", gguf_type="f32"))
    assert kv["deci.feed_forward_length"] == [96, 1, 96] and kv["deci.attention.head_count"] == [4, 4, 0]
    assert (tensors["blk.1.ffn_norm.weight"].data == 1).all()
    assert not tensors["blk.1.ffn_down.weight"].data.any()
    assert "blk.2.attn_norm.weight" not in tensors and "blk.2.ffn_norm.weight" in tensors
