"""Element importance as a moving average (paper Eq. 4 and the ablation of Sec. 5.1).

``c <- decay * c + (1 - decay) * score(m, g)`` where g is the gradient of the *task* loss
with respect to the mask m (never the resource loss) and the score is:

* ``taylor``: (m g)^2 (the paper's default, Molchanov et al.);
* ``snip``: |m g|;
* ``fisher``: g^2;
* ``index``: static, never updated (earlier elements count as more important).

Importance is a buffer, not a parameter: it is never trained by gradient descent.

Under torch.distributed each rank sees only the gradient of its shard, and the score is not
linear in g: the mean of the ranks' (m g)^2 is not (m mean(g))^2. :class:`PendingImportance`
holds the step's updates back until the gradients are averaged over the ranks (one
all-reduce), so every rank applies the update of the global batch (see
:meth:`dmscale.Searcher.sync_importance`).

Example:
    >>> import torch
    >>> c = torch.zeros(3)
    >>> update_importance(c, torch.ones(3), torch.tensor([1.0, -2.0, 0.0]), "taylor", 0.99)
    >>> [round(v, 4) for v in c.tolist()]
    [0.01, 0.04, 0.0]
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch

from dmscale.core.distributed import all_reduce_mean

__all__ = ["IMPORTANCE_METRICS", "update_importance", "PendingImportance"]

_Score = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

IMPORTANCE_METRICS: dict[str, _Score | None] = {
    "taylor": lambda m, g: (m * g) ** 2,
    "snip": lambda m, g: (m * g).abs(),
    "fisher": lambda m, g: g**2,
    "index": None,
}


@torch.no_grad()
def update_importance(
    importance: torch.Tensor,
    mask: torch.Tensor,
    grad: torch.Tensor,
    metric: str,
    decay: float,
) -> None:
    """In-place Eq. 4 update of ``importance`` (shape (n,)) from mask and its gradient.

    A gradient with any non-finite value (an fp16 overflow the GradScaler will skip) leaves
    ``importance`` unchanged: one such step would otherwise make it non-finite for good.
    The check stays on the device (no host synchronisation).
    """
    score_fn = IMPORTANCE_METRICS[metric]
    if score_fn is None:
        return
    score = score_fn(mask.detach().to(importance.dtype), grad.detach().to(importance.dtype))
    updated = importance * decay + score * (1.0 - decay)
    importance.copy_(torch.where(torch.isfinite(score).all(), updated, importance))


class _Gate(Protocol):
    def update_importance(self, unit_mask: torch.Tensor, grad: torch.Tensor) -> None: ...


class PendingImportance:
    """Eq. 4 updates held back until the mask gradients are averaged over the ranks.

    ``add`` is called from the mask's gradient hook with this rank's (unscaled) gradient;
    ``flush`` averages every held gradient in ONE all-reduce (their concatenation) and then
    applies the updates in a fixed order (forward number, gate index), identically on every
    rank. With each rank's loss a mean over its equal shard, the averaged gradient is the
    global batch's, so the importance equals a single process's on the whole batch. A
    non-finite averaged gradient (any rank overflowed) leaves importance untouched on every
    rank (the guard of :func:`update_importance`).

    Example:
        >>> import torch
        >>> from dmscale.core.topk import DifferentiableTopK
        >>> gate, pending = DifferentiableTopK(2), PendingImportance()
        >>> pending.add((0, 0), gate, torch.ones(2), torch.tensor([1.0, -2.0]))
        >>> len(pending), pending.flush()   # no process group: this rank's gradient
        (1, 1)
        >>> [round(v, 4) for v in gate.importance.tolist()]
        [0.01, 0.04]
    """

    def __init__(self) -> None:
        self._entries: list[tuple[tuple[int, int], _Gate, torch.Tensor, torch.Tensor]] = []

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, key: tuple[int, int], gate: _Gate, mask: torch.Tensor, grad: torch.Tensor) -> None:
        """Hold one update: ``key`` = (forward number, gate index) orders it across ranks."""
        self._entries.append((key, gate, mask.detach(), grad.detach()))

    def clear(self) -> None:
        self._entries.clear()

    def flush(self, group: Any = None) -> int:
        """Average the held gradients over ``group`` (one all-reduce) and apply every update.

        Returns the number of updates applied (0 when nothing is held: no collective then,
        so ranks with nothing held must all skip it together, as they do in lockstep DDP).
        """
        entries = sorted(self._entries, key=lambda e: e[0])
        self._entries = []
        if not entries:
            return 0
        grads = [g.to(torch.float32).reshape(-1) for _, _, _, g in entries]
        flat = all_reduce_mean(torch.cat(grads), group)
        for (_, gate, mask, g), avg in zip(entries, flat.split([v.numel() for v in grads])):
            gate.update_importance(mask, avg.view(g.shape))
        return len(entries)
