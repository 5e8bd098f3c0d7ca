"""The 8x8 handwritten digits of scikit-learn (1,797 images) as a tiny, offline image task.

The data ships inside scikit-learn (the ``data`` extra: ``pip install "dmscale[data]"``),
so it loads with no download; it is small enough for tests and quick searches on a CPU.

Example:
    >>> from dmscale.data.digits import digits_tensors
    >>> x, y, x_test, y_test = digits_tensors(seed=0)
    >>> tuple(x.shape), tuple(x_test.shape), int(y.max())
    ((1438, 1, 8, 8), (359, 1, 8, 8), 9)
"""

from __future__ import annotations

import numpy as np
import torch

from dmscale.core.errors import ConfigError

__all__ = ["DIGITS_CLASSES", "digits_tensors"]

DIGITS_CLASSES = 10
"""Number of classes (the digits 0..9)."""

_PIXEL_MAX = 16.0  # load_digits() pixel values are integers in 0..16


def _load_digits() -> tuple[np.ndarray, np.ndarray]:
    """``(images N x 8 x 8 float64 in 0..16, labels N int)`` from scikit-learn."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:
        raise ImportError(
            'the digits data ships with scikit-learn, which is not installed: '
            'run `pip install "dmscale[data]"` (or `pip install "scikit-learn>=1.3,<2"`)'
        ) from error
    bunch = load_digits()
    return bunch.images, bunch.target


def _stratified_split(
    labels: np.ndarray, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Sorted train and test indices; each class contributes ``test_fraction`` of its members.

    Per class, ``round(test_fraction * count)`` members (at least one when the class has two
    or more) are drawn for the test set with a generator seeded by ``seed``.
    """
    rng = np.random.default_rng(seed)
    test: list[np.ndarray] = []
    for cls in np.unique(labels):
        members = np.flatnonzero(labels == cls)
        n_test = int(round(test_fraction * len(members)))
        if len(members) >= 2:
            n_test = min(max(n_test, 1), len(members) - 1)
        test.append(rng.choice(members, size=n_test, replace=False))
    test_idx = np.sort(np.concatenate(test))
    train_idx = np.setdiff1d(np.arange(len(labels)), test_idx)
    return train_idx, test_idx


def _as_tensors(
    images: np.ndarray, labels: np.ndarray, index: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.from_numpy(images[index] / _PIXEL_MAX).to(torch.float32).unsqueeze(1)
    y = torch.from_numpy(labels[index].astype(np.int64))
    return x, y


def digits_tensors(
    seed: int = 0, test_fraction: float = 0.2
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The digits as ``(x_train, y_train, x_test, y_test)``, split deterministically.

    Images are float32 ``N x 1 x 8 x 8`` scaled to [0, 1] (pixel / 16); labels are int64 in
    0..9. The split is stratified by class and depends only on ``seed`` and
    ``test_fraction``; both parts keep the original order of the data.

    Args:
        seed: seed of the split.
        test_fraction: fraction of each class held out for testing, in (0, 1).

    Raises:
        ValueError: ``test_fraction`` is not strictly between 0 and 1.

    Example:
        >>> a = digits_tensors(seed=1, test_fraction=0.5)
        >>> b = digits_tensors(seed=1, test_fraction=0.5)
        >>> all(torch.equal(p, q) for p, q in zip(a, b)), len(a[1]) + len(a[3])
        (True, 1797)
    """
    if isinstance(test_fraction, bool) or not 0.0 < float(test_fraction) < 1.0:
        raise ConfigError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    images, labels = _load_digits()
    train_idx, test_idx = _stratified_split(labels, float(test_fraction), seed)
    return (*_as_tensors(images, labels, train_idx), *_as_tensors(images, labels, test_idx))
