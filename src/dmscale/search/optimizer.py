"""One optimizer object for a search loop: the user's optimizer for the weights, Adam for the
structural parameters, the settle phase's learning-rate scale and the search's progress.

A DMS search trains two kinds of parameters: the model's weights, with whatever optimizer
the task uses, and one pruning ratio ``a`` per structural dimension, with Adam (it moves each
ratio by about its learning rate per step, so a search of S steps can move a ratio by about
``lr x S``; see docs/search.md). The structure's learning rate follows
:meth:`~dmscale.search.searcher.Searcher.structure_lr_scale` (1, then annealed to 0 in the
settle phase, 0 while the cost is held in the budget band). :class:`SearchOptimizer` does
that bookkeeping, so a loop is::

    opt = searcher.optimizer(torch.optim.SGD(searcher.model_parameters(), lr=0.1), total_steps=n)
    for x, y in batches:
        loss = task_loss(model(x), y) + searcher.resource_loss(opt.progress)
        opt.zero_grad(); loss.backward(); opt.step()

Example:
    >>> import torch
    >>> from torch import nn
    >>> import dmscale as dms
    >>> net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
    >>> x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    >>> searcher = dms.prepare(net, x[:1], dms.SearchConfig(resource="params", target=0.5))
    >>> opt = searcher.optimizer(torch.optim.SGD(searcher.model_parameters(), lr=0.1), total_steps=5)
    >>> for _ in range(5):
    ...     loss = nn.functional.cross_entropy(net(x), y) + searcher.resource_loss(opt.progress)
    ...     opt.zero_grad(); loss.backward(); opt.step()
    >>> opt.steps_done, opt.progress
    (5, 1.0)
    >>> _ = dms.detach(net)
"""

from __future__ import annotations

from typing import Any, Iterator, Protocol

import torch
from torch import nn

from dmscale.core.errors import ConfigError

__all__ = ["SearchOptimizer", "STRUCTURE_LR"]

STRUCTURE_LR = 0.01  # Adam's learning rate of the pruning ratios (the CLI's --structure-lr default)


class _Search(Protocol):
    """What the optimizer needs of a :class:`~dmscale.search.searcher.Searcher`."""

    def structure_parameters(self) -> Iterator[nn.Parameter]: ...

    def structure_lr_scale(self, progress: float) -> float: ...


class SearchOptimizer:
    """The weights' optimizer and Adam over the structure, stepped together.

    Args:
        searcher: the search whose structural parameters and learning-rate scale are used.
        weights: an optimizer over ``searcher.model_parameters()`` (any torch optimizer).
        total_steps: optimizer steps of the whole search; ``progress`` runs from 1/total to 1.
        structure_lr: Adam's learning rate for the pruning ratios.
        betas: Adam's betas for the pruning ratios.
    """

    def __init__(self, searcher: _Search, weights: torch.optim.Optimizer, total_steps: int,
                 structure_lr: float = STRUCTURE_LR, betas: tuple[float, float] = (0.9, 0.999)) -> None:
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
            raise ConfigError(f"total_steps must be a positive int (the search's optimizer steps), got {total_steps!r}")
        if not structure_lr > 0:
            raise ConfigError(f"structure_lr must be > 0, got {structure_lr!r}")
        structural = {id(p) for p in searcher.structure_parameters()}
        mixed = [i for i, g in enumerate(weights.param_groups) if any(id(p) in structural for p in g["params"])]
        if mixed:
            raise ConfigError(f"the weights' optimizer holds structural parameters (param group {mixed[0]}); "
                              "build it over searcher.model_parameters(), the structure gets its own Adam")
        self.searcher = searcher
        self.weights = weights
        self.structure = torch.optim.Adam(searcher.structure_parameters(), lr=structure_lr, betas=betas,
                                          weight_decay=0.0)
        self.structure_lr = float(structure_lr)
        self.total_steps = total_steps
        self.steps_done = 0

    @property
    def progress(self) -> float:
        """The search's progress for this step, in (0, 1]: pass it to ``resource_loss``."""
        return min(1.0, (self.steps_done + 1) / self.total_steps)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.weights.zero_grad(set_to_none=set_to_none)
        self.structure.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        """Step the weights, then the structure at ``structure_lr x structure_lr_scale(progress)``."""
        scale = self.searcher.structure_lr_scale(self.progress)
        for group in self.structure.param_groups:
            group["lr"] = self.structure_lr * scale
        self.weights.step()
        self.structure.step()
        self.steps_done += 1

    def state_dict(self) -> dict[str, Any]:
        return {"weights": self.weights.state_dict(), "structure": self.structure.state_dict(),
                "steps_done": self.steps_done, "total_steps": self.total_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["total_steps"] != self.total_steps:
            raise ConfigError(f"saved for total_steps={state['total_steps']}, this optimizer has "
                              f"{self.total_steps}: build it with the saved run's length")
        self.weights.load_state_dict(state["weights"])
        self.structure.load_state_dict(state["structure"])
        self.steps_done = int(state["steps_done"])
