"""Plain UTF-8 text files for ``--task text``: the files of ``--data``, read as one byte stream.

A file or every file under a directory (recursively, sorted by path, hidden and empty files
skipped) is read in line-aligned chunks of about :data:`CHUNK_BYTES`; the files are
concatenated as they are, nothing is put between them. The last 10 % of the bytes (from the
next line break on) is the held-out split. A file that is not UTF-8 is refused by name and
byte offset (:func:`not_text_error`).

Example:
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (d / "a.txt").write_text("one line\\n" * 10 + "the end\\n")
    >>> [p.name for p in text_files(str(d))]
    ['a.txt']
    >>> train, test = split_stream(text_files(str(d)))
    >>> len(b"".join(train)) + len(b"".join(test)) == (d / "a.txt").stat().st_size
    True
    >>> b"".join(test)
    b'the end\\n'
"""

from __future__ import annotations

import codecs
from pathlib import Path
from typing import Iterator

from dmscale.core.errors import ConfigError, DataError

__all__ = ["text_files", "visible_files", "first_non_utf8", "not_text_error", "text_chunks",
           "split_text_chunks", "split_stream", "CHUNK_BYTES", "HELD_OUT"]

HELD_OUT = 0.1  # the fraction held out for evaluation (of the bytes, or of the documents)
CHUNK_BYTES = 1 << 20  # read and tokenised at a time


def visible_files(p: Path) -> list[Path]:
    """The files under the directory ``p``, recursively, sorted by path, hidden ones skipped."""
    return sorted(f for f in p.rglob("*") if f.is_file()
                  and not any(part.startswith(".") for part in f.relative_to(p).parts))


def text_files(data: str | None) -> list[Path]:
    """The text files of ``--data`` (a file or a directory), or the bundled Shakespeare.

    Raises:
        ConfigError: the path does not exist or holds no non-empty file.
    """
    if data is None:
        from dmscale.data.shakespeare import shakespeare_files

        return shakespeare_files()
    p = Path(data).expanduser()
    if p.is_file():
        files = [p]
    elif p.is_dir():
        files = visible_files(p)
    else:
        raise ConfigError(f"--data {data}: no such file or directory (give a text file or a "
                          "directory of text files)")
    files = [f for f in files if f.stat().st_size > 0]
    if not files:
        raise ConfigError(f"--data {data}: no non-empty files (empty files and hidden files are skipped); "
                          "give a UTF-8 text file or a directory that holds some")
    return files




def first_non_utf8(files: list[Path]) -> tuple[Path, int, str] | None:
    """``(file, byte offset, reason)`` of the first byte that is not UTF-8 text, or None."""
    for f in files:
        decoder = codecs.getincrementaldecoder("utf-8")()
        offset = 0
        with open(f, "rb") as fh:
            while block := fh.read(CHUNK_BYTES):
                try:
                    decoder.decode(block)
                except UnicodeDecodeError as err:
                    return f, offset + err.start, err.reason
                offset += len(block)
            pending = len(decoder.getstate()[0])  # the bytes of a character cut off at the end
            try:
                decoder.decode(b"", final=True)
            except UnicodeDecodeError as err:
                return f, offset - pending + err.start, err.reason
    return None


def not_text_error(files: list[Path]) -> DataError:
    """The error for text files of which one is not UTF-8: names the file and the byte."""
    found = first_non_utf8(files)
    if found is None:  # cannot happen: a chunk failed to decode, so some file does
        return DataError("the --data files are not UTF-8 text: convert them to UTF-8")
    f, offset, reason = found
    with open(f, "rb") as fh:
        head = fh.read(4)
    kind = (" (it is gzip-compressed: decompress it)" if head[:2] == b"\x1f\x8b" else
            " (it is a zip archive: extract it)" if head[:2] == b"PK" else "")
    return DataError(f"{f} is not UTF-8 text: byte {offset} ({reason}){kind}; give plain UTF-8 text "
                     "files (convert it, e.g. iconv -t utf-8, or remove it from --data)")


def text_chunks(files: list[Path]) -> Iterator[bytes]:
    """Line-aligned chunks of about :data:`CHUNK_BYTES` of the concatenated files."""
    for f in files:
        with open(f, "rb") as fh:
            rest = b""
            while True:
                block = fh.read(CHUNK_BYTES)
                if not block:
                    break
                block = rest + block
                cut = block.rfind(b"\n") + 1
                if cut == 0:
                    rest = block
                    continue
                rest = block[cut:]
                yield block[:cut]
            if rest:
                yield rest


def split_stream(files: list[Path], held_out: float = HELD_OUT) -> tuple[list[bytes], list[bytes]]:
    """Split the files' byte stream into (train, test) chunks at the first line break after
    ``1 - held_out`` of the bytes (kept in memory: for tests and small data)."""
    train, test = [], []
    for part, chunk in split_text_chunks(files, held_out):
        (train if part == "train" else test).append(chunk)
    return train, test


def split_text_chunks(files: list[Path], held_out: float = HELD_OUT) -> Iterator[tuple[str, bytes]]:
    """``("train" | "test", chunk)`` of the files' byte stream, split as :func:`split_stream`."""
    total = sum(f.stat().st_size for f in files)
    split_at = int(total * (1.0 - held_out))
    seen = 0
    for chunk in text_chunks(files):
        if seen >= split_at:
            yield "test", chunk
        elif seen + len(chunk) <= split_at:
            yield "train", chunk
        else:  # the split falls inside this chunk: cut after the next line break
            nl = chunk.find(b"\n", split_at - seen)
            cut = len(chunk) if nl < 0 else nl + 1
            yield "train", chunk[:cut]
            if chunk[cut:]:
                yield "test", chunk[cut:]
        seen += len(chunk)
