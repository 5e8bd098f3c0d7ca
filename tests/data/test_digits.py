"""scikit-learn's 8x8 digits as tensors, split deterministically."""

from __future__ import annotations

import pytest
import torch

from dmscale.data.digits import DIGITS_CLASSES, digits_tensors


@pytest.fixture(scope="module")
def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return digits_tensors(seed=0, test_fraction=0.2)


def test_shapes_and_dtypes(digits) -> None:
    x, y, x_test, y_test = digits
    assert x.shape[1:] == (1, 8, 8) and x_test.shape[1:] == (1, 8, 8)
    assert len(x) + len(x_test) == 1797
    assert len(x) == len(y) and len(x_test) == len(y_test)
    assert len(x_test) == pytest.approx(0.2 * 1797, abs=DIGITS_CLASSES)
    assert x.dtype == torch.float32 and y.dtype == torch.int64


def test_values(digits) -> None:
    x, y, x_test, y_test = digits
    assert x.min().item() == 0.0 and x.max().item() == 1.0
    assert set(y.tolist()) == set(range(DIGITS_CLASSES))
    # pixels are multiples of 1/16
    assert torch.equal(x * 16, (x * 16).round())


def test_split_is_stratified(digits) -> None:
    _, y, _, y_test = digits
    train_counts = torch.bincount(y, minlength=DIGITS_CLASSES).float()
    test_counts = torch.bincount(y_test, minlength=DIGITS_CLASSES).float()
    fraction = test_counts / (train_counts + test_counts)
    assert torch.all((fraction - 0.2).abs() < 0.01), fraction


def test_split_is_a_partition(digits) -> None:
    """Train and test images together are the whole data set, no image in both."""
    x, _, x_test, _ = digits
    rows = {tuple(r) for r in torch.cat([x, x_test]).flatten(1).tolist()}
    train_rows = {tuple(r) for r in x.flatten(1).tolist()}
    test_rows = {tuple(r) for r in x_test.flatten(1).tolist()}
    # the digits set has a few exact duplicate images; allow those but no wholesale overlap
    assert len(train_rows & test_rows) <= 5
    assert len(rows) >= 1797 - 10


def test_deterministic_and_seed_dependent(digits) -> None:
    again = digits_tensors(seed=0, test_fraction=0.2)
    assert all(torch.equal(a, b) for a, b in zip(digits, again))
    other = digits_tensors(seed=1, test_fraction=0.2)
    assert not torch.equal(digits[3], other[3])


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5, True])
def test_rejects_bad_fraction(fraction) -> None:
    with pytest.raises(ValueError, match="test_fraction must be in"):
        digits_tensors(test_fraction=fraction)
