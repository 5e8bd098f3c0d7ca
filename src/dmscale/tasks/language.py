"""Character-level language modelling on Shakespeare, and the causal LMs searched on it.

The corpus is the bundled plays (:func:`dmscale.data.shakespeare_text`); the vocabulary is
every character of the whole corpus (so it does not depend on ``--train-limit``). The first
90 % of the text trains, the last 10 % tests. A training batch is ``batch_size`` windows of
``seq_len + 1`` characters at offsets drawn from ``(seed, step)``. Evaluation reads the test
text in consecutive windows and reports the mean cross-entropy ``loss`` (nats per
character), ``bpc = loss / ln 2``, ``ppl = exp(loss)`` and next-character accuracy.

Models (``--model``):

* ``charcnn`` (default): :class:`CharCNN`, embedding -> residual blocks of dilated causal
  convolutions -> linear head. The core searches its widths (embedding channels, each
  block's hidden channels) and its depth (blocks).
* ``llama``: transformers' ``LlamaForCausalLM`` from a small ``LlamaConfig`` (defaults
  below, override with ``--model-args``), wrapped by :class:`CausalLM` so it takes ids and
  returns logits.

Example:
    >>> import torch
    >>> m = CharCNN(vocab_size=30, width=16, hidden=32, blocks=2)
    >>> m(torch.randint(0, 30, (2, 10))).shape
    torch.Size([2, 10, 30])
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dmscale.config.run_config import ConfigError, RunConfig
from dmscale.tasks.registry import Task, register_models, register_task, scaled

__all__ = ["ShakespeareTask", "CharCNN", "CausalConvBlock", "CausalLM", "build_language_model",
           "LLAMA_DEFAULTS"]

LLAMA_DEFAULTS: dict[str, Any] = {
    "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 4, "tie_word_embeddings": False,
}



@register_task("shakespeare")
class ShakespeareTask(Task):
    """Next-character prediction on Shakespeare's plays."""

    name = "shakespeare"
    kind = "language"
    metric = "bpc"
    higher_is_better = False

    def __init__(self, cfg: RunConfig) -> None:
        from dmscale.data import CharVocab, shakespeare_text

        text = shakespeare_text()
        vocab_chars = (cfg.task_info or {}).get("vocab")
        self.vocab = CharVocab(vocab_chars) if vocab_chars else CharVocab.from_text(text)
        split = int(len(text) * 0.9)
        train, test = text[:split], text[split:]
        self.seq_len = int(cfg.seq_len)
        for what, limit, part in (("train", cfg.train_limit, train), ("test", cfg.test_limit, test)):
            if limit is not None and limit > len(part):
                raise ConfigError(f"--{what}-limit {limit} exceeds the {len(part):,} {what} characters")
            if limit is not None and limit < self.seq_len + 1:
                raise ConfigError(f"--{what}-limit {limit} is shorter than one sequence "
                                  f"(--seq-len {self.seq_len} + 1 characters)")
        self.train_ids = self.vocab.encode(train[:cfg.train_limit] if cfg.train_limit else train)
        self.test_ids = self.vocab.encode(test[:cfg.test_limit] if cfg.test_limit else test)
        self.info = {"kind": "language", "vocab": list(self.vocab.chars), "seq_len": self.seq_len}

    def example_inputs(self) -> torch.Tensor:
        return self.test_ids[:self.seq_len].unsqueeze(0).clone()

    def steps_per_epoch(self, batch_size: int) -> int:
        return max(1, len(self.train_ids) // (batch_size * self.seq_len))

    def train_batch(self, step: int, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed((seed * 1_000_003 + step * 7_919 + 17) % (2**63 - 1))
        high = len(self.train_ids) - self.seq_len - 1
        starts = torch.randint(0, high + 1, (batch_size,), generator=g)
        windows = torch.stack([self.train_ids[s:s + self.seq_len + 1] for s in starts.tolist()])
        return windows[:, :-1], windows[:, 1:]

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batch_size: int = 256, device: torch.device | str = "cpu",
                 limit: int | None = None) -> dict[str, float]:
        ids = self.test_ids if limit is None else self.test_ids[:limit]
        n_win = max(1, (len(ids) - 1) // self.seq_len)
        was = model.training
        model.eval()
        total, correct, count = 0.0, 0, 0
        try:
            for i in range(0, n_win, batch_size):
                rows = [ids[j * self.seq_len:(j + 1) * self.seq_len + 1]
                        for j in range(i, min(i + batch_size, n_win))]
                w = torch.stack(rows).to(device)
                x, y = w[:, :-1], w[:, 1:]
                logits = self.forward(model, x).float()
                total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                               reduction="sum"))
                correct += int((logits.argmax(-1) == y).sum())
                count += y.numel()
        finally:
            model.train(was)
        loss = total / count
        return {"loss": loss, "bpc": loss / math.log(2), "ppl": math.exp(min(loss, 50.0)),
                "acc": correct / count, "examples": count}

    def describe(self) -> str:
        return (f"shakespeare: {len(self.train_ids):,} training / {len(self.test_ids):,} test "
                f"characters, vocabulary of {len(self.vocab)}, sequences of {self.seq_len}")


class CausalConvBlock(nn.Module):
    """``x + BN(proj(GELU(conv(pad_left(x)))))``: a dilated causal convolution block.

    Input and output are ``(B, C, T)``; position t sees only positions <= t.
    """

    def __init__(self, channels: int, hidden: int, kernel_size: int = 3, dilation: int = 1) -> None:
        super().__init__()
        self.pad = (kernel_size - 1) * dilation
        self.conv = nn.Conv1d(channels, hidden, kernel_size, dilation=dilation)
        self.act = nn.GELU()
        self.proj = nn.Conv1d(hidden, channels, 1)
        self.norm = nn.BatchNorm1d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, C, T)
        h = self.act(self.conv(F.pad(x, (self.pad, 0))))  # (B, hidden, T)
        return x + self.norm(self.proj(h))  # (B, C, T)


class CharCNN(nn.Module):
    """Causal convolutional character LM (a small WaveNet/TCN-style stack).

    Args:
        vocab_size: number of characters.
        width: embedding / residual channels.
        hidden: channels inside each block.
        blocks: residual blocks; block i uses dilation ``2 ** (i % 4)``.
        kernel_size: kernel of the causal convolutions.
    """

    def __init__(self, vocab_size: int, width: int = 128, hidden: int = 256, blocks: int = 6,
                 kernel_size: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.blocks = nn.Sequential(*[
            CausalConvBlock(width, hidden, kernel_size, dilation=2 ** (i % 4)) for i in range(blocks)
        ])
        self.head = nn.Linear(width, vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: (B, T) int64
        x = self.embed(ids).transpose(1, 2)  # (B, width, T)
        x = self.blocks(x)  # (B, width, T)
        return self.head(x.transpose(1, 2))  # (B, T, vocab)


class CausalLM(nn.Module):
    """Wraps a Hugging Face causal LM so that ``forward(ids)`` returns the logits tensor;
    ``forward(ids, output_hidden_states=True)`` returns ``(logits, hidden_states)`` with the
    model's tuple of ``num_hidden_layers + 1`` hidden states (embeddings first, the final
    normalised state last). Both go through this module's forward, so the search's masks
    (computed in a pre-hook of the root module) apply."""

    returns_hidden_states = True

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor, output_hidden_states: bool = False) -> Any:
        # ids: (B, T) -> logits (B, T, vocab) [, hidden states L + 1 x (B, T, hidden)]
        if output_hidden_states:
            out = self.lm(input_ids=ids, output_hidden_states=True)
            return out.logits, tuple(out.hidden_states)
        return self.lm(input_ids=ids).logits


def _build_llama(args: dict[str, Any], expand: dict[str, float], info: dict[str, Any]) -> tuple[nn.Module, list[str]]:
    from dmscale.core._compat import ensure_torchvision

    ensure_torchvision()  # transformers imports torchvision when it is installed
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        raise ConfigError("--model llama needs transformers: pip install 'dmscale[llm]'") from None
    kw = {**LLAMA_DEFAULTS, **args}
    heads = int(kw["num_attention_heads"])
    head_dim = max(1, int(kw["hidden_size"]) // heads)
    kw["hidden_size"] = heads * scaled(head_dim, expand["width"])
    kw["intermediate_size"] = scaled(int(kw["intermediate_size"]), expand["width"])
    kw["num_hidden_layers"] = scaled(int(kw["num_hidden_layers"]), expand["depth"])
    kw.setdefault("max_position_embeddings", max(256, int(info.get("seq_len", 64))))
    kw["vocab_size"] = len(info["vocab"])
    try:
        config = LlamaConfig(**kw)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"--model-args for llama: {err}") from None
    model = CausalLM(LlamaForCausalLM(config))
    return model, []


@register_models("language")
def build_language_model(name: str, args: dict[str, Any], expand: dict[str, float],
                         info: dict[str, Any]) -> tuple[nn.Module, list[str]]:
    """``(model, exclude)`` for ``charcnn`` or ``llama`` on a vocabulary of ``info['vocab']``."""
    vocab = len(info["vocab"])
    if name == "charcnn":
        kw = {"width": 128, "hidden": 256, "blocks": 6, "kernel_size": 3, **args}
        kw["width"] = scaled(int(kw["width"]), expand["width"])
        kw["hidden"] = scaled(int(kw["hidden"]), expand["width"])
        kw["blocks"] = scaled(int(kw["blocks"]), expand["depth"])
        return CharCNN(vocab, **kw), []
    if name == "llama":
        return _build_llama(args, expand, info)
    raise ConfigError(f"unknown language model {name!r}")
