"""Element importance as a moving average (paper Eq. 4 and the ablation of Sec. 5.1).

``c <- decay * c + (1 - decay) * score(m, g)`` where g is the gradient of the *task* loss
with respect to the mask m (never the resource loss) and the score is:

* ``taylor``: (m g)^2 (the paper's default, Molchanov et al.);
* ``snip``: |m g|;
* ``fisher``: g^2;
* ``index``: static, never updated (earlier elements count as more important).

Importance is a buffer, not a parameter: it is never trained by gradient descent.

Example:
    >>> import torch
    >>> c = torch.zeros(3)
    >>> update_importance(c, torch.ones(3), torch.tensor([1.0, -2.0, 0.0]), "taylor", 0.99)
    >>> [round(v, 4) for v in c.tolist()]
    [0.01, 0.04, 0.0]
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["IMPORTANCE_METRICS", "update_importance"]

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
