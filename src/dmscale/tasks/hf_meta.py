"""``--model hf:PATH`` built from its ``config.json`` alone, on the ``meta`` device: the shapes
of the model without its weights, for ``dmscale inspect --memory`` (a 70 B model is planned
without the 280 GB of RAM that loading it in float32 takes).

:func:`meta_hf_model` reads the config (``hf:DIR``, ``hf:DIR/config.json`` or ``hf:FILE.gguf``:
no weight file is needed) and builds ``AutoModelForCausalLM.from_config`` under
``torch.device("meta")``, wrapped in :class:`~dmscale.tasks.language.CausalLM` as the loaded
model is. :class:`ShapeTextTask` stands for ``--task text`` without its tokenizer and data:
batches of random token ids of ``--seq-len`` (what the memory of a step depends on).

Example:
    >>> task = ShapeTextTask(seq_len=16, vocab_size=100)
    >>> x, y = task.train_batch(0, 2, seed=0)
    >>> tuple(x.shape), tuple(y.shape), task.example_inputs().device.type
    ((2, 16), (2, 16), 'meta')
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from dmscale.config.run_config import ConfigError
from dmscale.tasks.hf_model import hf_config
from dmscale.tasks.registry import Task

__all__ = ["config_path", "meta_hf_model", "ShapeTextTask"]


def config_path(path: str) -> str:
    """``path`` with a trailing ``config.json`` file name taken off (``hf:DIR/config.json``
    names the directory ``DIR``)."""
    p = Path(path).expanduser()
    return str(p.parent) if p.name == "config.json" and p.is_file() else path


def meta_hf_model(path: str, args: dict[str, Any] | None = None) -> tuple[nn.Module, Any]:
    """``(model, config)``: the causal LM of ``path`` built from its config on the ``meta``
    device (float32 shapes, no weights read), wrapped as :func:`~dmscale.tasks.hf_model.load_hf_model`
    wraps it. ``args`` (``--model-args``) go to ``from_config`` (e.g. ``attn_implementation``).

    Raises:
        ConfigError: the config cannot be read, is not a causal LM's, or ``args`` are refused.
    """
    from dmscale.tasks.language import CausalLM

    path = config_path(path)
    config = hf_config(path)  # imports transformers (after torchvision's workaround)
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **dict(args or {}))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"--model hf:{path}: cannot build the model from its config "
                          f"({str(err).splitlines()[0]}); check --model-args") from None
    return CausalLM(lm), config


class ShapeTextTask(Task):
    """``--task text`` as far as the memory of a step goes: random token ids in batches of
    ``seq_len`` tokens, no tokenizer, no data, nothing to evaluate."""

    name = "text"
    kind = "language"
    metric = "bpb"
    higher_is_better = False

    def __init__(self, seq_len: int, vocab_size: int) -> None:
        if seq_len < 1 or vocab_size < 1:
            raise ConfigError(f"expected --seq-len >= 1 and a vocabulary of >= 1 token, got "
                              f"{seq_len} and {vocab_size}")
        self.seq_len, self.vocab_size = int(seq_len), int(vocab_size)
        self.info = {"kind": "language", "seq_len": self.seq_len, "vocab_size": self.vocab_size}

    def example_inputs(self) -> torch.Tensor:
        return torch.zeros(1, self.seq_len, dtype=torch.long, device="meta")

    def steps_per_epoch(self, batch_size: int) -> int:
        return 1

    def train_batch(self, step: int, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        w = torch.randint(0, self.vocab_size, (batch_size, self.seq_len + 1), generator=g)
        return w[:, :-1], w[:, 1:]

    def describe(self) -> str:
        return f"random token ids, {self.seq_len} per sequence (shapes only)"
