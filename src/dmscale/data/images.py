"""Image folders read lazily: a compact list of files, a Dataset that decodes one image per
access, and the DataLoader that does it in worker processes.

* :class:`ImageFiles`: the image files of a folder of class folders (``DIR/CLASS/IMAGE``,
  torchvision's ``ImageFolder`` layout and extensions), held as one bytes string of paths, an
  offset array and a label array: a few dozen bytes per image, and no Python object per
  image that worker processes would copy by touching its reference count.
* :class:`ImageDataset`: ``dataset[i]`` (evaluation) or ``dataset[(i, seed)]`` (training)
  decodes image ``i``, converts it to RGB and applies the transform; with a seed, python's
  ``random``, numpy's and torch's generators are seeded with it for that one example (and
  restored after), so the random augmentation of an example is a function of the seed alone,
  whichever process decodes it. A file that cannot be read becomes an :class:`Unreadable`
  (not an exception inside a worker), which :func:`collate_images` passes on as the batch.
* :func:`image_loader`: a :class:`torch.utils.data.DataLoader` with worker processes
  (:func:`default_workers`), prefetching and pinned memory when asked; it draws nothing from
  torch's global generator.

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> from PIL import Image
    >>> from dmscale.data.image_transforms import torchvision_transforms
    >>> root = Path(tempfile.mkdtemp())
    >>> for cls in ("cat", "dog"):
    ...     (root / cls).mkdir()
    ...     for i in range(3):
    ...         Image.new("RGB", (20, 20), (40 * i, 0, 0)).save(root / cls / f"{i}.jpg")
    >>> files = ImageFiles.from_folder(root)
    >>> len(files), files.classes, files.label(4), files.path(4).endswith("dog/1.jpg")
    (6, ['cat', 'dog'], 1, True)
    >>> ds = ImageDataset(files, torchvision_transforms(8).train)
    >>> x, y = ds[(4, 123)]
    >>> tuple(x.shape), y, torch.equal(x, ds[(4, 123)][0])
    ((3, 8, 8), 1, True)
    >>> xs, ys = next(iter(image_loader(ds, batch_size=4)))
    >>> tuple(xs.shape), ys.tolist()
    ((4, 3, 8, 8), [0, 0, 0, 1])
"""

from __future__ import annotations

import io
import os
import random
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol, Sequence

import numpy as np
import torch

from dmscale.core.errors import ConfigError

__all__ = ["ImageDataset", "ImageFiles", "ImageSource", "LAYOUT_HINT", "PREFETCH", "Unreadable", "collate_images",
           "decode_image", "default_workers", "image_loader", "open_image"]

LAYOUT_HINT = ("Expected one folder per class holding its images (DIR/CLASS/IMAGE, or "
               "DIR/train/CLASS/IMAGE and DIR/val/CLASS/IMAGE)")
PREFETCH = 2  # batches each worker decodes ahead
MAX_DEFAULT_WORKERS = 16


class ImageSource(Protocol):
    """The examples of one split as :class:`ImageDataset` reads them: :class:`ImageFiles`
    (a folder of class folders) or :class:`dmscale.data.shards.ShardFiles` (tar shards)."""

    root: Any
    classes: list[str]
    unreadable_fix: str  # what to do about an image that cannot be decoded (the error's end)

    def __len__(self) -> int: ...
    def label(self, i: int) -> int: ...
    def path(self, i: int) -> str: ...
    def image(self, i: int) -> Any: ...
    def subset(self, indices: Iterable[int]) -> Any: ...


class ImageFiles:
    """The image files of one split: paths (relative to ``root``) and class labels.

    Build it with :meth:`from_folder`; :meth:`subset` picks examples by index.
    """

    unreadable_fix = "remove or replace the file"

    def __init__(self, root: Path, classes: list[str], relative: Sequence[str], labels: Sequence[int]) -> None:
        encoded = [p.encode("utf-8", "surrogateescape") for p in relative]
        self.root = Path(root)
        self.classes = list(classes)
        self._blob = b"".join(encoded)
        self._offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(e) for e in encoded], out=self._offsets[1:])
        self._labels = np.asarray(labels, dtype=np.int64)

    @classmethod
    def from_folder(cls, path: str | Path) -> ImageFiles:
        """The images of the class folders in ``path`` (classes sorted by name, images by path).

        Raises:
            ConfigError: ``path`` has no class folders, or a class folder holds no image.
        """
        from dmscale.core._compat import ensure_torchvision

        if not ensure_torchvision():
            raise ConfigError("task imagefolder needs torchvision: pip install 'dmscale[vision]'")
        from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

        path = Path(path)
        try:
            classes, class_to_idx = find_classes(str(path))
            samples = make_dataset(str(path), class_to_idx, extensions=IMG_EXTENSIONS)
        except (FileNotFoundError, RuntimeError) as err:
            raise ConfigError(f"--data {path}: {str(err).strip()} {LAYOUT_HINT}") from None
        prefix = len(str(path)) + 1
        return cls(path, classes, [p[prefix:] for p, _ in samples], [y for _, y in samples])

    def __len__(self) -> int:
        return len(self._labels)

    def _relative(self, i: int) -> str:
        return self._blob[self._offsets[i]:self._offsets[i + 1]].decode("utf-8", "surrogateescape")

    def path(self, i: int) -> str:
        """The file of example ``i``."""
        return os.path.join(self.root, self._relative(i))

    def label(self, i: int) -> int:
        """The class index of example ``i``."""
        return int(self._labels[i])

    def image(self, i: int) -> Any:
        """The decoded image of example ``i`` (:func:`open_image`)."""
        return open_image(self.path(i))

    def subset(self, indices: Iterable[int]) -> ImageFiles:
        """The examples ``indices``, in that order."""
        idx = [int(i) for i in indices]
        return ImageFiles(self.root, self.classes, [self._relative(i) for i in idx], self._labels[idx])


@dataclass(frozen=True)
class Unreadable:
    """An image file that could not be decoded: what a worker returns instead of raising."""

    path: str
    error: str


def _unreadable(name: str, err: BaseException, stream: Any = None) -> Unreadable:
    text = str(err) if stream is None else str(err).replace(repr(stream), repr(name))
    first = text.splitlines()[0][:120] if text else ""
    return Unreadable(name, f"{type(err).__name__}: {first}")


def open_image(path: str) -> Any:
    """The image of ``path`` as an RGB PIL image, or an :class:`Unreadable` saying why not."""
    from PIL import Image

    try:
        with open(path, "rb") as f:
            return Image.open(f).convert("RGB")
    # PIL: not an image, truncated. ImportError: with Ultralytics imported, PIL's Image.open
    # is patched to fall back to a HEIF plugin, which may not be installed
    except (OSError, ValueError, SyntaxError, ImportError) as err:
        return _unreadable(path, err)


def decode_image(data: bytes, name: str) -> Any:
    """The encoded image ``data`` (JPEG, PNG, WebP, ...) as an RGB PIL image, or an
    :class:`Unreadable` of ``name`` saying why not."""
    from PIL import Image

    stream = io.BytesIO(data)
    try:
        return Image.open(stream).convert("RGB")
    except (OSError, ValueError, SyntaxError, ImportError) as err:  # as in open_image
        return _unreadable(name, err, stream)


def _seeded(transform: Callable[[Any], Any], image: Any, seed: int) -> Any:
    """``transform(image)`` with python's, numpy's and torch's CPU generators seeded with
    ``seed``; their states are restored after (the training process's draws are untouched
    when it decodes in-process)."""
    py, npy, th = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.random.default_generator.manual_seed(seed)
    try:
        return transform(image)
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        torch.random.set_rng_state(th)


class ImageDataset(torch.utils.data.Dataset):
    """Decode-on-access examples ``(image tensor, label)`` of :class:`ImageFiles` (or any
    :class:`ImageSource`).

    ``dataset[i]`` applies ``transform`` as it is; ``dataset[(i, seed)]`` applies it with the
    global generators seeded by ``seed`` (a random augmentation fixed by the seed). A file
    PIL cannot read gives an :class:`Unreadable` instead of the pair.
    """

    def __init__(self, files: ImageSource, transform: Callable[[Any], Any]) -> None:
        self.files = files
        self.transform = transform

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, item: int | tuple[int, int]) -> tuple[torch.Tensor, int] | Unreadable:
        index, seed = item if isinstance(item, tuple) else (item, None)
        image = self.files.image(index)
        if isinstance(image, Unreadable):
            return image
        x = self.transform(image) if seed is None else _seeded(self.transform, image, seed)
        return x.as_subclass(torch.Tensor), self.files.label(index)


def collate_images(items: list[Any]) -> tuple[torch.Tensor, torch.Tensor] | Unreadable:
    """``(images B x C x H x W, labels B)`` of ``(image, label)`` items; the first
    :class:`Unreadable` among them when there is one."""
    for item in items:
        if isinstance(item, Unreadable):
            return item
    xs = [x for x, _ in items]  # type: ignore[misc]
    return torch.stack(xs), torch.tensor([y for _, y in items], dtype=torch.long)  # type: ignore[misc]


def default_workers() -> int:
    """Loader workers per process: the cores this process may use (``sched_getaffinity``),
    divided among the torchrun processes of the node (``LOCAL_WORLD_SIZE``), at least 1 and
    at most 16."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    per_node = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, min(MAX_DEFAULT_WORKERS, cores // per_node))


def _quiet_worker(worker_id: int) -> None:
    """Loader workers ignore SIGINT / SIGTERM: a Ctrl-C (sent to the whole process group) or a
    scheduler's SIGTERM is the training process's to handle (checkpoint, then stop); it
    shuts the workers down."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def image_loader(dataset: ImageDataset, batch_sampler: Iterable[list[Any]] | None = None,
                 batch_size: int | None = None, indices: Iterable[int] | None = None, workers: int = 0,
                 pin_memory: bool = False) -> torch.utils.data.DataLoader:
    """A DataLoader over ``dataset``: batches of ``batch_sampler`` (index lists), or of
    ``batch_size`` consecutive ``indices`` (default: all, in order). ``workers`` processes
    decode (0: this process), each :data:`PREFETCH` batches ahead; ``pin_memory`` for CUDA."""
    kw: dict[str, Any] = {"num_workers": workers, "collate_fn": collate_images, "pin_memory": pin_memory,
                          # the workers' base seed comes from this generator, not torch's global one
                          "generator": torch.Generator().manual_seed(0)}
    if workers:
        kw.update(prefetch_factor=PREFETCH, worker_init_fn=_quiet_worker)
    if batch_sampler is not None:
        return torch.utils.data.DataLoader(dataset, batch_sampler=batch_sampler, **kw)
    order = range(len(dataset)) if indices is None else indices
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size or 1,
                                       sampler=order, **kw)  # type: ignore[arg-type]
