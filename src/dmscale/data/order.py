"""The order of training examples: one permutation per ``(seed, epoch)``, batches by step,
one random seed per example.

Batch ``step`` of a run holds positions ``k * B`` to ``(k + 1) * B`` of epoch ``e``'s
permutation, where ``e, k = divmod(step, steps_per_epoch)``: a pure function of
``(seed, step)``, so a resumed run draws exactly the batches the interrupted one would have.
:class:`StepBatchSampler` yields those batches as index lists for a
:class:`torch.utils.data.DataLoader`, from any step on, each with the seed of every
example's random augmentation (:func:`sample_seed`, from ``(seed, epoch, position)``), and,
under torchrun, only this rank's share of each global batch.

Example:
    >>> epoch_permutation(5, epoch=0, seed=0).tolist()
    [4, 0, 1, 3, 2]
    >>> sampler = StepBatchSampler(n=5, batch_size=2, seed=0, start=1)
    >>> [i for i, _ in next(iter(sampler))]      # step 1: positions 2, 3 of epoch 0
    [1, 3]
    >>> [[i for i, _ in b] for b in StepBatchSampler(5, 2, 0, start=0, rank=1, world=2, stop=2)]
    [[0], [3]]
    >>> sample_seed(0, 0, 2) == sampler.items(1)[0][1]
    True
"""

from __future__ import annotations

import hashlib
from typing import Iterator

import torch

from dmscale.core.distributed import shard
from dmscale.core.errors import ConfigError

__all__ = ["StepBatchSampler", "epoch_permutation", "sample_seed", "steps_per_epoch"]


def epoch_permutation(n: int, epoch: int, seed: int) -> torch.Tensor:
    """The order of ``n`` examples in ``epoch`` of a run with ``seed`` (``torch.randperm``)."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + epoch * 7_919) % (2**63 - 1))
    return torch.randperm(n, generator=g)


def steps_per_epoch(n: int, batch_size: int) -> int:
    """Full batches of ``batch_size`` in ``n`` examples (at least 1; a smaller last one is dropped)."""
    return max(1, n // batch_size)


def sample_seed(seed: int, epoch: int, position: int) -> int:
    """The seed of the random augmentation of the example at ``position`` of ``epoch``'s
    permutation (a 63-bit hash: independent of the worker, the rank and the batch size's split)."""
    digest = hashlib.blake2b(f"{seed}/{epoch}/{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class StepBatchSampler:
    """Batches of steps ``start, start + 1, ...`` (up to ``stop``, or without end) as lists of
    ``(example index, augmentation seed)``: this rank's ``1 / world`` of each global batch.

    Args:
        n: examples in the training split.
        batch_size: the global batch size ``B`` (every rank's share is ``B / world``).
        seed: the run's data seed (the permutation and the augmentation seeds).
        start: the first step to yield.
        rank / world: this process's share of each global batch (contiguous slices, as
            :func:`dmscale.core.distributed.shard` cuts them).
        stop: the step to end before (``None``: never end).

    Raises:
        ValueError: ``world`` does not divide the batch size.
    """

    def __init__(self, n: int, batch_size: int, seed: int, start: int = 0, rank: int = 0,
                 world: int = 1, stop: int | None = None) -> None:
        if n < 1 or batch_size < 1:
            raise ConfigError(f"need examples and a positive batch size, got n={n}, batch_size={batch_size}")
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self.start, self.stop, self.rank, self.world = start, stop, rank, world
        self.steps_per_epoch = steps_per_epoch(n, batch_size)
        self._epoch: tuple[int, list[int]] | None = None

    def _order(self, epoch: int) -> list[int]:
        if self._epoch is None or self._epoch[0] != epoch:
            self._epoch = (epoch, epoch_permutation(self.n, epoch, self.seed).tolist())
        return self._epoch[1]

    def items(self, step: int) -> list[tuple[int, int]]:
        """This rank's ``(index, seed)`` pairs of batch ``step``."""
        epoch, k = divmod(step, self.steps_per_epoch)
        order = self._order(epoch)
        positions = range(k * self.batch_size, min((k + 1) * self.batch_size, self.n))
        mine = shard(positions, self.rank, self.world) if self.world > 1 else positions
        return [(order[p], sample_seed(self.seed, epoch, p)) for p in mine]

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        step = self.start
        while self.stop is None or step < self.stop:
            yield self.items(step)
            step += 1
