"""The inputs of ``--task text``: plain text files, JSON Lines, Parquet, saved HF datasets.

:func:`resolve_source` turns ``--data PATH`` into a :class:`TextSource`:

- ``*.jsonl``: one JSON object per line (blank lines skipped), the text in the field
  ``--text-field`` (default ``text``);
- ``*.parquet``: the column ``--text-field``, read batch by batch with pyarrow
  (``pip install dmscale[text]``);
- a directory written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk`` (it holds
  ``state.json`` or ``dataset_dict.json``): the column ``--text-field`` of its Arrow files, read
  memory-mapped with pyarrow (the ``datasets`` package is not needed); of a ``DatasetDict``
  the ``train`` split, or its only split;
- a directory of ``.jsonl`` / ``.parquet`` files (recursively, sorted by path, hidden files
  skipped): those files; other files beside them (a README) are skipped and named;
- anything else: plain UTF-8 text files, read as one byte stream (:func:`text_files`).

Every record of the structured formats is one document. :func:`split_documents` streams
the documents in batches of about :data:`CHUNK_BYTES` and holds out the last 10 % of them
(at least one); nothing reads a whole file at once. The text files' stream is split at the
first line break after 90 % of its bytes (:func:`split_text_chunks`).

Example:
    >>> import json, tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> rows = [{"text": f"story {i}", "id": i} for i in range(10)]
    >>> _ = (d / "a.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in rows))
    >>> src = resolve_source(str(d / "a.jsonl"))
    >>> src.format, count_documents(src)
    ('jsonl', 10)
    >>> [(part, len(docs)) for part, docs in split_documents(src)]
    [('train', 9), ('test', 1)]
    >>> list(iter_documents(src))[-1]
    'story 9'
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from dmscale.core.errors import ConfigError, DataError, MissingDependencyError
from dmscale.data.text_files import CHUNK_BYTES, HELD_OUT, text_files, visible_files

__all__ = ["TextSource", "resolve_source", "count_documents", "iter_documents", "split_documents",
           "RECORD_SUFFIXES", "TEXT_EXTRA"]

BATCH_ROWS = 1024  # rows per Parquet batch
RECORD_SUFFIXES = {".jsonl": "jsonl", ".parquet": "parquet"}  # files read as records by suffix
TEXT_EXTRA = "pip install dmscale[text]"


@dataclass(frozen=True)
class TextSource:
    """What ``--data`` holds: its format, its files in reading order and the text field.

    ``format`` is ``text``, ``jsonl``, ``parquet``, ``jsonl+parquet`` (a directory of both) or
    ``hf-dataset``; ``split`` is the split read of a saved ``DatasetDict``, ``splits`` all of
    them; ``skipped`` the files of a directory that were not read.
    """

    format: str
    files: tuple[Path, ...]
    text_field: str = "text"
    data: str | None = None
    split: str | None = None
    splits: tuple[str, ...] = ()
    skipped: tuple[Path, ...] = ()

    @property
    def documents(self) -> bool:
        """Whether the source is a sequence of documents (every format but ``text``)."""
        return self.format != "text"

    def key(self) -> str:
        """The lines the token cache's key hashes: the format, the text field and the split
        (not for text files), then every file's resolved path, size and mtime."""
        head = "" if not self.documents else f"{self.format}\t{self.text_field}\t{self.split}\n"
        lines = []
        for f in self.files:
            st = f.stat()
            lines.append(f"{f.resolve()}\t{st.st_size}\t{st.st_mtime_ns}\n")
        return head + "".join(lines)

    def describe(self) -> str:
        """Where the text comes from, in words."""
        if self.data is None:
            return "the bundled Shakespeare"
        if self.format == "hf-dataset":
            split = "" if self.split is None else f"the {self.split!r} split of "
            others = f" (splits: {', '.join(self.splits)})" if len(self.splits) > 1 else ""
            where = f"{split}the saved dataset {self.data}{others}"
        elif len(self.files) == 1:
            where = str(self.files[0])
        else:
            kind = "" if self.format == "text" else "." + self.format.replace("+", "/.") + " "
            where = f"{len(self.files)} {kind}files in {self.data}"
        if self.documents:
            where += f", field {self.text_field!r}"
        if self.skipped:
            names = ", ".join(f.name for f in self.skipped[:3]) + (", ..." if len(self.skipped) > 3 else "")
            where += f"; skipped {len(self.skipped)} other file(s): {names}"
        return where


def _read_json(path: Path) -> dict[str, Any]:
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise DataError(f"{path} cannot be read as JSON ({err}); save the dataset again with "
                        "save_to_disk") from None
    if not isinstance(found, dict):
        raise DataError(f"{path} holds a JSON {type(found).__name__}, not the object save_to_disk writes")
    return found


def _hf_dataset(p: Path, data: str, field: str) -> TextSource:
    """The saved dataset (``state.json``) or dataset dict (``dataset_dict.json``) at ``p``."""
    splits: tuple[str, ...] = ()
    split = None
    if (p / "dataset_dict.json").is_file():
        splits = tuple(_read_json(p / "dataset_dict.json").get("splits", []))
        if "train" in splits or len(splits) == 1:
            split = "train" if "train" in splits else splits[0]
        else:
            example = p / (splits or ("SPLIT",))[0]
            raise ConfigError(f"--data {data}: a saved DatasetDict with the splits "
                              f"{', '.join(splits) or '(none)'} and no 'train': give the directory "
                              f"of one split, e.g. --data {example}")
        p = p / split
        if not (p / "state.json").is_file():
            raise DataError(f"{p}: the split {split!r} of {data} has no state.json: save the dataset again "
                            "with DatasetDict.save_to_disk")
    state = _read_json(p / "state.json")
    names = [d["filename"] for d in state.get("_data_files", [])] or sorted(f.name for f in p.glob("*.arrow"))
    files = tuple(p / n for n in names)
    for f in files:
        if not f.is_file():
            raise DataError(f"{f} is missing: {p / 'state.json'} lists it; copy the whole directory "
                            "that save_to_disk wrote")
    if not files:
        raise ConfigError(f"--data {data}: the saved dataset at {p} has no Arrow files")
    return TextSource("hf-dataset", files, field, data, split, splits)


def resolve_source(data: str | None, text_field: str = "text") -> TextSource:
    """The :class:`TextSource` of ``--data`` and ``--text-field`` (rules in the module doc).

    Raises:
        ConfigError: the path does not exist, holds nothing to read or is ambiguous.
    """
    if data is None:
        return TextSource("text", tuple(text_files(None)))
    p = Path(data).expanduser()
    if p.is_file():
        suffix = p.suffix.lower()
        if suffix == ".json":
            raise ConfigError(f"--data {data}: a .json file is ambiguous; for JSON Lines (one object "
                              "per line) name it .jsonl, a single JSON document is not read")
        if suffix in RECORD_SUFFIXES:
            return TextSource(RECORD_SUFFIXES[suffix], (p,), text_field, data)
    if p.is_dir() and ((p / "dataset_dict.json").is_file() or
                       ((p / "state.json").is_file() and (p / "dataset_info.json").is_file())):
        return _hf_dataset(p, data, text_field)
    if p.is_dir():
        visible = [f for f in visible_files(p) if f.stat().st_size > 0]
        records = [f for f in visible if f.suffix.lower() in RECORD_SUFFIXES]
        if records:
            kinds = "+".join(sorted({RECORD_SUFFIXES[f.suffix.lower()] for f in records}))
            chosen = set(records)
            skipped = tuple(f for f in visible if f not in chosen)
            return TextSource(kinds, tuple(records), text_field, data, skipped=skipped)
    return TextSource("text", tuple(text_files(data)), data=data)


# ----------------------------------------------------------------------- documents
def _pyarrow(f: Path) -> Any:
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise MissingDependencyError(f"reading {f} needs pyarrow, which is not installed: "
                                     f"{TEXT_EXTRA}") from None
    return pyarrow


def _text_value(value: Any, where: str, field: str) -> str:
    if isinstance(value, str):
        return value
    found = "null" if value is None else f"a {type(value).__name__}"
    raise DataError(f"{where}: the field {field!r} is {found}, not a string; choose the field that "
                    "holds the text with --text-field NAME, or drop the record")


def _missing(where: str, field: str, found: list[str]) -> DataError:
    keys = ", ".join(repr(k) for k in found[:20]) + (", ..." if len(found) > 20 else "")
    return DataError(f"{where}: no field {field!r} (found: {keys or 'none'}); name the field that "
                     "holds the text with --text-field NAME")


# A reader yields the file's documents, or with count=True numbers of rows that add up to
# the file's count of documents, without parsing them.
def _jsonl(f: Path, field: str, count: bool = False) -> Iterator[Any]:
    with open(f, "rb") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            if count:
                yield 1
                continue
            try:
                record = json.loads(line)
            except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
                raise DataError(f"{f}, line {number}: not valid JSON ({err}); give one JSON object "
                                "per line") from None
            if not isinstance(record, dict):
                raise DataError(f"{f}, line {number}: a JSON {type(record).__name__}, not an object; "
                                "give one JSON object per line")
            if field not in record:
                raise _missing(f"{f}, line {number}", field, list(record))
            yield _text_value(record[field], f"{f}, line {number}", field)


def _ipc_batches(pa: Any, f: Path, source: Any) -> Iterator[Any]:
    try:
        reader = pa.ipc.open_stream(source)  # save_to_disk writes the streaming format
    except pa.ArrowInvalid:
        source.seek(0)
        try:
            file_reader = pa.ipc.open_file(source)
        except pa.ArrowInvalid as err:
            raise DataError(f"{f} is not an Arrow file ({err}); give the directory that "
                            "Dataset.save_to_disk wrote") from None
        yield from (file_reader.get_batch(i) for i in range(file_reader.num_record_batches))
        return
    yield from reader


def _columnar(f: Path, field: str, count: bool = False) -> Iterator[Any]:
    pa = _pyarrow(f)
    if f.suffix.lower() == ".parquet":
        try:
            pf = pa.parquet.ParquetFile(f)
        except (pa.ArrowException, OSError) as err:
            raise DataError(f"{f} is not a readable Parquet file ({err})") from None
        with pf:
            if field not in pf.schema_arrow.names:
                raise _missing(str(f), field, pf.schema_arrow.names)
            if count:  # the row count is in the footer: no data is read
                yield pf.metadata.num_rows
            else:  # row group by row group, BATCH_ROWS rows at a time, only the text column
                batches = pf.iter_batches(batch_size=BATCH_ROWS, columns=[field])
                yield from _column_values((b.column(0) for b in batches), f, field)
        return
    with pa.memory_map(str(f)) as source:  # Arrow files are read in place, batch by batch
        batches = _ipc_batches(pa, f, source)
        first = next(batches, None)
        if first is not None and field not in first.schema.names:
            raise _missing(str(f), field, first.schema.names)
        every = itertools.chain([first] if first is not None else [], batches)
        if count:
            yield from (batch.num_rows for batch in every)
        else:
            yield from _column_values((b.column(field) for b in every), f, field)


def _column_values(columns: Iterator[Any], f: Path, field: str) -> Iterator[str]:
    row = 0
    for column in columns:
        for value in column.to_pylist():
            yield _text_value(value, f"{f}, row {row}", field)
            row += 1


def _records(source: TextSource, count: bool) -> Iterator[Any]:
    if not source.documents:
        raise ConfigError("a text source is a byte stream, not documents: use split_text_chunks")
    for f in source.files:
        reader = _jsonl if f.suffix.lower() == ".jsonl" else _columnar
        yield from reader(f, source.text_field, count)


def iter_documents(source: TextSource) -> Iterator[str]:
    """The documents of ``source`` one at a time, in file order.

    Raises:
        DataError: a record without the text field (naming the file, the line or row and
            the fields found), a text that is not a string, or a file that cannot be parsed.
        MissingDependencyError: a Parquet or Arrow file and no pyarrow.
    """
    yield from _records(source, count=False)


def count_documents(source: TextSource) -> int:
    """The number of documents of ``source``, without parsing them: the non-blank lines of
    JSON Lines, the rows in Parquet footers and in Arrow batches (Parquet and Arrow files
    without the text field are refused here already)."""
    return sum(_records(source, count=True))


def split_documents(source: TextSource, held_out: float = HELD_OUT,
                    max_chars: int = CHUNK_BYTES) -> Iterator[tuple[str, list[str]]]:
    """``("train" | "test", documents)`` batches of about ``max_chars`` characters; the
    last ``held_out`` of the documents (at least one) are ``test``.

    Raises:
        DataError: fewer than two documents, or the data changed while it was read.
    """
    n = count_documents(source)
    if n < 2:
        raise DataError(f"--data {source.data}: {n} document(s) of {source.format} data; the held-out "
                        "split needs at least two (the last 10 % are evaluated): give more records")
    n_train = n - max(1, int(n * held_out))
    batch: list[str] = []
    size, part, seen = 0, "train", 0
    for seen, doc in enumerate(iter_documents(source), 1):
        now = "train" if seen <= n_train else "test"
        if batch and (now != part or size >= max_chars):
            yield part, batch
            batch, size = [], 0
        part = now
        batch.append(doc)
        size += len(doc)
    if batch:
        yield part, batch
    if seen != n:
        raise DataError(f"--data {source.data} changed while it was read ({n} documents counted, "
                        f"{seen} read): run again once it is written")
