"""WebDataset tar shards read by random access: an index of every shard's members, built once
at the start with the standard ``tarfile`` module, and one image read per access.

A shard is a plain (uncompressed) tar in WebDataset's layout: the files of one example share a
key (the member name up to the first dot of its base name) and follow each other, ``KEY.jpg``
(or ``.jpeg``, ``.png``, ``.webp``) holds the image and ``KEY.cls`` its class index as text;
other members (``KEY.json``, ...) are ignored. ``tar``, Python's ``tarfile`` and WebDataset's
``TarWriter`` / ``ShardWriter`` write it.

* :func:`shard_paths`: the shards of ``--data``: a ``.tar`` file, a brace pattern
  (``train-{000000..000009}.tar``, WebDataset's notation; ``{a,b}`` lists too), a glob, or a
  directory of ``.tar`` files (sorted by name).
* :class:`ShardFiles`: the examples of a list of shards as compact arrays (shard number, byte
  offset and size of the image member, label; the member names as one bytes string): a few
  dozen bytes per image and no Python object per image, as :class:`~dmscale.data.images.ImageFiles`.
  ``image(i)`` opens the shard, reads the image's bytes at their offset and decodes them
  (in whichever loader worker asks; nothing is held open), so :class:`~dmscale.data.images.ImageDataset`,
  the order of :mod:`dmscale.data.order` and the loader work on shards unchanged.

Example:
    >>> import io, tarfile, tempfile
    >>> from pathlib import Path
    >>> from PIL import Image
    >>> root = Path(tempfile.mkdtemp())
    >>> for s in range(2):
    ...     with tarfile.open(root / f"train-{s:06d}.tar", "w") as tar:
    ...         for k in range(3):
    ...             png = io.BytesIO()
    ...             Image.new("RGB", (8, 8), (80 * k, 0, 0)).save(png, format="PNG")
    ...             for name, data in ((f"{s}_{k}.png", png.getvalue()), (f"{s}_{k}.cls", str(k % 2).encode())):
    ...                 info = tarfile.TarInfo(name)
    ...                 info.size = len(data)
    ...                 tar.addfile(info, io.BytesIO(data))
    >>> [p.name for p in shard_paths(str(root / "train-{000000..000001}.tar"))]
    ['train-000000.tar', 'train-000001.tar']
    >>> files = ShardFiles.from_shards(root)
    >>> len(files), files.classes, [files.label(i) for i in range(6)]
    (6, ['0', '1'], [0, 1, 0, 0, 1, 0])
    >>> files.path(4).endswith("train-000001.tar:1_1.png"), files.image(4).getpixel((0, 0))
    (True, (80, 0, 0))
"""

from __future__ import annotations

import copy
import glob
import re
import tarfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from dmscale.core.errors import ConfigError, DataError
from dmscale.data.images import Unreadable, decode_image

__all__ = ["IMAGE_EXTENSIONS", "SHARD_HINT", "ShardFiles", "expand_braces", "index_shard", "is_shard_data",
           "shard_paths"]

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
LABEL_EXTENSION = "cls"
SHARD_HINT = ("Expected WebDataset tar shards: a .tar file, a brace pattern like "
              "'train-{000000..000009}.tar', a glob, or a directory of .tar files, each tar holding "
              "KEY.jpg (or .jpeg, .png, .webp) with KEY.cls, the class index as text")
INDEX_THREADS = 8  # shards indexed at once (the reads overlap on network file systems)
_KEY = re.compile(r"^((?:.*/)?[^./][^/]*?)\.([^/]*)$")  # WebDataset's key and extension split
_BLOCK = 512


# ----------------------------------------------------------------------------- locating
def expand_braces(pattern: str) -> list[str]:
    """``pattern`` with every ``{A..B}`` (integers, zero-padded to the wider bound) and
    ``{x,y,...}`` expanded, left to right (WebDataset's and bash's notation).

    >>> expand_braces("s-{08..10}-{a,b}.tar")
    ['s-08-a.tar', 's-08-b.tar', 's-09-a.tar', 's-09-b.tar', 's-10-a.tar', 's-10-b.tar']
    """
    depth, start = 0, -1
    for i, ch in enumerate(pattern):
        if ch == "{":
            depth, start = depth + 1, i if depth == 0 else start
        elif ch == "}" and depth:
            depth -= 1
            if depth == 0:
                body, rest = pattern[start + 1:i], pattern[i + 1:]
                head = pattern[:start]
                return [head + choice + tail for choice in _choices(body) for tail in expand_braces(rest)]
    return [pattern]


def _choices(body: str) -> list[str]:
    ends = re.fullmatch(r"(-?\d+)\.\.(-?\d+)", body)
    if ends:
        a, b = ends.groups()
        # zero-padded as bash and braceexpand do: only when a bound of two or more digits starts with 0
        padded = any(len(e.lstrip("-")) > 1 and e.lstrip("-").startswith("0") for e in (a, b))
        width = max(len(a), len(b)) if padded else 0
        lo, hi = int(a), int(b)
        step = 1 if hi >= lo else -1
        return [f"{v:0{width}d}" for v in range(lo, hi + step, step)]
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(body):
        depth += (ch == "{") - (ch == "}")
        if ch == "," and depth == 0:
            parts.append(body[start:i])
            start = i + 1
    parts.append(body[start:])
    if len(parts) == 1:
        return ["{" + body + "}"]  # not a brace expression: literal, as in bash
    return [e for part in parts for e in expand_braces(part)]


def _is_pattern(spec: str) -> bool:
    return any(ch in spec for ch in "{*?[")


def _tars(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix == ".tar" and p.is_file())


def is_shard_data(spec: str | Path) -> bool:
    """Whether ``spec`` names tar shards (:func:`shard_paths`) rather than a folder of class
    folders: a ``.tar`` file or pattern, or a directory holding ``.tar`` files, directly or in
    its ``train/`` subfolder."""
    spec = str(spec)
    if _is_pattern(spec) or spec.endswith(".tar"):
        return True
    path = Path(spec)
    return path.is_dir() and (bool(_tars(path)) or ((path / "train").is_dir() and bool(_tars(path / "train"))))


def shard_paths(spec: str | Path) -> list[Path]:
    """The shard files ``spec`` names (see the module text), in order.

    Raises:
        ConfigError: a named shard does not exist, a glob or a directory has no ``.tar`` file.
    """
    spec = str(spec)
    path = Path(spec)
    if not _is_pattern(spec) and path.is_dir():
        found = _tars(path)
        if not found:
            raise ConfigError(f"--data {spec}: no .tar file in the directory. {SHARD_HINT}")
        return found
    paths: list[Path] = []
    for name in expand_braces(spec):
        if any(ch in name for ch in "*?["):
            matched = sorted(glob.glob(name))
            if not matched:
                raise ConfigError(f"--data {spec}: no file matches {name}. {SHARD_HINT}")
            paths += [Path(m) for m in matched]
        else:
            paths.append(Path(name))
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ConfigError(f"--data {spec}: {len(missing)} of its {len(paths)} shards do not exist: "
                          f"{', '.join(missing[:3])}{more}; check the pattern and the directory")
    return paths


# ----------------------------------------------------------------------------- indexing
def index_shard(path: str | Path) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """The examples of one shard: image member names, their data offsets and sizes, labels.

    Raises:
        DataError: the shard is compressed, not a tar, truncated or corrupt; an example has an
            image but no ``.cls`` (or the reverse), two images, or a label that is not a
            non-negative integer. The message names the shard and the member.
    """
    path = Path(path)
    names: list[str] = []
    rows: list[tuple[int, int, int]] = []
    size = path.stat().st_size
    with open(path, "rb") as f:
        if f.read(2) == b"\x1f\x8b":
            raise DataError(f"shard {path}: gzip-compressed, expected a plain tar (random access reads "
                            "members at their offsets); decompress the shards (gunzip) and name the .tar files")
        f.seek(0)
        try:
            tar = tarfile.open(fileobj=f, mode="r:")
        except tarfile.ReadError as err:
            raise DataError(f"shard {path}: not a tar file ({err}). {SHARD_HINT}") from None
        sample = _Sample(path)
        last = "(the start)"
        seen: set[str] = set()  # keys of this shard's finished examples
        try:
            for member in tar:
                if member.offset_data + member.size > size:
                    raise DataError(f"shard {path}: truncated: member {member.name} needs bytes up to "
                                    f"{member.offset_data + member.size:,}, the file has {size:,}; "
                                    "write the shard again")
                last = member.name
                if not member.isfile():
                    continue
                match = _KEY.match(member.name)
                if match is None:
                    continue
                key, ext = match.group(1), match.group(2).lower()
                if key != sample.key:
                    sample.add_to(names, rows)
                    if key in seen:
                        raise DataError(f"shard {path}: the members of example {key} are not next to each "
                                        f"other ({member.name} comes after other keys); write each key's "
                                        "members together, as WebDataset's TarWriter does")
                    seen.add(key)
                    sample = _Sample(path, key)
                if ext in IMAGE_EXTENSIONS:
                    sample.set_image(member)
                elif ext == LABEL_EXTENSION:
                    sample.set_label(member, tar.extractfile(member).read())  # type: ignore[union-attr]
            sample.add_to(names, rows)
            f.seek(tar.offset)
            end = f.read(_BLOCK)
        except tarfile.TarError as err:
            raise DataError(f"shard {path}: corrupt after member {last} ({err}); write the shard again") from None
        finally:
            tar.close()
    if end != bytes(_BLOCK):  # tarfile stops quietly at a cut or broken header
        what = "ends without the end-of-archive blocks (truncated)" if len(end) < _BLOCK else "has an invalid header"
        raise DataError(f"shard {path}: {what} at byte {tar.offset:,}, after member {last}; write the shard again")
    table = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
    return names, table[:, 0].copy(), table[:, 1].copy(), table[:, 2].copy()


class _Sample:
    """The members of one key as they are read: its image member and its label."""

    def __init__(self, shard: Path, key: str | None = None) -> None:
        self.shard, self.key = shard, key
        self.image: tarfile.TarInfo | None = None
        self.label: int | None = None
        self.label_member = ""

    def set_image(self, member: tarfile.TarInfo) -> None:
        if self.image is not None:
            raise DataError(f"shard {self.shard}: example {self.key} has two images, {self.image.name} and "
                            f"{member.name}; keep one image per key")
        self.image = member

    def set_label(self, member: tarfile.TarInfo, data: bytes) -> None:
        if self.label is not None:
            raise DataError(f"shard {self.shard}: example {self.key} has two labels, {self.label_member} and "
                            f"{member.name}; keep one label per key")
        text = data.decode("utf-8", "replace").strip()
        if not re.fullmatch(r"\d+", text):
            raise DataError(f"shard {self.shard}: member {member.name} holds {text[:40]!r}, expected the class "
                            "index as a non-negative integer")
        self.label, self.label_member = int(text), member.name

    def add_to(self, names: list[str], rows: list[tuple[int, int, int]]) -> None:
        if self.image is None and self.label is None:
            return  # no example (metadata only, or the start)
        if self.image is None:
            raise DataError(f"shard {self.shard}: member {self.label_member} labels example {self.key}, which "
                            f"has no image; expected {self.key}.jpg (or {', '.join(IMAGE_EXTENSIONS[1:])}) "
                            "next to it")
        if self.label is None:
            raise DataError(f"shard {self.shard}: member {self.image.name} has no label; expected "
                            f"{self.key}.{LABEL_EXTENSION} (the class index as text) next to it")
        names.append(self.image.name)
        rows.append((self.image.offset_data, self.image.size, self.label))


# ----------------------------------------------------------------------------- the examples
class ShardFiles:
    """The examples of some tar shards: where each image's bytes are, and its label.

    Build it with :meth:`from_shards`; :meth:`subset` picks examples by index. Classes are the
    labels' indices as strings, ``'0' .. str(max label)``.
    """

    unreadable_fix = "write the shard again with a readable image (or without this example)"

    def __init__(self, root: str, paths: Sequence[Path], shard: Any, offset: Any, size: Any, labels: Any,
                 names: Sequence[str], classes: list[str] | None = None) -> None:
        encoded = [n.encode("utf-8", "surrogateescape") for n in names]
        self.root = root
        self.paths = [str(p) for p in paths]
        self._shard = np.asarray(shard, dtype=np.int32)
        self._offset = np.asarray(offset, dtype=np.int64)
        self._size = np.asarray(size, dtype=np.int64)
        self._labels = np.asarray(labels, dtype=np.int64)
        self._blob = b"".join(encoded)
        self._name_offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(e) for e in encoded], out=self._name_offsets[1:])
        top = int(self._labels.max()) + 1 if len(self._labels) else 0
        self.classes = list(classes) if classes is not None else [str(c) for c in range(top)]

    @classmethod
    def from_shards(cls, spec: str | Path) -> ShardFiles:
        """The examples of the shards ``spec`` names (:func:`shard_paths`), in shard order and
        tar order within a shard; the shards are indexed in :data:`INDEX_THREADS` threads."""
        paths = shard_paths(spec)
        with ThreadPoolExecutor(max_workers=min(INDEX_THREADS, len(paths))) as pool:
            tables = list(pool.map(index_shard, paths))
        names = [n for t in tables for n in t[0]]
        shard = np.concatenate([np.full(len(t[0]), s, dtype=np.int32) for s, t in enumerate(tables)])
        return cls(str(spec), paths, shard, *(np.concatenate([t[k] for t in tables]) for k in (1, 2, 3)), names)

    def __len__(self) -> int:
        return len(self._labels)

    def _name(self, i: int) -> str:
        return self._blob[self._name_offsets[i]:self._name_offsets[i + 1]].decode("utf-8", "surrogateescape")

    def path(self, i: int) -> str:
        """Where example ``i``'s image is: ``SHARD:MEMBER``."""
        return f"{self.paths[self._shard[i]]}:{self._name(i)}"

    def label(self, i: int) -> int:
        """The class index of example ``i``."""
        return int(self._labels[i])

    def image(self, i: int) -> Any:
        """Example ``i``'s image as an RGB PIL image, read from its shard, or an
        :class:`~dmscale.data.images.Unreadable` naming the shard and the member."""
        offset, size = int(self._offset[i]), int(self._size[i])
        try:
            with open(self.paths[self._shard[i]], "rb") as f:
                f.seek(offset)
                data = f.read(size)
        except OSError as err:
            return Unreadable(self.path(i), f"{type(err).__name__}: {err}")
        if len(data) != size:
            return Unreadable(self.path(i), f"the shard ends {size - len(data):,} bytes early: it changed "
                                            "after the run indexed it")
        return decode_image(data, self.path(i))

    def subset(self, indices: Iterable[int]) -> ShardFiles:
        """The examples ``indices``, in that order (the classes kept)."""
        idx = np.asarray([int(i) for i in indices], dtype=np.int64)
        return ShardFiles(self.root, [Path(p) for p in self.paths], self._shard[idx], self._offset[idx],
                          self._size[idx], self._labels[idx], [self._name(int(i)) for i in idx], self.classes)

    def with_classes(self, classes: list[str]) -> ShardFiles:
        """The same examples with the class list ``classes`` (two splits made to agree)."""
        other = copy.copy(self)  # the arrays are shared: neither changes them
        other.classes = list(classes)
        return other

    def __repr__(self) -> str:
        return f"ShardFiles({self.root!r}: {len(self):,} images in {len(self.paths)} shards)"
