"""The real Llama 3 and Qwen2 tokenizers in a GGUF export from an ``hf:`` directory (slow).

The tokenizers are rebuilt from llama.cpp's own vocabulary files (``models/ggml-vocab-*.gguf``,
made by its converter from the models' Hugging Face tokenizers) with the pre-tokenizer each
model's ``tokenizer.json`` publishes, and first checked against the ids those Hugging Face
tokenizers gave for llama.cpp's 47 test strings (``.out``). A tiny model of the family saved with
that tokenizer is searched by ``dmscale search --model hf:DIR --export gguf``; llama.cpp's
``llama-tokenize`` on the run's ``model.gguf`` must give the same ids as the reference for
every string, and the same leading BOS as ``tokenizer(text)`` (Llama 3 adds one, Qwen2 none).
The check of the check: the same export with a wrong pre-tokenizer name differs.
"""

from __future__ import annotations


import pytest
import torch

import dmscale as dms
from dmscale.export import gguf_vocab
from dmscale.export.gguf import save_gguf
from llamacpp import LLAMA3_RE, QWEN2_RE, llamacpp_bin, llamacpp_tokens, llamacpp_vocab, real_tokenizer

pytestmark = pytest.mark.slow

# vocabulary file -> (family, split regex, leading BOS, ignore_merges), as the models publish them
FAMILIES = {"llama-bpe": ("llama", LLAMA3_RE, True, True), "qwen2": ("qwen2", QWEN2_RE, False, False)}
LINE = "To be, or not to be: that is the question 1234567."


def _tokenize(binary: str, path, text: str, tmp_path, bos: bool) -> list[int]:
    """llama.cpp's ids for ``text`` (``binary``: llama-tokenize, as :func:`llamacpp_tokens` finds it)."""
    return llamacpp_tokens(path, text, tmp_path, bos=bos)


def _mismatches(binary: str, path, texts, want, tmp_path) -> list[int]:
    return [i for i, (text, ids) in enumerate(zip(texts, want))
            if _tokenize(binary, path, text, tmp_path, bos=False) != ids]


def _tiny(family: str, vocab: int):
    import transformers

    name = {"llama": "Llama", "qwen2": "Qwen2"}[family]
    torch.manual_seed(0)
    config = getattr(transformers, f"{name}Config")(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)
    return getattr(transformers, f"{name}ForCausalLM")(config).eval()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_real_tokenizer_of_an_hf_search_tokenizes_in_llamacpp_as_in_transformers(name, tmp_path, monkeypatch):
    from dmscale.cli import main

    binary = llamacpp_bin("llama-tokenize")
    path, texts, want = llamacpp_vocab(name)
    assert len(texts) == len(want) > 40
    family, regex, bos, ignore_merges = FAMILIES[name]
    dms.ensure_torchvision()
    tok = real_tokenizer(path, regex, bos, ignore_merges)
    # the rebuilt tokenizer is the model's own: the Hugging Face ids of every test string
    assert [tok.encode(t, add_special_tokens=False) for t in texts] == want

    model_dir, run = tmp_path / "model", tmp_path / "run"
    _tiny(family, len(tok)).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    rc = main(["search", "--model", f"hf:{model_dir}", "--task", "text", "--pipeline", "p-", "--epochs", "0.01",
               "--resource", "params", "--target", "0.9", "--seq-len", "16", "--batch-size", "2",
               "--train-limit", "2000", "--test-limit", "200", "--threads", "1", "--export", "gguf",
               "--out", str(run)])
    assert rc == 0 and (run / "model.gguf").is_file()
    assert _mismatches(binary, run / "model.gguf", texts, want, tmp_path) == []
    # BOS as the tokenizer adds it: Llama 3's <|begin_of_text|> first, Qwen2 none
    ids = _tokenize(binary, run / "model.gguf", LINE, tmp_path, bos=True)
    assert ids == tok(LINE)["input_ids"] and (ids[0] == tok.bos_token_id) == bos

    # the check of the check: a wrong pre-tokenizer name splits some strings differently
    monkeypatch.setattr(gguf_vocab, "PRE_TOKENIZERS", dict.fromkeys(gguf_vocab.PRE_TOKENIZERS, "gpt-2"))
    wrong = save_gguf(_tiny(family, len(tok)), tmp_path / "wrong.gguf", tokenizer=tok, gguf_type="f32")
    assert len(_mismatches(binary, wrong, texts, want, tmp_path)) >= 3
