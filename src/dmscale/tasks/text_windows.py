"""The windows of ``--task text``: each one starts as the tokenizer starts a text.

A pretrained model saw its texts framed by its tokenizer: Gemma's and Llama's tokenizers put a
BOS token first (``tokenizer(text)["input_ids"]`` starts with it), SmolLM2's puts none. A
window cut out of the token stream without that BOS is an input the model never saw (Gemma 3
270M: perplexity about 1,800 on Shakespeare without it, 156 with it). So the framing is read
from the tokenizer itself -- :func:`text_framing` tokenises ``"a"`` with and without special
tokens and keeps what surrounds the text -- rather than from the mere existence of
``bos_token_id`` (SmolLM2's tokenizer has one and never adds it).

With a *head* (the tokens put before a text, usually ``[BOS]``, ``h`` of them), a window of
``L`` inputs scores the ``P = L - h + 1`` stream tokens ``stream[s : s + P]``: its input is
``head + stream[s : s + P - 1]``, exactly how ``tokenizer(text)`` starts the text that begins
at ``s``. Targets that are head tokens (the BOS of a document in the stream) are never scored
(``IGNORE``; they have no bytes either). A window that starts on a document's own head (a
document stream, ``stream[s : s + h] == head``) takes the ``h`` tokens before it as context
(the EOS separator) instead, so that no input holds two BOS tokens in a row; at the very start
of a split the head's targets are skipped (:func:`eval_starts`).

Without a head (SmolLM2) nothing changes: a window is ``stream[s : s + L + 1]`` (inputs
``[:-1]``, targets ``[1:]``).

Example (a head ``[1]`` = BOS, windows of 4 inputs):
    >>> stream = np.array([10, 11, 12, 13, 14, 15, 16])
    >>> x, y = window(stream, 2, 4, (1,))
    >>> x.tolist(), y.tolist()
    ([1, 12, 13, 14], [12, 13, 14, 15])
    >>> eval_starts(stream, 4, (1,)), scored(4, (1,))
    ([0, 4], 4)
    >>> [t.tolist() for t in window(stream, 4, 4, (1,), stop=7)]
    [[1, 14, 15], [14, 15, 16]]
    >>> docs = np.array([1, 10, 11, 2, 1, 12, 13, 14, 2])  # BOS a b EOS BOS c d e EOS
    >>> [t.tolist() for t in window(docs, 4, 4, (1,))]     # starts on a document's BOS
    [[2, 1, 12, 13], [-100, 12, 13, 14]]
    >>> eval_starts(docs, 4, (1,))                         # the split's first BOS is skipped
    [1, 5]
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

__all__ = ["IGNORE", "text_framing", "scored", "window", "eval_starts"]

IGNORE = -100  # a target F.cross_entropy skips (its default ignore_index)


def text_framing(tokenizer: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(head, tail)``: the token ids ``tokenizer(text)`` puts before and after a text's own.

    Found by tokenising ``"a"`` with and without special tokens and locating the plain ids in
    the framed ones (``((2,), ())`` for Gemma 3, ``((128000,), ())`` for Llama 3, ``((), ())``
    for SmolLM2); where they cannot be located, the special ids at either end.
    """
    framed = [int(i) for i in tokenizer("a")["input_ids"]]
    plain = [int(i) for i in tokenizer("a", add_special_tokens=False)["input_ids"]]
    n = len(plain)
    for k in range(len(framed) - n + 1):
        if framed[k:k + n] == plain:
            return tuple(framed[:k]), tuple(framed[k + n:])
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    lead = 0
    while lead < len(framed) and framed[lead] in special:
        lead += 1
    trail = len(framed)
    while trail > lead and framed[trail - 1] in special:
        trail -= 1
    return tuple(framed[:lead]), tuple(framed[trail:])


def scored(seq_len: int, head: Sequence[int]) -> int:
    """Stream tokens one window scores: ``seq_len`` without a head, ``seq_len - h + 1`` with
    a head of ``h`` tokens."""
    return seq_len if not head else seq_len - len(head) + 1


def window(stream: np.ndarray, start: int, seq_len: int, head: Sequence[int],
           stop: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(inputs, targets)`` (int64) of the window that scores ``stream[start : stop]``
    (``stop`` defaults to a full window, :func:`scored` tokens; a shorter last window of an
    evaluation gives a shorter stop). Without a head: ``stream[start : stop + 1]`` shifted
    by one. See the module docs."""
    h = len(head)
    if h == 0:
        stop = start + seq_len if stop is None else stop
        w = np.asarray(stream[start:stop + 1], dtype=np.int64)
        return w[:-1], w[1:]
    stop = start + scored(seq_len, head) if stop is None else stop
    body = np.asarray(stream[start:stop], dtype=np.int64)  # the scored tokens, (P,)
    ctx = np.asarray(head, dtype=np.int64)
    if start >= h and tuple(int(t) for t in body[:h]) == tuple(head):  # a document's own head
        ctx = np.asarray(stream[start - h:start], dtype=np.int64)
    x = np.concatenate([ctx, body[:-1]])  # (h + P - 1,)
    y = np.concatenate([np.full(h - 1, IGNORE, dtype=np.int64), body])  # (h + P - 1,)
    y[h - 1:][np.isin(body, np.asarray(head))] = IGNORE  # a head token is never a target
    return x, y


def eval_starts(stream: np.ndarray, seq_len: int, head: Sequence[int]) -> list[int]:
    """The starts of consecutive evaluation windows over ``stream`` that score each of its
    tokens once (with a head, from the first token after the split's leading head, whose
    tokens are never scored)."""
    n = len(stream)
    if not head:
        return list(range(0, n - 1, seq_len))
    h = len(head)
    first = h if n >= h and tuple(int(t) for t in stream[:h]) == tuple(head) else 0
    return list(range(first, n, scored(seq_len, head)))
