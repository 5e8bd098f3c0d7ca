"""The readers of ``--task text``'s own data (dmscale.data.text_sources): which format a
``--data`` path is, the documents of JSON Lines, Parquet and saved Hugging Face datasets,
the errors that name a record without the text field, and streaming without reading a
whole file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from dmscale.core.errors import ConfigError, DataError, MissingDependencyError
from dmscale.data.text_sources import (
    TextSource,
    count_documents,
    iter_documents,
    resolve_source,
    split_documents,
)

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

DOCS = [f"Document {i}: {'ünïcode ' * (i % 3)}line one.\nline two of {i}" for i in range(20)]


def write_jsonl(path: Path, docs: list[str], field: str = "text", blank_lines: bool = False) -> Path:
    lines = [json.dumps({"id": i, field: d}) for i, d in enumerate(docs)]
    sep = "\n\n" if blank_lines else "\n"
    path.write_text(sep.join(lines) + "\n", encoding="utf-8")
    return path


def write_parquet(path: Path, docs: list[str], field: str = "text", row_group_size: int = 4) -> Path:
    table = pa.table({"id": list(range(len(docs))), field: docs})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def save_dataset(path: Path, splits: dict[str, list[str]] | list[str], field: str = "text") -> Path:
    datasets = pytest.importorskip("datasets")
    if isinstance(splits, list):
        datasets.Dataset.from_dict({field: splits}).save_to_disk(str(path))
    else:
        datasets.DatasetDict({k: datasets.Dataset.from_dict({field: v})
                              for k, v in splits.items()}).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "hf-dataset"])
def test_documents_come_back_in_order(tmp_path, fmt):
    path = {"jsonl": lambda: write_jsonl(tmp_path / "d.jsonl", DOCS, blank_lines=True),
            "parquet": lambda: write_parquet(tmp_path / "d.parquet", DOCS),
            "hf-dataset": lambda: save_dataset(tmp_path / "ds", DOCS)}[fmt]()
    src = resolve_source(str(path))
    assert src.format == fmt and src.documents
    assert list(iter_documents(src)) == DOCS
    assert count_documents(src) == len(DOCS)


def test_the_last_tenth_of_the_documents_is_held_out_in_bounded_batches(tmp_path):
    src = resolve_source(str(write_jsonl(tmp_path / "d.jsonl", DOCS)))
    parts = list(split_documents(src, max_chars=100))
    assert [d for p, docs in parts if p == "train" for d in docs] == DOCS[:18]
    assert [d for p, docs in parts if p == "test" for d in docs] == DOCS[18:]
    # a batch closes once it reaches max_chars: no batch holds more than one document past it
    assert all(sum(map(len, docs[:-1])) < 100 for _, docs in parts)
    two = resolve_source(str(write_jsonl(tmp_path / "two.jsonl", DOCS[:2])))
    assert [(p, docs) for p, docs in split_documents(two)] == [("train", DOCS[:1]), ("test", DOCS[1:2])]
    one = resolve_source(str(write_jsonl(tmp_path / "one.jsonl", DOCS[:1])))
    with pytest.raises(DataError, match="at least two"):
        list(split_documents(one))


def test_a_jsonl_line_without_the_field_names_file_line_and_keys(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a"}\n\n{"body": "b", "id": 2}\n', encoding="utf-8")
    with pytest.raises(DataError) as err:
        list(iter_documents(resolve_source(str(path))))
    msg = str(err.value)
    assert str(path) in msg and "line 3" in msg and "'body'" in msg and "'id'" in msg
    assert "--text-field" in msg
    with pytest.raises(DataError, match="line 1.*no field 'body'"):
        list(iter_documents(resolve_source(str(path), "body")))


@pytest.mark.parametrize("line, needle", [
    ('{"text": null}', "is null"),
    ('{"text": ["a"]}', "is a list"),
    ('["text"]', "not an object"),
    ('{"text": "a"', "not valid JSON"),
])
def test_bad_jsonl_records_are_refused_by_line(tmp_path, line, needle):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=needle) as err:
        list(iter_documents(resolve_source(str(path))))
    assert f"{path}, line 2" in str(err.value)


def test_parquet_and_arrow_without_the_column_name_the_columns(tmp_path):
    pq_path = write_parquet(tmp_path / "d.parquet", DOCS, field="content")
    with pytest.raises(DataError, match=r"no field 'text' \(found: 'id', 'content'\)"):
        count_documents(resolve_source(str(pq_path)))
    assert list(iter_documents(resolve_source(str(pq_path), "content"))) == DOCS
    ds = save_dataset(tmp_path / "ds", DOCS, field="content")
    with pytest.raises(DataError, match=r"\.arrow: no field 'text' \(found: 'content'\)"):
        count_documents(resolve_source(str(ds)))
    assert list(iter_documents(resolve_source(str(ds), "content"))) == DOCS


def test_a_parquet_null_names_the_row(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["a", "b", None]}), path)
    with pytest.raises(DataError, match=r"d\.parquet, row 2: the field 'text' is null"):
        list(iter_documents(resolve_source(str(path))))


def test_parquet_is_read_batch_by_batch_never_whole(tmp_path, monkeypatch):
    path = write_parquet(tmp_path / "d.parquet", DOCS * 100, row_group_size=50)
    for whole in ("read", "read_row_group", "read_row_groups"):
        monkeypatch.setattr(pq.ParquetFile, whole, lambda *a, **k: pytest.fail("read whole"))
    monkeypatch.setattr(pq, "read_table", lambda *a, **k: pytest.fail("read whole"))
    seen = []
    real = pq.ParquetFile.iter_batches

    def spy(self, *args, **kwargs):
        for batch in real(self, *args, **kwargs):
            seen.append((batch.num_rows, batch.schema.names))
            yield batch

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    src = resolve_source(str(path))
    assert count_documents(src) == 2000 and not seen  # counted from the footer
    assert sum(1 for _ in iter_documents(src)) == 2000
    assert max(n for n, _ in seen) <= 1024 and {tuple(names) for _, names in seen} == {("text",)}


def test_a_dataset_dict_reads_its_train_split_and_says_so(tmp_path):
    path = save_dataset(tmp_path / "dd", {"validation": DOCS[:3], "train": DOCS[3:], "test": DOCS[:2]})
    src = resolve_source(str(path))
    assert src.format == "hf-dataset" and src.split == "train"
    assert list(iter_documents(src)) == DOCS[3:]
    assert "the 'train' split of the saved dataset" in src.describe()
    assert "splits: validation, train, test" in src.describe()
    only = save_dataset(tmp_path / "only", {"validation": DOCS[:3]})
    assert resolve_source(str(only)).split == "validation"
    none = save_dataset(tmp_path / "none", {"validation": DOCS[:3], "test": DOCS[:2]})
    with pytest.raises(ConfigError, match=r"no 'train'.*--data .*none.validation"):
        resolve_source(str(none))
    # one split's directory is a dataset of its own
    assert list(iter_documents(resolve_source(str(path / "test")))) == DOCS[:2]


def test_a_directory_of_record_files_reads_them_in_path_order_and_names_the_rest(tmp_path):
    write_jsonl(tmp_path / "b.jsonl", DOCS[5:])
    write_parquet(tmp_path / "a.parquet", DOCS[:5])
    (tmp_path / "README.md").write_text("# my corpus\n")
    (tmp_path / ".hidden.jsonl").write_text('{"nope": 1}\n')
    src = resolve_source(str(tmp_path))
    assert src.format == "jsonl+parquet" and [f.name for f in src.files] == ["a.parquet", "b.jsonl"]
    assert [f.name for f in src.skipped] == ["README.md"]
    assert list(iter_documents(src)) == DOCS
    assert "2 .jsonl/.parquet files" in src.describe() and "skipped 1 other file(s): README.md" in src.describe()


def test_text_files_stay_text_and_a_json_file_is_refused(tmp_path):
    (tmp_path / "a.txt").write_text("hello\n")
    src = resolve_source(str(tmp_path))
    assert src == TextSource("text", (tmp_path / "a.txt",), data=str(tmp_path))
    assert not src.documents and resolve_source(None).describe() == "the bundled Shakespeare"
    (tmp_path / "x.json").write_text('{"text": "a"}\n')
    with pytest.raises(ConfigError, match=r"\.json file is ambiguous.*\.jsonl"):
        resolve_source(str(tmp_path / "x.json"))
    with pytest.raises(ConfigError, match="no such file"):
        resolve_source(str(tmp_path / "missing.jsonl"))


def test_the_key_names_format_field_split_and_file_identity(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", DOCS)
    key = resolve_source(str(path)).key()
    assert key.startswith("jsonl\ttext\tNone\n") and str(path.resolve()) in key
    assert resolve_source(str(path), "body").key() != key
    text = TextSource("text", (path,))
    st = path.stat()  # text files: the lines the cache key always hashed, nothing more
    assert text.key() == f"{path.resolve()}\t{st.st_size}\t{st.st_mtime_ns}\n"


def test_without_pyarrow_parquet_names_the_extra(tmp_path, monkeypatch):
    path = write_parquet(tmp_path / "d.parquet", DOCS)
    for name in ("pyarrow", "pyarrow.parquet", "pyarrow.ipc"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(MissingDependencyError, match=r"pip install dmscale\[text\]"):
        count_documents(resolve_source(str(path)))
    # JSON Lines need no pyarrow
    assert count_documents(resolve_source(str(write_jsonl(tmp_path / "d.jsonl", DOCS)))) == 20


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_memory_does_not_grow_with_the_file(tmp_path, fmt):
    import tracemalloc

    docs = [f"{i:06d} " + "word " * 80 for i in range(20_000)]  # 8 MB of text
    path = (write_jsonl(tmp_path / "big.jsonl", docs) if fmt == "jsonl"
            else write_parquet(tmp_path / "big.parquet", docs, row_group_size=2_000))
    src = resolve_source(str(path))
    arrow = []  # what Arrow holds (its own allocator, not seen by tracemalloc), per batch
    tracemalloc.start()
    try:
        n = 0
        for _, batch in split_documents(src, max_chars=1 << 18):
            n += len(batch)
            arrow.append(pa.total_allocated_bytes())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    size = sum(map(len, docs)) / 2**20
    assert n == len(docs) and size > 7.5
    assert peak < 3 << 20, f"Python peak {peak / 2**20:.1f} MiB while reading {size:.0f} MiB of text"
    assert max(arrow) < 3 << 20, f"Arrow holds {max(arrow) / 2**20:.1f} MiB of {size:.0f} MiB of text"
