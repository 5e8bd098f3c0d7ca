"""``--task text``: language modelling on plain text files with a pretrained model's tokenizer.

Data (``--data FILE_OR_DIR``): one text file, or every file under a directory (recursively,
sorted by path, hidden files skipped); without ``--data`` the bundled Shakespeare plays. The
files are read as one stream of UTF-8 text (a file that is not UTF-8, e.g. compressed or in
another encoding, is refused with its name and the offending byte); the last 10 % of its
bytes (from the next line break on) is the held-out split, the rest trains.

Token cache: the stream is tokenised once per (data, tokenizer) with the model's own
tokenizer, line-aligned chunk by chunk, and written as ``uint32`` token ids to
``train.bin`` / ``test.bin`` in a cache directory (``$DMSCALE_CACHE``, default
``~/.cache/dmscale/tokens/<key>``) that later runs memory-map: a corpus larger than memory
works, and only the windows drawn are read. The key hashes the files (path, size, mtime) and
the tokenizer's vocabulary and settings. Chunks are tokenised separately, so a token never
spans a line break that ends a chunk (a negligible difference from tokenising the whole text
at once).

Training batches: ``--batch-size`` windows of ``--seq-len + 1`` tokens at offsets drawn from
``(seed, step)``. Evaluation: the held-out stream (a BOS token first, when the tokenizer has
one, so that every text token is predicted) in consecutive windows; reports ``loss`` (mean
NLL per token, nats), ``ppl = exp(loss)``, next-token accuracy and ``bpb``, bits per UTF-8
byte: the total NLL in bits over the bytes of the evaluated text, comparable across
tokenizers (with ``--test-limit N`` tokens, the bytes of those tokens' decoded text).

Example:
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (d / "a.txt").write_text("one line\\n" * 10 + "the end\\n")
    >>> [p.name for p in text_files(str(d))]
    ['a.txt']
    >>> train, test = split_stream(text_files(str(d)))
    >>> len(b"".join(train)) + len(b"".join(test)) == (d / "a.txt").stat().st_size
    True
"""

from __future__ import annotations

import hashlib
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
from dmscale.tasks.hf_model import load_hf_tokenizer, parse_hf_spec
from dmscale.tasks.registry import Task, register_task

__all__ = ["TextTask", "text_files", "split_stream", "token_cache", "cache_is_complete", "first_non_utf8",
           "HELD_OUT", "CACHE_ENV"]

CACHE_ENV = "DMSCALE_CACHE"
CACHE_VERSION = 1


def _tokenizer_key(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    desc = backend.to_str() if backend is not None else json.dumps(
        sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(f"{type(tokenizer).__name__}\n{desc}".encode()).hexdigest()


def _cache_root() -> Path:
    root = os.environ.get(CACHE_ENV)
    return Path(root) if root else Path.home() / ".cache" / "dmscale" / "tokens"


def token_cache(files: list[Path], tokenizer: Any, held_out: float = HELD_OUT) -> Path:
    """The cache directory of ``files`` tokenised with ``tokenizer`` (written when missing):
    ``train.bin``, ``test.bin`` (uint32 token ids) and ``meta.json`` (token and byte counts)."""
    h = hashlib.sha256(f"v{CACHE_VERSION} {held_out}\n".encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}\t{st.st_size}\t{st.st_mtime_ns}\n".encode())
    h.update(_tokenizer_key(tokenizer).encode())
    out = _cache_root() / h.hexdigest()[:24]
    if cache_is_complete(out):
        return out  # (a truncated or damaged cache is written again)
    out.mkdir(parents=True, exist_ok=True)
    counts = {"train": [0, 0], "test": [0, 0]}  # tokens, bytes
    tmp = {k: out / f"{k}.bin.{os.getpid()}.tmp" for k in counts}  # concurrent runs: own files
    handles = {k: open(p, "wb") for k, p in tmp.items()}
    try:
        for part, chunk in split_text_chunks(files, held_out):
            try:
                text = chunk.decode("utf-8")
            except UnicodeDecodeError:
                raise not_text_error(files) from None
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            handles[part].write(np.asarray(ids, dtype=np.uint32).tobytes())
            counts[part][0] += len(ids)
            counts[part][1] += len(chunk)
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
    meta = {"files": [str(f) for f in files], "held_out": held_out,
            **{f"{k}_tokens": v[0] for k, v in counts.items()},
            **{f"{k}_bytes": v[1] for k, v in counts.items()}}
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


@register_task("text")
class TextTask(Task):
    """Next-token prediction on plain text with the tokenizer of ``--model hf:PATH``."""

    name = "text"
    kind = "language"
    metric = "bpb"
    higher_is_better = False

    def __init__(self, cfg: RunConfig) -> None:
        path = parse_hf_spec(cfg.model)
        if path is None:
            raise ConfigError(f"--task text tokenises with a pretrained model's tokenizer: use "
                              f"--model hf:PATH (got --model {cfg.model}); the toy char-level "
                              "models go with --task shakespeare")
        self.tokenizer = load_hf_tokenizer(path)
        self.data = cfg.data
        self.files = text_files(cfg.data)
        self.seq_len = int(cfg.seq_len)
        self.cache = token_cache(self.files, self.tokenizer)
        meta = json.loads((self.cache / "meta.json").read_text(encoding="utf-8"))
        self.meta = meta
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
        text = self.tokenizer.decode(np.asarray(ids).tolist(), clean_up_tokenization_spaces=False)
        return len(text.encode("utf-8"))

    def example_inputs(self) -> torch.Tensor:
        return torch.from_numpy(np.asarray(self.test_ids[:self.seq_len], dtype=np.int64)).unsqueeze(0)

    def steps_per_epoch(self, batch_size: int) -> int:
        return max(1, len(self.train_ids) // (batch_size * self.seq_len))

    def train_batch(self, step: int, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed((seed * 1_000_003 + step * 7_919 + 17) % (2**63 - 1))
        high = len(self.train_ids) - self.seq_len - 1
        starts = torch.randint(0, high + 1, (batch_size,), generator=g).tolist()
        windows = np.stack([np.asarray(self.train_ids[s:s + self.seq_len + 1], dtype=np.int64)
                            for s in starts])
        w = torch.from_numpy(windows)
        return w[:, :-1], w[:, 1:]

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batch_size: int = 256, device: torch.device | str = "cpu",
                 limit: int | None = None) -> dict[str, float]:
        ids = self.test_ids if limit is None else self.test_ids[:limit]
        n_bytes = self.test_bytes if limit is None else self._bytes_of(ids)
        head = [self.bos] if self.bos is not None else []
        n = len(head) + len(ids)  # positions of the evaluated stream
        L = self.seq_len
        starts = list(range(0, n - 1, L))  # window j predicts stream[s+1 : s+L+1]
        # windows per forward: at most ~2^25 logits (128 MB in float32; a 49k vocabulary at
        # 64 tokens gives 10 windows), so evaluation never dominates the peak memory
        batch_size = max(1, min(batch_size, (1 << 25) // (L * max(1, self.info["vocab_size"]))))
        was = model.training
        model.eval()
        total, correct, count = 0.0, 0, 0
        try:
            for i in range(0, len(starts), batch_size):
                group = starts[i:i + batch_size]
                by_len: dict[int, list[np.ndarray]] = {}
                for s in group:
                    w = self._stream(ids, head, s, min(n, s + L + 1))
                    by_len.setdefault(len(w), []).append(w)
                for rows in by_len.values():
                    w = torch.from_numpy(np.stack(rows)).to(device)
                    x, y = w[:, :-1], w[:, 1:]
                    logits = self.forward(model, x).float()
                    total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                   y.reshape(-1), reduction="sum"))
                    correct += int((logits.argmax(-1) == y).sum())
                    count += y.numel()
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
        src = "the bundled Shakespeare" if self.data is None \
            else (str(self.files[0]) if len(self.files) == 1 else f"{len(self.files)} files in {self.data}")
        return (f"text ({src}): {len(self.train_ids):,} training / {len(self.test_ids):,} test "
                f"tokens ({self.test_bytes:,} test bytes), vocabulary of {self.info['vocab_size']:,}, "
                f"sequences of {self.seq_len}")

    def format_metrics(self, metrics: dict[str, float]) -> str:
        return (f"perplexity {metrics['ppl']:.2f}, {metrics['bpb']:.3f} bits/byte, "
                f"next-token accuracy {100 * metrics['acc']:.1f}%")
