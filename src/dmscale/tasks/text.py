"""``--task text``: language modelling on your text with a pretrained model's tokenizer.

Data (``--data PATH``, read by :mod:`dmscale.data.text_sources`): plain UTF-8 text files (a
file, or every file under a directory), JSON Lines (``.jsonl``) or Parquet (``.parquet``)
files, or a directory written by a Hugging Face dataset's ``save_to_disk`` (its ``train``
split); without ``--data`` the bundled Shakespeare plays. Text files are read as one byte
stream (concatenated as they are; a file that is not UTF-8 is refused with its name and the
offending byte), and the last 10 % of its bytes (from the next line break on) is the
held-out split. Every record of the other formats is a document (its ``--text-field``,
default ``text``): each document is tokenised on its own, the tokenizer's EOS token goes
between two documents (none after the last), and the last 10 % of the documents (at least
one) are held out.

Framing: windows and documents start as ``tokenizer(text)`` starts a text
(:mod:`dmscale.tasks.text_windows`): with a tokenizer that puts a BOS token first (Gemma,
Llama), every training and evaluation window is ``[BOS] + stream[s : s + L - 1]`` and scores
``stream[s : s + L]``, and every document is tokenised as ``tokenizer(doc)`` frames it (BOS
first; an EOS last when the tokenizer adds one, otherwise the EOS separator goes between two
documents). A tokenizer that adds nothing (SmolLM2) gets the plain stream.

Token cache: the data is tokenised once per (data, tokenizer) with the model's own
tokenizer, chunk by chunk (text: line-aligned chunks of 1 MiB; documents: batches of about
1 MiB of text), and written as ``uint32`` token ids to ``train.bin`` / ``test.bin`` in a
cache directory (``$DMSCALE_CACHE``, default ``~/.cache/dmscale/tokens/<key>``) that later
runs memory-map: a corpus larger than memory works, and only the windows drawn are read. The
key hashes the files (path, size, mtime), for documents also the format, the text field,
the split, the EOS id and the tokenizer's framing, and the tokenizer's vocabulary and settings. Text chunks are
tokenised separately, so a token never spans a line break that ends a chunk (a negligible
difference from tokenising the whole text at once).

Training batches: ``--batch-size`` windows of ``--seq-len`` inputs at offsets drawn from
``(seed, step)`` (without a BOS: ``--seq-len + 1`` stream tokens, inputs and targets shifted
by one). Evaluation: the held-out stream in consecutive windows that score each token once
(without a BOS-adding tokenizer: the stream with the tokenizer's BOS token first, when it has
one, so that every text token is predicted); reports ``loss`` (mean NLL per scored token,
nats), ``ppl = exp(loss)``, next-token accuracy and ``bpb``, bits per UTF-8 byte: the total
NLL in bits over the bytes of the evaluated text, comparable across tokenizers (with
``--test-limit N`` tokens, the bytes of those tokens' decoded text). For documents the EOS
tokens between them are predicted too, and have no bytes; BOS tokens are never scored.

Example (a stand-in tokenizer, one token per UTF-8 byte, EOS 0):
    >>> import json, os, tempfile, pathlib
    >>> class Bytes:
    ...     eos_token_id = 0
    ...     def get_vocab(self): return {}
    ...     def __call__(self, texts, add_special_tokens=True):
    ...         one = isinstance(texts, str)
    ...         ids = [list(t.encode()) for t in ([texts] if one else texts)]
    ...         return {"input_ids": ids[0] if one else ids}
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (d / "docs.jsonl").write_text("".join(json.dumps({"text": w}) + "\\n" for w in ("ab", "cd", "ef")))
    >>> old, os.environ[CACHE_ENV] = os.environ.get(CACHE_ENV), str(d / "cache")
    >>> cache = token_cache(resolve_source(str(d / "docs.jsonl")), Bytes())
    >>> [np.fromfile(cache / f"{part}.bin", dtype=np.uint32).tolist() for part in ("train", "test")]
    [[97, 98, 0, 99, 100], [101, 102]]
    >>> _ = os.environ.pop(CACHE_ENV) if old is None else os.environ.update({CACHE_ENV: old})
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dmscale.config.run_config import ConfigError, RunConfig
from dmscale.data.text_files import (
    HELD_OUT,
    first_non_utf8,
    not_text_error,
    split_stream,
    split_text_chunks,
    text_files,
)
from dmscale.data.text_sources import TextSource, resolve_source, split_documents
from dmscale.tasks.hf_model import load_hf_tokenizer, parse_hf_spec
from dmscale.tasks.registry import Task
from dmscale.tasks.text_windows import IGNORE, eval_starts, scored, text_framing, window

__all__ = ["TextTask", "text_tokenizer", "text_files", "split_stream", "token_cache", "cache_is_complete", "first_non_utf8",
           "document_separator", "resolve_source", "TextSource", "HELD_OUT", "CACHE_ENV"]

CACHE_ENV = "DMSCALE_CACHE"
CACHE_VERSION = 2  # 2: documents framed as tokenizer(doc) frames them


def _tokenizer_key(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    desc = backend.to_str() if backend is not None else json.dumps(
        sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(f"{type(tokenizer).__name__}\n{desc}".encode()).hexdigest()


def _cache_root() -> Path:
    root = os.environ.get(CACHE_ENV)
    return Path(root) if root else Path.home() / ".cache" / "dmscale" / "tokens"


def _pieces(source: TextSource, tokenizer: Any, held_out: float,
            eos: int | None) -> Iterator[tuple[str, list[int], int, int]]:
    """``(part, token ids, text bytes, documents)`` in stream order: text files chunk by
    chunk (no special tokens: the windows get the tokenizer's BOS); documents batch by batch,
    each framed as ``tokenizer(doc)`` frames it, ``eos`` between two documents of one part
    (None: the tokenizer ends each document itself)."""
    if not source.documents:
        for part, chunk in split_text_chunks(list(source.files), held_out):
            try:
                text = chunk.decode("utf-8")
            except UnicodeDecodeError:
                raise not_text_error(list(source.files)) from None
            yield part, tokenizer(text, add_special_tokens=False)["input_ids"], len(chunk), 0
        return
    started = {"train": False, "test": False}
    for part, docs in split_documents(source, held_out):
        ids: list[int] = []
        for doc_ids in tokenizer(docs)["input_ids"]:
            if started[part] and eos is not None:
                ids.append(eos)
            ids.extend(doc_ids)
            started[part] = True
        yield part, ids, sum(len(d.encode("utf-8")) for d in docs), len(docs)


def document_separator(source: TextSource, tokenizer: Any) -> int | None:
    """The token put between two documents: the tokenizer's EOS (None for text files, and
    for a tokenizer that ends every text with a token of its own, ``tokenizer(doc)`` being
    the document's whole framing).

    Raises:
        ConfigError: documents, and the tokenizer has no EOS token.
    """
    if not source.documents or text_framing(tokenizer)[1]:
        return None
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise ConfigError(f"--data {source.data}: the documents of {source.format} data are joined with the "
                          "tokenizer's EOS token, and this tokenizer has none: set one (tokenizer.eos_token"
                          " = ..., then save_pretrained) or give the text as a plain text file")
    return int(eos)


def token_cache(source: TextSource | list[Path], tokenizer: Any, held_out: float = HELD_OUT) -> Path:
    """The cache directory of ``source`` (a :class:`TextSource`, or a list of text files)
    tokenised with ``tokenizer`` (written when missing): ``train.bin``, ``test.bin`` (uint32
    token ids) and ``meta.json`` (token, byte and document counts)."""
    if not isinstance(source, TextSource):
        source = TextSource("text", tuple(source))
    eos = document_separator(source, tokenizer)
    h = hashlib.sha256(f"v{CACHE_VERSION} {held_out}\n".encode())
    h.update(source.key().encode())  # text files: their paths, sizes and mtimes alone
    if eos is not None:
        h.update(f"eos {eos}\n".encode())
    if source.documents:
        h.update(f"framing {text_framing(tokenizer)}\n".encode())
    h.update(_tokenizer_key(tokenizer).encode())
    out = _cache_root() / h.hexdigest()[:24]
    if cache_is_complete(out):
        return out  # (a truncated or damaged cache is written again)
    out.mkdir(parents=True, exist_ok=True)
    counts = {"train": [0, 0, 0], "test": [0, 0, 0]}  # tokens, bytes, documents
    tmp = {k: out / f"{k}.bin.{os.getpid()}.tmp" for k in counts}  # concurrent runs: own files
    handles = {k: open(p, "wb") for k, p in tmp.items()}
    try:
        for part, ids, n_bytes, n_docs in _pieces(source, tokenizer, held_out, eos):
            handles[part].write(np.asarray(ids, dtype=np.uint32).tobytes())
            for i, n in enumerate((len(ids), n_bytes, n_docs)):
                counts[part][i] += n
    except BaseException:
        for fh in handles.values():
            fh.close()
        for p in tmp.values():
            p.unlink(missing_ok=True)
        raise
    for fh in handles.values():
        fh.close()
    for k, p in tmp.items():
        os.replace(p, out / f"{k}.bin")
    meta = {"files": [str(f) for f in source.files], "held_out": held_out, "format": source.format,
            **{f"{k}_tokens": v[0] for k, v in counts.items()},
            **{f"{k}_bytes": v[1] for k, v in counts.items()}}
    if source.documents:
        meta.update(text_field=source.text_field, split=source.split, eos=eos,
                    framing=[list(f) for f in text_framing(tokenizer)],
                    **{f"{k}_documents": v[2] for k, v in counts.items()})
    meta_tmp = out / f"meta.json.{os.getpid()}.tmp"
    meta_tmp.write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    os.replace(meta_tmp, out / "meta.json")  # written last: its presence marks a complete cache
    return out


def cache_is_complete(out: Path) -> bool:
    """Whether ``out`` holds a readable ``meta.json`` and token files of the sizes it states."""
    try:
        meta = json.loads((out / "meta.json").read_text(encoding="utf-8"))
        return all((out / f"{k}.bin").stat().st_size == 4 * int(meta[f"{k}_tokens"]) for k in ("train", "test"))
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _memmap(path: Path, count: int) -> np.ndarray:
    if count == 0:
        return np.zeros(0, dtype=np.uint32)
    return np.memmap(path, dtype=np.uint32, mode="r", shape=(count,))


def text_tokenizer(cfg: RunConfig) -> tuple[str, Any]:
    """``(path, tokenizer)`` of the ``hf:PATH`` model whose tokenizer ``--task text`` uses.

    Raises:
        ConfigError: the model is not ``hf:PATH``, or its tokenizer cannot be loaded.
    """
    path = parse_hf_spec(cfg.model)
    if path is None:
        raise ConfigError(f"--task text tokenises with a pretrained model's tokenizer: use "
                          f"--model hf:PATH (got --model {cfg.model}); the toy char-level "
                          "models go with --task shakespeare")
    return path, load_hf_tokenizer(path)


class TextTask(Task):
    """Next-token prediction on plain text with the tokenizer of ``--model hf:PATH``."""

    name = "text"
    kind = "language"
    metric = "bpb"
    higher_is_better = False

    def __init__(self, cfg: RunConfig) -> None:
        path, self.tokenizer = text_tokenizer(cfg)
        self.data = cfg.data
        self.source = resolve_source(cfg.data, cfg.text_field)
        self.files = list(self.source.files)
        self.seq_len = int(cfg.seq_len)
        self.cache = token_cache(self.source, self.tokenizer)
        meta = json.loads((self.cache / "meta.json").read_text(encoding="utf-8"))
        self.meta = meta
        self.separator = meta.get("eos")  # between documents; None for text files
        self.head, tail = text_framing(self.tokenizer)  # head: the BOS a text starts with, if any
        self.special = {int(t) for t in (*self.head, *tail, *([self.separator] if self.separator is not None else []))}
        train = _memmap(self.cache / "train.bin", meta["train_tokens"])
        test = _memmap(self.cache / "test.bin", meta["test_tokens"])
        for what, limit, part in (("train", cfg.train_limit, train), ("test", cfg.test_limit, test)):
            if len(part) < self.seq_len + 1:
                raise ConfigError(f"--data {cfg.data or '(Shakespeare)'}: the {what} split has "
                                  f"{len(part):,} tokens, fewer than one window (--seq-len "
                                  f"{self.seq_len} + 1): give more text or a shorter --seq-len")
            if limit is not None and limit > len(part):
                raise ConfigError(f"--{what}-limit {limit} exceeds the {len(part):,} {what} tokens")
            if limit is not None and limit < self.seq_len + 1:
                raise ConfigError(f"--{what}-limit {limit} is shorter than one window "
                                  f"(--seq-len {self.seq_len} + 1 tokens)")
        self.train_ids = train[:cfg.train_limit] if cfg.train_limit else train
        self.test_ids = test[:cfg.test_limit] if cfg.test_limit else test
        self.test_bytes = (meta["test_bytes"] if cfg.test_limit is None
                           else self._bytes_of(self.test_ids))
        self.bos = self.tokenizer.bos_token_id
        self.info = {"kind": "language", "seq_len": self.seq_len,
                     "vocab_size": len(self.tokenizer), "tokenizer": path}

    def _bytes_of(self, ids: np.ndarray) -> int:
        ids = np.asarray(ids)
        if self.special:  # the text's bytes: the separators and the framing's BOS have none
            ids = ids[~np.isin(ids, np.fromiter(self.special, dtype=np.int64))]
        text = self.tokenizer.decode(ids.tolist(), clean_up_tokenization_spaces=False)
        return len(text.encode("utf-8"))

    def example_inputs(self) -> torch.Tensor:
        """The first evaluation window's inputs (``[BOS] + ...`` for a BOS-adding tokenizer)."""
        if not self.head:
            return torch.from_numpy(np.asarray(self.test_ids[:self.seq_len], dtype=np.int64)).unsqueeze(0)
        x, _ = window(self.test_ids, eval_starts(self.test_ids, self.seq_len, self.head)[0], self.seq_len, self.head)
        return torch.from_numpy(x).unsqueeze(0)

    def steps_per_epoch(self, batch_size: int) -> int:
        return max(1, len(self.train_ids) // (batch_size * self.seq_len))

    def train_batch(self, step: int, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed((seed * 1_000_003 + step * 7_919 + 17) % (2**63 - 1))
        high = len(self.train_ids) - scored(self.seq_len, self.head) - (0 if self.head else 1)
        starts = torch.randint(0, high + 1, (batch_size,), generator=g).tolist()
        pairs = [window(self.train_ids, s, self.seq_len, self.head) for s in starts]
        return (torch.from_numpy(np.stack([x for x, _ in pairs])),
                torch.from_numpy(np.stack([y for _, y in pairs])))

    def batch_metric(self, logits: torch.Tensor, targets: torch.Tensor) -> float:
        """Next-token accuracy over the scored targets (a BOS target is not one)."""
        keep = targets != IGNORE
        return float(((logits.argmax(-1) == targets) & keep).sum() / keep.sum().clamp(min=1))

    def _eval_windows(self, ids: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``(inputs, targets)`` of the consecutive windows that score ``ids`` once each."""
        L = self.seq_len
        if self.head:
            starts = eval_starts(ids, L, self.head)
            step = scored(L, self.head)
            for s in starts:
                yield window(ids, s, L, self.head, stop=min(len(ids), s + step))
            return
        head = [self.bos] if self.bos is not None else []  # the stream with a BOS first
        n = len(head) + len(ids)  # positions of the evaluated stream
        for s in range(0, n - 1, L):  # window j predicts stream[s+1 : s+L+1]
            w = self._stream(ids, head, s, min(n, s + L + 1))
            yield w[:-1], w[1:]

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batch_size: int = 256, device: torch.device | str = "cpu",
                 limit: int | None = None) -> dict[str, float]:
        ids = self.test_ids if limit is None else self.test_ids[:limit]
        n_bytes = self.test_bytes if limit is None else self._bytes_of(ids)
        L = self.seq_len
        windows = self._eval_windows(ids)  # drawn group by group: a large split never sits in memory
        # windows per forward: at most ~2^25 logits (128 MB in float32; a 49k vocabulary at
        # 64 tokens gives 10 windows), so evaluation never dominates the peak memory
        batch_size = max(1, min(batch_size, (1 << 25) // (L * max(1, self.info["vocab_size"]))))
        was = model.training
        model.eval()
        total, correct, count = 0.0, 0, 0
        try:
            while group := list(itertools.islice(windows, batch_size)):
                by_len: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
                for x, y in group:
                    by_len.setdefault(len(x), []).append((x, y))
                for rows in by_len.values():
                    x = torch.from_numpy(np.stack([r[0] for r in rows])).to(device)
                    y = torch.from_numpy(np.stack([r[1] for r in rows])).to(device)
                    logits = self.forward(model, x).float()
                    total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                   y.reshape(-1), reduction="sum", ignore_index=IGNORE))
                    keep = y != IGNORE
                    correct += int(((logits.argmax(-1) == y) & keep).sum())
                    count += int(keep.sum())
        finally:
            model.train(was)
        loss = total / max(1, count)
        return {"loss": loss, "ppl": math.exp(min(loss, 50.0)),
                "bpb": total / math.log(2) / max(1, n_bytes), "acc": correct / max(1, count),
                "examples": count, "bytes": n_bytes}

    @staticmethod
    def _stream(ids: np.ndarray, head: list[int], start: int, stop: int) -> np.ndarray:
        """``(head + ids)[start:stop]`` as int64 without copying the whole stream."""
        h = len(head)
        parts = []
        if start < h:
            parts.append(np.asarray(head[start:min(stop, h)], dtype=np.int64))
        lo, hi = max(0, start - h), max(0, stop - h)
        if hi > lo:
            parts.append(np.asarray(ids[lo:hi], dtype=np.int64))
        return np.concatenate(parts)

    def describe(self) -> str:
        src = self.source.describe()
        if self.source.documents:
            src += (f"; {self.meta['train_documents'] + self.meta['test_documents']:,} documents "
                    f"({self.meta['test_documents']:,} held out) joined by EOS")
        return (f"text ({src}): {len(self.train_ids):,} training / {len(self.test_ids):,} test "
                f"tokens ({self.test_bytes:,} test bytes), vocabulary of {self.info['vocab_size']:,}, "
                f"sequences of {self.seq_len}")

    def format_metrics(self, metrics: dict[str, float]) -> str:
        return (f"perplexity {metrics['ppl']:.2f}, {metrics['bpb']:.3f} bits/byte, "
                f"next-token accuracy {100 * metrics['acc']:.1f}%")
