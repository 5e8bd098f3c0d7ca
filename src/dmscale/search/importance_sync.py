"""The importance side of :class:`~dmscale.search.searcher.Searcher`: whether importance exists
(Eq. 4's moving average, without which a structure would only keep leading elements), random
importance for baselines, the AMP scaler, and its all-reduce under torch.distributed.

:class:`ImportanceSync` is given the gates (:class:`~dmscale.core.masks.Gates`, which hold the
importance buffers, the pending updates and the process group), the importance metric and the
model's name (for its errors); the Searcher holds one as ``searcher.importance`` and its
methods of the same names call it.

Example:
    >>> import torch, dmscale as dms
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> searcher = dms.prepare(net, torch.randn(2, 4), dms.SearchConfig("params", 0.5))
    >>> searcher.has_importance(), searcher.sync_importance()  # one process: nothing pending
    (False, 0)
"""

from __future__ import annotations

from typing import Any

import torch

from dmscale.core.errors import NoImportanceError, PendingImportanceError

__all__ = ["ImportanceSync"]


class ImportanceSync:
    """Importance and its synchronisation across processes.

    Args:
        gates: the search's gates.
        importance: the importance metric (``SearchConfig.importance``; ``"index"`` is static).
        model_name: the searched model's class name, for :class:`NoImportanceError`.
    """

    def __init__(self, gates: Any, importance: str, model_name: str) -> None:
        self.gates, self.importance, self.model_name = gates, importance, model_name

    def has_importance(self) -> bool:
        """Whether the hard structure is chosen by importance: the metric is ``"index"``
        (static, earlier elements first) or some width or depth gate has a non-zero
        importance (a task-loss backward updated it, Eq. 4, or a checkpoint restored it).

        Derived from the importance buffers, so it follows :meth:`dmscale.Searcher.load_state_dict`.
        While it is False every gate ranks its elements by position only, and
        :meth:`dmscale.Searcher.structure` and :meth:`dmscale.Searcher.export` raise
        :class:`~dmscale.core.errors.NoImportanceError`.
        """
        if self.importance == "index":
            return True
        ranked = [t for t in list(self.gates.width) + list(self.gates.depth)
                  if getattr(t, "ranks_by_importance", True)]  # e.g. MES ranks by its logits
        return not ranked or any(bool(t.importance.detach().ne(0).any()) for t in ranked)

    def randomize(self, seed: int | torch.Generator = 0) -> None:
        """Give every gate a random importance (uniform in (0, 1], seeded): structures that
        keep random, not leading, elements. For exactness checks and random-pruning
        baselines; a search overwrites it gradually (Eq. 4's moving average).

        Example:
            >>> import torch
            >>> from torch import nn
            >>> import dmscale as dms
            >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
            >>> searcher = dms.prepare(net, torch.randn(2, 4), dms.SearchConfig("params", 0.5))
            >>> searcher.has_importance()
            False
            >>> searcher.randomize_importance(seed=0)
            >>> _ = searcher.meet_target()  # half the parameters: random hidden units
            >>> searcher.has_importance(), searcher.structure()["layers"]["0"]["out"] != [0, 1, 2, 3]
            (True, True)
        """
        g = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(int(seed))
        with torch.no_grad():
            for t in list(self.gates.width) + list(self.gates.depth):
                values = 1.0 - torch.rand(t.importance.shape, generator=g, dtype=torch.float64)
                t.importance.copy_(values.to(t.importance.dtype))

    def require(self, what: str) -> None:
        """Raise :class:`NoImportanceError` naming ``what`` while :meth:`has_importance` is False."""
        if self.has_importance():
            return
        raise NoImportanceError(
            f"{what} before any importance exists: no training step with the task loss has "
            f"run, so every layer of {self.model_name} would keep its first elements, "
            "an arbitrary choice and not a found structure. Train at least one step whose loss "
            "includes the task loss (importance comes from its gradient, paper Eq. 4: "
            "loss.backward() on task_loss + searcher.resource_loss(p)) before exporting; to keep "
            "elements by position on purpose, search with SearchConfig(importance=\"index\").")

    # ------------------------------------------------------------------ torch.distributed
    def use_grad_scaler(self, scaler: Any) -> None:
        """Tell the search about a ``torch.amp.GradScaler``: importance is computed from
        unscaled gradients (Eq. 4 on g / scale), so steps at different loss scales weigh the
        same. Steps whose gradients are not finite never touch importance."""
        self.gates.grad_scaler = scaler

    def sync(self) -> int:
        """Under torch.distributed: apply this step's importance updates (Eq. 4) from the
        gradient of the *global* batch. Call it on every rank after ``loss.backward()`` and
        before the next forward (before or after ``opt.step()``)::

            loss = task_loss(ddp_model(x_shard), y_shard) + searcher.resource_loss(p)
            opt.zero_grad(); loss.backward(); searcher.sync_importance(); opt.step()

        Each rank's mask gradients are held back by the backward, averaged in one all-reduce
        (their concatenation; with each rank's loss a mean over an equal shard, the mean is
        the global batch's gradient) and applied identically on every rank, so importance,
        structure and export are the same everywhere and equal one process's on the whole
        batch. The Taylor score (m g)^2 is not linear in g: averaging the ranks' importances
        instead would not give that.

        Forgotten, the next training forward applies the pending updates itself (the same
        all-reduce, in lockstep on every rank: the result is the same); the Searcher's
        ``structure``, ``export``, ``hardened``, ``meet_target`` and ``state_dict`` raise
        :class:`~dmscale.core.errors.PendingImportanceError` while updates are pending (they
        would miss the last step, and calling them on rank 0 only must not start a
        collective). Returns the number of updates applied: 0 in a single process (the
        backward updates importance at once) or when nothing is pending.
        """
        return self.gates.sync_importance()

    def use_process_group(self, group: Any = None) -> None:
        """Which ranks share importance: ``None`` (default) the default process group when
        it is initialised with more than one process; a ``ProcessGroup`` (the data-parallel
        ranks of a model-parallel run); ``False``: none (independent searches per rank)."""
        if len(self.gates.pending):
            raise PendingImportanceError(
                f"{len(self.gates.pending)} importance updates are pending: call "
                "searcher.sync_importance() before changing the process group")
        self.gates.process_group = group

    def require_synced(self, what: str) -> None:
        """Raise :class:`PendingImportanceError` naming ``what`` while updates are pending."""
        n = len(self.gates.pending)
        if n:
            raise PendingImportanceError(
                f"{what} under torch.distributed with {n} importance updates of the last "
                "backward still pending: call searcher.sync_importance() on every rank after "
                "loss.backward() (it all-reduces the mask gradients), then read the structure")
