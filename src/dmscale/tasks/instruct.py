"""``--task text --data alpaca.json``: instruction finetuning data, one example per record.

Each record (:mod:`dmscale.data.instructions`) is rendered as prompt and response
(``--prompt-format``: ``alpaca``, ``chat``, or ``auto`` = the tokenizer's chat template when it
has one, else Alpaca's) and tokenised as the model's tokenizer frames a text: the prompt as
``tokenizer(prompt)`` tokenises it (its BOS first, when it adds one), the response after it
without special tokens, then the EOS token (the Alpaca format; a chat template ends the turn
itself). An example is at most ``--seq-len + 1`` tokens (longer ones are cut at the end).

The loss (``--loss-on``): ``response`` scores the response tokens only (LLM-Pruner's default,
``train_on_inputs=False``; alpaca-lora's), ``all`` every token after the first. Batches hold
``--batch-size`` records drawn from ``(seed, step)``, padded on the right with the EOS token
to the longest (targets of the padding are not scored; a causal model's logits before the
padding do not see it). The last 10 % of the records (at least one) are held out;
evaluation reports the mean NLL per scored token (``loss``, ``ppl``) and ``bpb``, bits per
UTF-8 byte of the scored text.

Example (a stand-in tokenizer, one token per byte, EOS 0):
    >>> class Bytes:
    ...     eos_token_id, bos_token_id, chat_template = 0, None, None
    ...     def __call__(self, text, add_special_tokens=True):
    ...         return {"input_ids": list(text.encode())}
    ...     def decode(self, ids, **kw):
    ...         return bytes(ids).decode()
    >>> ex = encode_record({"instruction": "hi", "input": "", "output": "ok"}, Bytes(), "alpaca", "response", 512)
    >>> bytes(t for t in ex["ids"] if t).decode().endswith("### Response:\\nok"), ex["scored"]
    (True, 3)
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dmscale.config.run_config import ConfigError, RunConfig
from dmscale.core.errors import DataError
from dmscale.data.instructions import is_instruction_file, read_instructions, render
from dmscale.data.text_files import HELD_OUT
from dmscale.tasks.registry import Task, register_task
from dmscale.tasks.text import TextTask, text_tokenizer
from dmscale.tasks.text_windows import IGNORE

__all__ = ["InstructionTask", "build_text_task", "encode_record", "LOSS_ON"]

LOSS_ON = ("response", "all")


def encode_record(record: dict[str, str], tokenizer: Any, prompt_format: str, loss_on: str,
                  max_tokens: int) -> dict[str, Any]:
    """``{"ids": int64 array, "targets": int64 array, "scored": n}`` of one record: ``ids`` the
    example's tokens (at most ``max_tokens``), ``targets[t]`` the token ``ids[t + 1]`` when it
    is scored, else ``IGNORE``."""
    prompt, response = render(record, prompt_format, tokenizer)
    chat = prompt_format == "chat"
    head = list(tokenizer(prompt, add_special_tokens=not chat)["input_ids"])
    tail = list(tokenizer(response, add_special_tokens=False)["input_ids"])
    if not chat and tokenizer.eos_token_id is not None:
        tail.append(int(tokenizer.eos_token_id))
    ids = np.asarray((head + tail)[:max_tokens], dtype=np.int64)
    targets = ids[1:].copy()
    if loss_on == "response":
        targets[:max(0, len(head) - 1)] = IGNORE
    return {"ids": ids, "targets": targets, "scored": int((targets != IGNORE).sum())}


class InstructionTask(Task):
    """Next-token prediction on instruction records with the tokenizer of ``--model hf:PATH``."""

    name = "text"
    kind = "language"
    metric = "bpb"
    higher_is_better = False

    batch_metric = TextTask.batch_metric  # next-token accuracy over the scored targets
    format_metrics = TextTask.format_metrics

    def __init__(self, cfg: RunConfig) -> None:
        path, self.tokenizer = text_tokenizer(cfg)
        fmt = cfg.prompt_format
        if fmt == "auto":
            fmt = "chat" if getattr(self.tokenizer, "chat_template", None) else "alpaca"
        self.prompt_format, self.loss_on, self.seq_len = fmt, cfg.loss_on, int(cfg.seq_len)
        records = read_instructions(cfg.data)
        if len(records) < 2:
            raise ConfigError(f"--data {cfg.data}: {len(records)} record; at least 2 are needed "
                              "(the last 10 % are held out)")
        try:
            examples = [encode_record(r, self.tokenizer, fmt, cfg.loss_on, self.seq_len + 1) for r in records]
        except DataError as err:
            raise ConfigError(str(err)) from None
        n_test = max(1, int(round(HELD_OUT * len(examples))))
        # a record whose scored tokens all fall past --seq-len teaches nothing: left out (and counted)
        self.train = [e for e in examples[:-n_test] if e["scored"]]
        self.test = [e for e in examples[-n_test:] if e["scored"]]
        self.dropped = len(examples) - len(self.train) - len(self.test)
        if not self.train or not self.test:
            raise ConfigError(f"--data {cfg.data}: {self.dropped} of {len(examples)} records have no scored "
                              f"token within --seq-len {self.seq_len}, leaving no training or held-out "
                              "record: raise --seq-len")
        if cfg.train_limit:
            self.train = self.train[:cfg.train_limit]
        if cfg.test_limit:
            self.test = self.test[:cfg.test_limit]
        self.pad = int(self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0)
        self.data, self.n_records = cfg.data, len(records)
        self.info = {"kind": "language", "seq_len": self.seq_len, "vocab_size": len(self.tokenizer),
                     "tokenizer": path}

    def _batch(self, examples: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets of ``examples``, right-padded to the longest."""
        width = max(1, max(len(e["ids"]) - 1 for e in examples))
        x = np.full((len(examples), width), self.pad, dtype=np.int64)
        y = np.full((len(examples), width), IGNORE, dtype=np.int64)
        for i, e in enumerate(examples):
            n = len(e["ids"]) - 1
            x[i, :n], y[i, :n] = e["ids"][:-1], e["targets"]
        return torch.from_numpy(x), torch.from_numpy(y)

    def example_inputs(self) -> torch.Tensor:
        """One window of ``--seq-len`` tokens (the first held-out example, padded): the unit of
        the MACs count, as for text."""
        e = self.test[0]["ids"][:self.seq_len]
        x = np.full((1, self.seq_len), self.pad, dtype=np.int64)
        x[0, :len(e)] = e
        return torch.from_numpy(x)

    def steps_per_epoch(self, batch_size: int) -> int:
        return max(1, len(self.train) // batch_size)

    def train_batch(self, step: int, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed((seed * 1_000_003 + step * 7_919 + 17) % (2**63 - 1))
        picks = torch.randint(0, len(self.train), (batch_size,), generator=g).tolist()
        return self._batch([self.train[i] for i in picks])

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batch_size: int = 256, device: torch.device | str = "cpu",
                 limit: int | None = None) -> dict[str, float]:
        examples = self.test if limit is None else self.test[:max(1, limit)]
        batch_size = max(1, min(batch_size, (1 << 25) // (self.seq_len * max(1, self.info["vocab_size"]))))
        was = model.training
        model.eval()
        total, correct, count = 0.0, 0, 0
        try:
            for s in range(0, len(examples), batch_size):
                x, y = (t.to(device) for t in self._batch(examples[s:s + batch_size]))
                logits = self.forward(model, x).float()
                total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                               reduction="sum", ignore_index=IGNORE))
                keep = y != IGNORE
                correct += int(((logits.argmax(-1) == y) & keep).sum())
                count += int(keep.sum())
        finally:
            model.train(was)
        n_bytes = sum(self._scored_bytes(e) for e in examples)
        loss = total / max(1, count)
        return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "bpb": total / math.log(2) / max(1, n_bytes),
                "acc": correct / max(1, count), "examples": count, "bytes": n_bytes}

    def _scored_bytes(self, example: dict[str, Any]) -> int:
        ids = [int(t) for t in example["targets"] if t != IGNORE and t != self.pad]
        return len(self.tokenizer.decode(ids, clean_up_tokenization_spaces=False).encode("utf-8"))

    def describe(self) -> str:
        dropped = f", {self.dropped:,} without a scored token within the sequence left out" if self.dropped else ""
        return (f"text (instructions: {self.data}, {self.n_records:,} records, {len(self.test):,} held out{dropped}; "
                f"{self.prompt_format} prompts, loss on {self.loss_on} tokens), sequences of at most "
                f"{self.seq_len}")


@register_task("text")
def build_text_task(cfg: RunConfig) -> Task:
    """``--task text``: :class:`~dmscale.tasks.text.TextTask`, or for a file of instruction
    records (Alpaca's format, :func:`~dmscale.data.instructions.is_instruction_file`)
    :class:`InstructionTask`."""
    return InstructionTask(cfg) if is_instruction_file(cfg.data) else TextTask(cfg)
