"""The order of training examples (src/dmscale/data/order.py): batches by step, shares by rank,
one augmentation seed per example."""

from __future__ import annotations

import itertools

import pytest
import torch

from dmscale.data.order import StepBatchSampler, epoch_permutation, sample_seed, steps_per_epoch
from dmscale.tasks.registry import _epoch_permutation

__all__: list[str] = []


def _take(sampler: StepBatchSampler, k: int) -> list[list[tuple[int, int]]]:
    return list(itertools.islice(iter(sampler), k))


def test_the_tasks_permutation_is_this_one() -> None:
    """MNIST, digits and detection draw their batches from the same function (results pinned)."""
    assert _epoch_permutation is epoch_permutation
    assert epoch_permutation(10, 3, 7).tolist() == torch.randperm(
        10, generator=torch.Generator().manual_seed((7 * 1_000_003 + 3 * 7_919) % (2**63 - 1))).tolist()


def test_a_batch_is_a_slice_of_its_epochs_permutation() -> None:
    n, b = 23, 5
    spe = steps_per_epoch(n, b)
    got = _take(StepBatchSampler(n, b, seed=3), 2 * spe)
    for step, batch in enumerate(got):
        epoch, k = divmod(step, spe)
        perm = epoch_permutation(n, epoch, 3).tolist()
        assert [i for i, _ in batch] == perm[k * b:(k + 1) * b]
        assert [s for _, s in batch] == [sample_seed(3, epoch, p) for p in range(k * b, (k + 1) * b)]


@pytest.mark.parametrize("start", [1, 4, 9])
def test_starting_at_a_step_gives_the_same_batches(start: int) -> None:
    whole = _take(StepBatchSampler(23, 5, seed=0), 12)
    assert _take(StepBatchSampler(23, 5, seed=0, start=start), 12 - start) == whole[start:]


def test_ranks_take_disjoint_shares_of_the_global_batch() -> None:
    whole = _take(StepBatchSampler(40, 8, seed=1), 10)
    shares = [_take(StepBatchSampler(40, 8, seed=1, rank=r, world=4), 10) for r in range(4)]
    for step, batch in enumerate(whole):
        parts = [shares[r][step] for r in range(4)]
        assert all(len(p) == 2 for p in parts)
        assert sum(parts, []) == batch  # the same examples with the same seeds, rank by rank


def test_stop_and_seeds() -> None:
    assert len(list(StepBatchSampler(10, 2, seed=0, start=3, stop=7))) == 4
    seeds = {sample_seed(0, e, p) for e in range(3) for p in range(100)}
    assert len(seeds) == 300 and all(0 <= s < 2**63 for s in seeds)
    assert sample_seed(1, 0, 0) != sample_seed(0, 0, 0)


def test_a_world_that_does_not_divide_the_batch_is_refused() -> None:
    with pytest.raises(ValueError, match="not divisible by world size 3"):
        next(iter(StepBatchSampler(40, 8, seed=0, rank=0, world=3)))
