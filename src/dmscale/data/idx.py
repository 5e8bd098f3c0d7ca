"""Offline MNIST: a reader and writer for IDX files and the bundled copy of MNIST.

IDX is the file format of the original MNIST distribution: a 4-byte magic number
(two zero bytes, a type code, the number of dimensions), one big-endian uint32 per
dimension, then the data in C order, big-endian. Files may be gzip-compressed; the reader
tells by the content, not by the name.

Where MNIST itself (60,000 training and 10,000 test digits, the original files) comes from
is :mod:`dmscale.data.mnist`.

Example:
    >>> import os, tempfile
    >>> import numpy as np
    >>> from dmscale.data.idx import read_idx, write_idx
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     path = os.path.join(tmp, "labels-idx1-ubyte.gz")
    ...     write_idx(path, np.array([5, 0, 4], dtype=np.uint8))
    ...     read_idx(path)
    array([5, 0, 4], dtype=uint8)
"""

from __future__ import annotations

import gzip
import math
import os
from pathlib import Path
from typing import BinaryIO

import numpy as np

from dmscale.core.errors import ConfigError, DataError, MissingFileError

__all__ = [
    "MNIST_MEAN",
    "MNIST_STD",
    "MNIST_FILES",
    "read_idx",
    "write_idx",
    "load_mnist_dir",
]

PathLike = str | os.PathLike[str]

MNIST_MEAN = 0.1307
"""Mean pixel value of the MNIST training images scaled to [0, 1]."""
MNIST_STD = 0.3081
"""Standard deviation of the MNIST training images scaled to [0, 1]."""

MNIST_FILES: dict[str, str] = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
"""The usual base names of the four MNIST files, keyed as :func:`load_mnist_dir` returns them."""

_GZIP_MAGIC = b"\x1f\x8b"

# IDX type code -> big-endian numpy dtype (the format stores every multi-byte value MSB first)
_IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_IDX_CODES: dict[np.dtype, int] = {
    dtype.newbyteorder("="): code for code, dtype in _IDX_DTYPES.items()
}


def _open(path: Path) -> BinaryIO:
    """Open ``path`` for binary reading, transparently un-gzipping it."""
    with open(path, "rb") as raw:
        magic = raw.read(2)
    if magic == _GZIP_MAGIC:
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return open(path, "rb")


def _read_exact(stream: BinaryIO, size: int, path: Path, what: str) -> bytes:
    try:
        data = stream.read(size)
    except (EOFError, OSError) as err:  # a truncated or corrupt gzip stream
        raise DataError(f"{path}: corrupt or truncated gzip file ({err}): download it again") from None
    if len(data) != size:
        raise DataError(
            f"{path}: truncated IDX file: expected {size} bytes of {what}, got {len(data)}; "
            "download it again"
        )
    return data


def read_idx(path: PathLike, max_items: int | None = None) -> np.ndarray:
    """Read an IDX file (gzip-compressed or raw) into an array in native byte order.

    Args:
        path: the file.
        max_items: read only the first ``max_items`` entries along the first dimension
            (cheap: the rest of the file is not read). None reads everything.

    Returns:
        An array with the file's shape (first dimension cut to ``max_items``) and dtype.

    Raises:
        DataError (a ValueError): the magic number is not an IDX one, the dtype code is unknown, or the
            file holds less data than its header declares.

    Example:
        >>> import tempfile
        >>> with tempfile.NamedTemporaryFile(suffix="-idx2-ubyte") as f:
        ...     _ = f.write(bytes([0, 0, 0x08, 2, 0, 0, 0, 2, 0, 0, 0, 3, 1, 2, 3, 4, 5, 6]))
        ...     f.flush()
        ...     read_idx(f.name)
        array([[1, 2, 3],
               [4, 5, 6]], dtype=uint8)
    """
    path = Path(path)
    if max_items is not None and max_items < 0:
        raise ConfigError(f"max_items must be None or >= 0, got {max_items}")
    with _open(path) as stream:
        magic = _read_exact(stream, 4, path, "magic number")
        zeros, code, ndim = magic[:2], magic[2], magic[3]
        if zeros != b"\x00\x00" or code not in _IDX_DTYPES:
            raise DataError(
                f"{path}: not an IDX file: expected a magic number 00 00 <type> <ndim> with "
                f"type in {{{', '.join(f'{c:#04x}' for c in _IDX_DTYPES)}}}, got {magic.hex(' ')}"
            )
        header = _read_exact(stream, 4 * ndim, path, f"{ndim} dimension sizes")
        shape = [int(d) for d in np.frombuffer(header, dtype=">u4")]
        if max_items is not None and shape:
            shape[0] = min(shape[0], max_items)
        dtype = _IDX_DTYPES[code]
        size = math.prod(shape) * dtype.itemsize
        data = _read_exact(stream, size, path, f"data for shape {tuple(shape)}")
    return np.frombuffer(data, dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="))


def write_idx(path: PathLike, array: np.ndarray) -> None:
    """Write ``array`` as an IDX file, gzip-compressed when ``path`` ends with ``.gz``.

    Supported dtypes: uint8, int8, int16, int32, float32, float64 (the IDX types).

    Example:
        >>> import tempfile
        >>> with tempfile.NamedTemporaryFile(suffix=".gz") as f:
        ...     write_idx(f.name, np.eye(2, dtype=np.float32))
        ...     read_idx(f.name)
        array([[1., 0.],
               [0., 1.]], dtype=float32)
    """
    array = np.asarray(array)
    native = array.dtype.newbyteorder("=")
    if native not in _IDX_CODES:
        supported = ", ".join(str(d) for d in _IDX_CODES)
        raise TypeError(f"IDX cannot store dtype {array.dtype}: expected one of {supported}")
    if array.ndim > 255:
        raise DataError(f"IDX stores at most 255 dimensions, got {array.ndim}")
    code = _IDX_CODES[native]
    header = bytes([0, 0, code, array.ndim]) + np.asarray(array.shape, dtype=">u4").tobytes()
    payload = header + np.ascontiguousarray(array, dtype=_IDX_DTYPES[code]).tobytes()
    path = Path(path)
    if path.name.endswith(".gz"):
        with gzip.open(path, "wb") as f:
            f.write(payload)
    else:
        path.write_bytes(payload)


def _find_mnist_file(directory: Path, base: str) -> Path:
    """The file for ``base`` in ``directory``: raw or ``.gz``, with ``-idx`` or ``.idx``."""
    stems = [base, base.replace("-idx", ".idx")]
    candidates = [directory / (stem + suffix) for stem in stems for suffix in ("", ".gz")]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    names = ", ".join(c.name for c in candidates)
    raise MissingFileError(f"{directory}: no MNIST file for {base!r}: expected one of {names}")


def load_mnist_dir(
    path: PathLike, max_items: dict[str, int] | None = None
) -> dict[str, np.ndarray]:
    """Read the four MNIST IDX files of a directory.

    Files are found by their usual names (``train-images-idx3-ubyte``,
    ``t10k-labels-idx1-ubyte``, ...), raw or gzip-compressed.

    Args:
        path: the directory.
        max_items: optional per-key limits (keys of :data:`MNIST_FILES`) passed to
            :func:`read_idx`.

    Returns:
        ``{"train_images": uint8 N x 28 x 28, "train_labels": uint8 N, "test_images": ...,
        "test_labels": ...}``.

    Raises:
        MissingFileError (a FileNotFoundError): a file is missing.
        DataError (a ValueError): images are not 3-D, labels not 1-D, or their counts differ.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     for key, base in MNIST_FILES.items():
        ...         shape = (3, 28, 28) if key.endswith("images") else (3,)
        ...         write_idx(Path(tmp) / (base + ".gz"), np.zeros(shape, dtype=np.uint8))
        ...     {key: a.shape for key, a in load_mnist_dir(tmp).items()}
        {'train_images': (3, 28, 28), 'train_labels': (3,),
         'test_images': (3, 28, 28), 'test_labels': (3,)}
    """
    directory = Path(path)
    if not directory.is_dir():
        raise MissingFileError(f"MNIST directory does not exist: {directory}: pass the folder "
                               "holding the four MNIST IDX files")
    limits = max_items or {}
    unknown = set(limits) - set(MNIST_FILES)
    if unknown:
        raise KeyError(
            f"unknown max_items keys {sorted(unknown)}: expected keys of {list(MNIST_FILES)}"
        )
    arrays = {
        key: read_idx(_find_mnist_file(directory, base), limits.get(key))
        for key, base in MNIST_FILES.items()
    }
    for split in ("train", "test"):
        images, labels = arrays[f"{split}_images"], arrays[f"{split}_labels"]
        if images.ndim != 3 or labels.ndim != 1:
            raise DataError(
                f"{directory}: {split} images must be 3-D and labels 1-D, "
                f"got shapes {images.shape} and {labels.shape}"
            )
        if len(images) != len(labels):
            raise DataError(
                f"{directory}: {split} set has {len(images)} images but {len(labels)} labels"
            )
    return arrays
