"""WikiText-2 / PTB perplexity of a causal LM by the protocols pruning papers report.

Both protocols score the same text (:func:`dmscale.integrations.lm_eval.perplexity` reads it):
the test rows (:func:`dmscale.data.eval_sets.text_rows`) joined with ``"\\n\\n"``, tokenised once as ``tokenizer(text)`` tokenises it (the tokenizer's
BOS, when it adds one, at the start only), cut into consecutive non-overlapping windows of
``W`` tokens (a last partial window is dropped); each window predicts its tokens 2..W from
the ones before, and the perplexity is ``exp`` of the mean token NLL over all windows.

* ``llm-pruner``: ``W = 128`` (LLM-Pruner's ``PPLMetric``, and so the DMS paper's Table 7);
* ``gptq``: ``W = 2048`` (GPTQ, SparseGPT, Wanda; the model's context for Llama 1/2).

llama.cpp's ``llama-perplexity -f FILE -c N`` scores differently (:func:`llamacpp_perplexity`):
the file as it is, tokenised once, in chunks of ``N`` tokens whose first token is the BOS when
the vocabulary adds one, each chunk scoring only its second half (the first ``N/2`` tokens are
context).

The numbers are not comparable across protocols (a longer window gives more context, a lower
perplexity): an unpruned model is always run under the same one. ``limit`` keeps the first
``limit`` tokens of the tokenised text (whole windows of it), for fixed subsets that a table
pairs across models.

Example (a stand-in model that predicts every token uniformly: perplexity = vocabulary size):
    >>> import torch
    >>> class Uniform(torch.nn.Module):
    ...     def forward(self, input_ids):
    ...         return torch.zeros(*input_ids.shape, 50)
    >>> ids = list(range(40)) * 10
    >>> round(window_perplexity(Uniform(), ids, window=16)["ppl"], 3)
    50.0
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dmscale.core.errors import DataError

__all__ = ["PROTOCOLS", "window_perplexity", "llamacpp_perplexity"]

PROTOCOLS = {"llm-pruner": 128, "gptq": 2048}


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)  # a Hugging Face model takes input_ids first; a wrapper the ids alone
    return out.logits if hasattr(out, "logits") else out


@torch.no_grad()
def window_perplexity(model: nn.Module, ids: Sequence[int], window: int, batch_size: int = 8,
                      device: torch.device | str = "cpu",
                      progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """``{"ppl", "loss", "tokens", "windows", "window"}`` of ``ids`` in consecutive windows of
    ``window`` tokens (see the module docs); ``model(ids)`` returns logits (or an output with
    ``.logits``)."""
    n = len(ids) // window
    if n == 0:
        raise DataError(f"the text has {len(ids)} tokens, fewer than one window of {window}: give a longer "
                        "text or a larger --ppl-limit")
    t = torch.as_tensor(list(ids[:n * window]), dtype=torch.long).view(n, window)
    was = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for s in range(0, n, batch_size):
            x = t[s:s + batch_size].to(device)
            logits = _logits(model, x).float()
            total += float(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                           x[:, 1:].reshape(-1), reduction="sum"))
            count += x[:, 1:].numel()
            if progress is not None:
                progress(min(n, s + batch_size), n)
    finally:
        model.train(was)
    loss = total / count
    return {"ppl": math.exp(loss), "loss": loss, "tokens": n * window, "windows": n, "window": window}


@torch.no_grad()
def llamacpp_perplexity(model: nn.Module, ids: Sequence[int], n_ctx: int, chunks: int | None = None,
                        bos: int | None = None, device: torch.device | str = "cpu") -> dict[str, Any]:
    """Perplexity by llama.cpp's protocol (``tools/perplexity/perplexity.cpp``): ``ids`` (the
    whole text, tokenised once) in consecutive chunks of ``n_ctx`` tokens (at most ``chunks``
    of them), the first token of each replaced by ``bos`` when given; in each chunk the logits
    at positions ``n_ctx/2 .. n_ctx-2`` predict the next token, so a chunk scores
    ``n_ctx - 1 - n_ctx/2`` tokens. Returns ``{"ppl", "loss", "tokens", "chunks"}``."""
    n = len(ids) // n_ctx if chunks is None else min(chunks, len(ids) // n_ctx)
    if n == 0:
        raise DataError(f"the text has {len(ids)} tokens, fewer than one chunk of {n_ctx}")
    first = n_ctx // 2
    was = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for i in range(n):
            t = torch.as_tensor(list(ids[i * n_ctx:(i + 1) * n_ctx]), dtype=torch.long).view(1, n_ctx)
            if bos is not None:
                t[0, 0] = bos
            t = t.to(device)
            logits = _logits(model, t).float()[0]  # (n_ctx, vocab)
            total += float(F.cross_entropy(logits[first:-1], t[0, first + 1:], reduction="sum"))
            count += n_ctx - 1 - first
    finally:
        model.train(was)
    return {"ppl": math.exp(total / count), "loss": total / count, "tokens": count, "chunks": n}
