"""``--task imagefolder``: image classification on a folder of class folders, read lazily.

Images are decoded when a batch needs them, in ``--workers`` loader processes
(:mod:`dmscale.data.images`), so memory does not grow with the data set. Layouts (``--data
DIR``): ``DIR/train/CLASS/IMAGE`` with ``DIR/val/...`` (or ``DIR/test/...``), or one
``DIR/CLASS/IMAGE`` split 90/10 by a fixed permutation. WebDataset tar shards instead of class
folders (:mod:`dmscale.data.shards`, detected from ``--data``): a ``.tar`` file, a brace pattern
or a directory of ``.tar`` files, with the same two layouts (``DIR/train/*.tar`` with
``DIR/val/*.tar``). ``--val-data`` names the held-out images (folder or shards) explicitly. Transforms
(:mod:`dmscale.data.image_transforms`): timm's own for ``--model timm:NAME`` (its data
configuration, ``--auto-augment``), torchvision's ImageNet-style ones for every other model;
``--image-augment none`` trains on the evaluation transform.

Exact resume: batch ``step`` holds the examples of positions ``k*B .. (k+1)*B`` of the
permutation of epoch ``e`` (``e, k = divmod(step, steps_per_epoch)``), and every example's
random augmentation is seeded from ``(seed, e, position)`` in the process that decodes it, so
:meth:`ImageFolderTask.train_batch` is a pure function of ``(seed, step)`` whatever the number
of workers. The task keeps one loader iterator running ahead; a request for another step than
the next one (a resumed run, a new phase) starts a new iterator at that step. Under torchrun
each rank loads only its share of each global batch (:attr:`shards_by_rank`).

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> from PIL import Image
    >>> from dmscale.config.run_config import RunConfig
    >>> root = Path(tempfile.mkdtemp())
    >>> for split, n in (("train", 4), ("val", 2)):
    ...     for cls in ("cat", "dog"):
    ...         (root / split / cls).mkdir(parents=True)
    ...         for i in range(n):
    ...             Image.new("RGB", (24, 20), (60 * i, 0, 0)).save(root / split / cls / f"{i}.jpg")
    >>> task = build_imagefolder_task(RunConfig(task="imagefolder", data=str(root), image_size=16,
    ...                                         workers=0).resolved())
    >>> task.describe()
    'imagefolder: 8 training / 4 test images, 16x16 crops (torchvision transforms), 2 classes, 0 loader workers'
    >>> x, y = task.train_batch(step=3, batch_size=4, seed=0)
    >>> tuple(x.shape), torch.equal(x, task.train_batch(3, 4, 0)[0])
    ((4, 3, 16, 16), True)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from dmscale.config.run_config import ConfigError, RunConfig
from dmscale.core.distributed import rank, world_size
from dmscale.core.errors import DataError
from dmscale.data.image_transforms import ImageTransforms, timm_transforms, torchvision_transforms
from dmscale.data.images import ImageDataset, ImageFiles, ImageSource, Unreadable, default_workers, image_loader
from dmscale.data.order import StepBatchSampler, steps_per_epoch
from dmscale.data.shards import SHARD_HINT, ShardFiles, is_shard_data
from dmscale.tasks.registry import Task, classification_metrics, register_task

__all__ = ["DEFAULT_IMAGE_SIZE", "ImageFolderTask", "build_imagefolder_task", "image_transforms"]

DEFAULT_IMAGE_SIZE = 32  # --image-size of the models that have no input size of their own


@dataclass
class _Stream:
    """The running training iterator: for which batches, and the step it yields next."""

    key: tuple[int, int, int, int]  # batch size, seed, rank, world
    batches: Iterator[Any]
    next_step: int


class ImageFolderTask(Task):
    """Classification on :class:`ImageFiles` decoded per batch (see the module text).

    Args:
        train / test: the two splits' files (:class:`ImageFiles` or :class:`ShardFiles`).
        transforms: the training and evaluation transforms.
        workers: loader processes (0: decode in this process).
        pin_memory: page-locked batches, for a CUDA device.
    """

    name = "imagefolder"
    kind = "classification"
    metric = "acc"
    shards_by_rank = True

    def __init__(self, train: ImageSource, test: ImageSource, transforms: ImageTransforms, workers: int = 0,
                 pin_memory: bool = False) -> None:
        if len(train) == 0 or len(test) == 0:
            raise ConfigError(f"task {self.name}: empty split ({len(train)} training, {len(test)} test examples)")
        self.train_set = ImageDataset(train, transforms.train)
        self.test_set = ImageDataset(test, transforms.eval)
        self.transforms = transforms
        self.workers, self.pin_memory = int(workers), bool(pin_memory)
        self.num_classes = len(train.classes)
        s = transforms.size
        self.info = {"kind": "classification", "num_classes": self.num_classes, "in_channels": 3,
                     "image_size": [s, s], "classes": list(train.classes),
                     "mean": [float(v) for v in transforms.mean], "std": [float(v) for v in transforms.std]}
        self._stream: _Stream | None = None
        self._example = self._pair(self.test_set[0], self.test_set.files)[0].unsqueeze(0)

    # ------------------------------------------------------------------ batches
    @staticmethod
    def _pair(item: Any, files: ImageSource, prefix: str = "") -> Any:
        """``item`` (an example or a batch), or the error naming the file it could not read."""
        if isinstance(item, Unreadable):
            raise DataError(f"{prefix}--data {files.root}: cannot read image {item.path} ({item.error}); "
                            f"{files.unreadable_fix}")
        return item

    def example_inputs(self) -> torch.Tensor:
        return self._example.clone()

    def steps_per_epoch(self, batch_size: int) -> int:
        return steps_per_epoch(len(self.train_set), batch_size)

    def train_batch(self, step: int, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch ``step`` (this rank's share of it under torchrun), from the running iterator
        when it is at ``step``, else from a new one started there."""
        key = (batch_size, seed, rank(), world_size())
        stream = self._stream
        if stream is None or stream.key != key or stream.next_step != step:
            self.close()
            sampler = StepBatchSampler(len(self.train_set), batch_size, seed, start=step, rank=key[2], world=key[3])
            loader = image_loader(self.train_set, batch_sampler=sampler, workers=self.workers,
                                  pin_memory=self.pin_memory)
            stream = self._stream = _Stream(key, iter(loader), step)
        batch = next(stream.batches)
        stream.next_step += 1
        return self._pair(batch, self.train_set.files, prefix=f"task {self.name}: ")

    def close(self) -> None:
        """End the running iterator and its worker processes."""
        self._stream = None

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, model: nn.Module, batch_size: int = 256, device: torch.device | str = "cpu",
                 limit: int | None = None) -> dict[str, float]:
        """Accuracy and mean loss on the test split (its first ``limit`` images), streamed."""
        n = len(self.test_set) if limit is None else min(limit, len(self.test_set))
        workers = min(self.workers, -(-n // batch_size))  # no more workers than batches
        loader = image_loader(self.test_set, batch_size=batch_size, indices=range(n), workers=workers,
                              pin_memory=self.pin_memory)
        prefix = f"task {self.name}: "
        batches = (tuple(t.to(device, non_blocking=True) for t in self._pair(batch, self.test_set.files, prefix=prefix))
                   for batch in loader)
        return classification_metrics(self.forward, model, batches, n)

    def describe(self) -> str:
        s = self.transforms.size
        augment = "" if self.transforms.train is not self.transforms.eval else ", no augmentation"
        files = self.train_set.files
        shards = f" in {len(files.paths):,} tar shards" if isinstance(files, ShardFiles) else ""
        return (f"{self.name}: {len(self.train_set):,} training / {len(self.test_set):,} test images{shards}, "
                f"{s}x{s} crops ({self.transforms.origin} transforms{augment}), {self.num_classes} classes, "
                f"{self.workers} loader worker{'' if self.workers == 1 else 's'}")


# ----------------------------------------------------------------------------- building
_Split = ImageFiles | ShardFiles


def _limited(files: _Split, limit: int | None) -> _Split:
    """A class-balanced prefix of ``limit`` examples (a fixed shuffle), or all of them."""
    if limit is None:
        return files
    order = torch.randperm(len(files), generator=torch.Generator().manual_seed(0)).tolist()
    return files.subset(order[:limit])


def _prefix(files: _Split, limit: int | None, what: str) -> _Split:
    if limit is None:
        return files
    if limit > len(files):
        raise ConfigError(f"--{what}-limit {limit} exceeds the {len(files)} {what} examples")
    return files.subset(range(limit))


def _read(spec: str | Path) -> _Split:
    """The examples of ``spec``: tar shards or a folder of class folders."""
    return ShardFiles.from_shards(spec) if is_shard_data(spec) else ImageFiles.from_folder(spec)


def _agree(train: _Split, test: _Split, where: str, names: tuple[str, str]) -> tuple[_Split, _Split]:
    """The two splits with one class list (shards: the larger label range), or the error."""
    if isinstance(train, ShardFiles) and isinstance(test, ShardFiles):
        classes = max(train.classes, test.classes, key=len)
        train, test = train.with_classes(classes), test.with_classes(classes)
    if test.classes != train.classes:
        raise ConfigError(f"--data {where}: {names[1]} has classes {test.classes}, {names[0]} has "
                          f"{train.classes}; give both splits the same classes")
    return train, test


def _splits(data: str, val_data: str | None, train_limit: int | None,
            test_limit: int | None) -> tuple[_Split, _Split]:
    """The training and held-out examples of ``--data`` and ``--val-data`` (module text)."""
    root = Path(data)
    split_test = next((root / s for s in ("val", "test") if (root / s).is_dir()), None)
    in_train = (root / "train").is_dir() and (split_test is not None or is_shard_data(root / "train"))
    train = root / "train" if in_train else data
    if val_data is not None:
        return _agree(_limited(_read(train), train_limit), _limited(_read(val_data), test_limit), data,
                      ("--data", f"--val-data {val_data}"))
    if in_train and split_test is not None:
        return _agree(_limited(_read(train), train_limit), _limited(_read(split_test), test_limit),
                      str(root), ("train/", f"{split_test.name}/"))
    files = _read(train)
    perm = torch.randperm(len(files), generator=torch.Generator().manual_seed(0)).tolist()
    n_test = max(1, len(files) // 10)
    return (_prefix(files.subset(perm[n_test:]), train_limit, "train"),
            _prefix(files.subset(perm[:n_test]), test_limit, "test"))


def image_transforms(cfg: RunConfig) -> ImageTransforms:
    """The transforms of a run: timm's for ``--model timm:NAME``, torchvision's otherwise."""
    augment = cfg.image_augment != "none"
    model = str(cfg.model or "")
    if model.startswith("timm:"):
        return timm_transforms(model[5:], cfg.image_size, augment, cfg.auto_augment)
    return torchvision_transforms(cfg.image_size or DEFAULT_IMAGE_SIZE, augment)


@register_task("imagefolder")
def build_imagefolder_task(cfg: RunConfig) -> ImageFolderTask:
    """The image folder of ``cfg.data`` with the transforms and loader of ``cfg``.

    Raises:
        ConfigError: no ``--data``, neither a folder of class folders nor tar shards, a shard
            missing, classes differ between the splits, or a limit is too large.
        DataError: a shard is corrupt or has an image without a label; the first training or
            test image cannot be read.
    """
    if not cfg.data:
        raise ConfigError("task imagefolder needs --data DIR (a directory of class folders, or tar shards)")
    for flag, spec in (("--data", cfg.data), ("--val-data", cfg.val_data)):
        if spec is not None and not is_shard_data(spec) and not Path(spec).is_dir():
            raise ConfigError(f"{flag} {spec}: not a directory of class folders nor tar shards. {SHARD_HINT}")
    train, test = _splits(cfg.data, cfg.val_data, cfg.train_limit, cfg.test_limit)
    if len(train):  # a broken first file fails now, not at the first step
        ImageFolderTask._pair(train.image(0), train)
    workers = default_workers() if cfg.workers is None else cfg.workers
    pin = cfg.device != "cpu" and torch.cuda.is_available()
    return ImageFolderTask(train, test, image_transforms(cfg), workers=workers, pin_memory=pin)
