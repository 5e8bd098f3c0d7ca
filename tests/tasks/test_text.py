"""``--task text`` on documents (dmscale.tasks.text): JSON Lines, Parquet and saved Hugging
Face datasets tokenise to the documents joined by EOS, the held-out split is the last tenth
of the documents, the token cache is reused and keyed by format, field and files, and a
tiny search runs from the command line on a ``.jsonl`` file."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch

from dmscale.cli import main
from dmscale.config.run_config import ConfigError, RunConfig
from dmscale.core.errors import DataError
from dmscale.data.text_sources import resolve_source
from dmscale.tasks.text import TextTask, token_cache
from tiny_hf import make_tiny_hf

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")

N_DOCS = 60


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``(model_dir, tokenizer, documents)``: the tiny Llama and its BPE tokenizer, and
    documents cut from the text it was trained on (paragraphs, with unicode in some)."""
    from transformers import AutoTokenizer

    model_dir, data = make_tiny_hf(tmp_path_factory.mktemp("tiny_text"), 20_000)
    paragraphs = [p.strip() for p in data.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    docs = [("Ünïcödé — " if i % 7 == 0 else "") + p for i, p in enumerate(paragraphs[:N_DOCS])]
    docs[5] = ""  # an empty document is a document: EOS on both sides of nothing
    return model_dir, AutoTokenizer.from_pretrained(model_dir), docs


@pytest.fixture(autouse=True)
def _token_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DMSCALE_CACHE", str(tmp_path / "token-cache"))


def _write(fmt, path, docs, field="text"):
    if fmt == "jsonl":
        path = path.with_suffix(".jsonl")
        path.write_text("".join(json.dumps({field: d, "n": len(d)}) + "\n" for d in docs), encoding="utf-8")
    elif fmt == "parquet":
        path = path.with_suffix(".parquet")
        pq.write_table(pa.table({field: docs}), path, row_group_size=7)
    else:
        datasets.DatasetDict(train=datasets.Dataset.from_dict({field: docs}),
                             test=datasets.Dataset.from_dict({field: docs[:3]})).save_to_disk(str(path))
    return path


def _joined(tokenizer, docs):
    """The documents tokenised one by one directly, EOS between two."""
    out = []
    for i, d in enumerate(docs):
        if i:
            out.append(tokenizer.eos_token_id)
        out += tokenizer(d, add_special_tokens=False)["input_ids"]
    return out


def _tokens(cache, part):
    return np.fromfile(cache / f"{part}.bin", dtype=np.uint32).tolist()


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "hf-dataset"])
def test_the_token_stream_is_the_documents_joined_by_eos(tiny, tmp_path, fmt):
    _, tok, docs = tiny
    path = _write(fmt, tmp_path / "data", docs)
    cache = token_cache(resolve_source(str(path)), tok)
    n_test = N_DOCS // 10
    assert _tokens(cache, "train") == _joined(tok, docs[:-n_test])
    assert _tokens(cache, "test") == _joined(tok, docs[-n_test:])
    meta = json.loads((cache / "meta.json").read_text())
    assert (meta["format"], meta["text_field"], meta["eos"]) == (fmt, "text", tok.eos_token_id)
    assert (meta["train_documents"], meta["test_documents"]) == (N_DOCS - n_test, n_test)
    assert meta["test_bytes"] == sum(len(d.encode()) for d in docs[-n_test:])
    assert meta["split"] == ("train" if fmt == "hf-dataset" else None)


def test_small_batches_tokenise_to_the_same_stream(tiny, tmp_path, monkeypatch):
    import dmscale.data.text_sources as text_sources

    _, tok, docs = tiny
    path = _write("jsonl", tmp_path / "data", docs)
    whole = _tokens(token_cache(resolve_source(str(path)), tok), "train")
    monkeypatch.setenv("DMSCALE_CACHE", str(tmp_path / "other-cache"))
    real = text_sources.split_documents
    batches = []

    def small(source, held_out):  # batches of one or two documents: EOS joins across them
        for part, docs in real(source, held_out, max_chars=50):
            batches.append(len(docs))
            yield part, docs

    monkeypatch.setattr("dmscale.tasks.text.split_documents", small)
    assert _tokens(token_cache(resolve_source(str(path)), tok), "train") == whole
    assert len(batches) > N_DOCS // 2


def test_the_cache_is_reused_and_keyed_by_format_field_and_contents(tiny, tmp_path):
    _, tok, docs = tiny
    path = _write("jsonl", tmp_path / "data", docs)
    cache = token_cache(resolve_source(str(path)), tok)
    stamp = (cache / "train.bin").stat().st_mtime_ns
    assert token_cache(resolve_source(str(path)), tok) == cache
    assert (cache / "train.bin").stat().st_mtime_ns == stamp  # not written again
    # the same records under another field name: another cache
    body = _write("jsonl", tmp_path / "body", docs, field="body")
    assert token_cache(resolve_source(str(body), "body"), tok) != cache
    # the same documents as Parquet: another cache, the same tokens
    pq_cache = token_cache(resolve_source(str(_write("parquet", tmp_path / "data", docs))), tok)
    assert pq_cache != cache and _tokens(pq_cache, "train") == _tokens(cache, "train")
    # changed contents: another cache
    path.write_text(path.read_text(encoding="utf-8").replace("ROMEO", "JULIET"), encoding="utf-8")
    os.utime(path, ns=(stamp + 10**9, stamp + 10**9))
    assert token_cache(resolve_source(str(path)), tok) != cache


def test_a_tokenizer_without_eos_is_refused_for_documents(tiny, tmp_path):
    _, tok, docs = tiny

    class NoEos:
        eos_token_id = None

        def __getattr__(self, name):
            return getattr(tok, name)

        def __call__(self, *a, **k):
            return tok(*a, **k)

    with pytest.raises(ConfigError, match="EOS token"):
        token_cache(resolve_source(str(_write("jsonl", tmp_path / "data", docs))), NoEos())


def test_text_task_on_jsonl_evaluates_the_held_out_documents(tiny, tmp_path):
    model_dir, tok, docs = tiny
    path = _write("jsonl", tmp_path / "data", docs, field="content")
    cfg = RunConfig(command="search", task="text", model=f"hf:{model_dir}", data=str(path),
                    text_field="content", pipeline="p", seq_len=16).resolved()
    task = TextTask(cfg)
    assert f"({path}, field 'content'; {N_DOCS} documents ({N_DOCS // 10} held out) joined by EOS)" \
        in task.describe()
    assert list(task.test_ids) == _joined(tok, docs[-(N_DOCS // 10):])
    vocab = task.info["vocab_size"]

    class Uniform(torch.nn.Module):
        def forward(self, ids):
            return torch.zeros(*ids.shape, vocab)

    m = task.evaluate(Uniform(), batch_size=5)
    test_bytes = sum(len(d.encode()) for d in docs[-(N_DOCS // 10):])
    assert m["bytes"] == test_bytes and m["examples"] == len(task.test_ids)
    assert math.isclose(m["bpb"], len(task.test_ids) * math.log2(vocab) / test_bytes, rel_tol=1e-6)
    # with --test-limit the bytes are those of the documents' text, the EOS tokens have none
    limited = TextTask(RunConfig(**{**cfg.to_dict(), "test_limit": len(task.test_ids)}))
    assert limited.test_bytes == test_bytes
    with pytest.raises(DataError, match="no field 'text'"):
        TextTask(RunConfig(**{**cfg.to_dict(), "text_field": "text"}))


def test_search_from_the_command_line_on_a_jsonl_file(tiny, tmp_path, capsys):
    model_dir, _, docs = tiny
    path = _write("jsonl", tmp_path / "data", docs)
    run = tmp_path / "run"
    rc = main(["search", "--model", f"hf:{model_dir}", "--task", "text", "--data", str(path),
               "--pipeline", "p", "--pretrain-epochs", "0", "--epochs", "0.05", "--retrain-epochs", "0",
               "--resource", "params", "--target", "0.8", "--seq-len", "32", "--batch-size", "4",
               "--optimizer", "adamw", "--threads", "1", "--out", str(run)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert f"{path}, field 'text'" in out and "bits/byte" in out
    summary = json.loads((run / "summary.json").read_text())
    assert "joined by EOS" in summary["task"]
    rc = main(["eval", str(run), "--test-limit", "64"])  # the run's --data and --text-field
    out, err = capsys.readouterr()
    assert rc == 0 and "bits/byte" in out and "64 test tokens" in out, err
    assert main(["eval", str(run), "--text-field", "body"]) != 0  # the override reaches the task
    assert "no field 'body'" in capsys.readouterr().err
    rc = main(["search", "--model", f"hf:{model_dir}", "--task", "text", "--data", str(path),
               "--text-field", "body", "--pipeline", "p", "--out", str(tmp_path / "r2")])
    err = capsys.readouterr().err
    assert rc == 2 and "line 1: no field 'body'" in err and "'text'" in err and "'n'" in err, err
