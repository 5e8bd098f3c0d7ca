"""The tokenizer of a GGUF export, embedded as llama.cpp's converter embeds it.

Two sources, in order of exactness:

* **a GGUF file** (``tokenizer="model.gguf"``, e.g. the file an ``hf:FILE.gguf`` search started
  from): its ``tokenizer.*`` key-values -- model, pre-tokenizer, tokens, token types, merges,
  scores, special token ids, ``add_bos`` / ``add_eos``, chat template -- are copied verbatim,
  so llama.cpp tokenizes the export exactly as it tokenized the source.
* **a Hugging Face tokenizer object** with a byte-level BPE ``tokenizer.json`` (GPT-2 style:
  Llama 3, Qwen2 / 2.5 / 3, SmolLM / SmolLM2): ``tokenizer.ggml.model = "gpt2"``, the tokens
  and their types, and through ``gguf.SpecialVocab`` (the converter's own helper) the merges,
  special token ids, ``add_bos`` / ``add_eos`` and chat template. llama.cpp picks its
  pre-tokenizer (how text is split before BPE) by the name ``tokenizer.ggml.pre``, and a wrong
  name tokenizes differently without an error; the converter finds the name by hashing the
  tokens of a test string against a table of known models. Here the name comes from the
  tokenizer's own pre-tokenizer definition compared with the splitting rules llama.cpp
  implements for each name (:data:`PRE_TOKENIZERS`); a pre-tokenizer outside that table is
  refused, naming the fix (give a GGUF file with the same tokenizer). SentencePiece
  tokenizers (Llama 2, Gemma) are refused the same way.

Example:
    >>> pre_tokenizer_name({"type": "ByteLevel", "add_prefix_space": False, "use_regex": True})
    'gpt-2'
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

from dmscale.core.errors import UnsupportedLayerError

__all__ = ["add_tokenizer", "pre_tokenizer_name", "PRE_TOKENIZERS", "COPIED_GENERAL_KEYS"]

# the splitting regexes of tokenizer.json for which llama.cpp implements the same split
_LLAMA3_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# the steps of a tokenizer.json pre-tokenizer -> llama.cpp's tokenizer.ggml.pre
# (src/llama-vocab.cpp: "llama-bpe" and "qwen2" split with the regexes above, "smollm" splits
# digits one by one before GPT-2's regex, "gpt-2" applies GPT-2's regex alone)
PRE_TOKENIZERS: dict[tuple[tuple[str, Any], ...], str] = {
    (("split", _LLAMA3_RE), ("bytelevel", False)): "llama-bpe",
    (("split", _QWEN2_RE), ("bytelevel", False)): "qwen2",
    (("digits", True), ("bytelevel", True)): "smollm",
    (("bytelevel", True),): "gpt-2",
}

# general.* keys copied from a source GGUF (what the model is; not its type or size)
COPIED_GENERAL_KEYS = ("general.name", "general.basename", "general.organization", "general.finetune",
                       "general.license", "general.languages", "general.tags")


def _steps(pre: dict[str, Any] | None) -> tuple[tuple[str, Any], ...]:
    """A pre-tokenizer of tokenizer.json as ``(kind, detail)`` steps."""
    if pre is None:
        return ()
    kind = pre.get("type")
    if kind == "Sequence":
        return tuple(s for p in pre.get("pretokenizers", []) for s in _steps(p))
    if kind == "Split":
        pattern = pre.get("pattern", {})
        return (("split", pattern.get("Regex", pattern.get("String"))),)
    if kind == "Digits":
        return (("digits", bool(pre.get("individual_digits"))),)
    if kind == "ByteLevel":
        return (("bytelevel", bool(pre.get("use_regex", True))),)
    return ((str(kind), None),)


def pre_tokenizer_name(pre: dict[str, Any] | None) -> str | None:
    """llama.cpp's ``tokenizer.ggml.pre`` for a tokenizer.json ``pre_tokenizer``, or None."""
    return PRE_TOKENIZERS.get(_steps(pre))


def add_tokenizer(writer: Any, tokenizer: Any, n_vocab: int) -> str:
    """Add ``tokenizer`` (a ``.gguf`` path or a Hugging Face tokenizer) to ``writer``; returns a
    short description. ``n_vocab`` is the export's embedding rows, which the token list must
    match (llama.cpp refuses a file where they differ).

    Raises:
        UnsupportedLayerError: a tokenizer llama.cpp would not tokenize the same way.
    """
    if tokenizer is None:
        warnings.warn("save_gguf without a tokenizer: llama.cpp can load the file but not "
                      "tokenize text; pass tokenizer=", stacklevel=3)
        return "no tokenizer"
    if isinstance(tokenizer, (str, os.PathLike)) and Path(tokenizer).is_dir():
        return _add_sentencepiece(writer, Path(tokenizer), n_vocab)
    if isinstance(tokenizer, (str, os.PathLike)):
        return _copy_from_gguf(writer, Path(tokenizer), n_vocab)
    spec = _backend_spec(tokenizer)
    if spec.get("model", {}).get("type") == "BPE" and spec["model"].get("byte_fallback"):
        return _add_hf_sentencepiece(writer, tokenizer, n_vocab)
    return _add_bpe(writer, tokenizer, n_vocab)


def _field_value(field: Any) -> Any:
    return field.contents()


def _copy_from_gguf(writer: Any, path: Path, n_vocab: int) -> str:
    import gguf

    if path.suffix.lower() != ".gguf" or not path.is_file():
        raise UnsupportedLayerError(f"tokenizer={str(path)!r}: expected a .gguf file to copy the "
                                    "tokenizer from, or a Hugging Face tokenizer object")
    reader = gguf.GGUFReader(path)
    copied = 0
    for key, field in reader.fields.items():
        if not (key.startswith("tokenizer.") or key in COPIED_GENERAL_KEYS):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = _field_value(field)
        if key == "tokenizer.ggml.tokens" and len(value) != n_vocab:
            raise UnsupportedLayerError(
                f"{path} has {len(value)} tokens, the model's embedding {n_vocab} rows: it is not "
                "this model's tokenizer")
        writer.add_key_value(key, value, vtype, sub_type=sub)
        copied += 1
    if "tokenizer.ggml.model" not in reader.fields:
        raise UnsupportedLayerError(f"{path} has no tokenizer (tokenizer.ggml.model) to copy")
    return f"tokenizer copied from {path.name} ({copied} keys)"


def _backend_spec(tokenizer: Any) -> dict[str, Any]:
    """The ``tokenizer.json`` of a fast tokenizer, as a dict."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise UnsupportedLayerError(
            f"{type(tokenizer).__name__} is not a fast (tokenizer.json) tokenizer; pass "
            "tokenizer='FILE.gguf' (a GGUF of the source model, e.g. made by llama.cpp's "
            "convert_hf_to_gguf.py) or the directory holding its tokenizer.model")
    return json.loads(backend.to_str())


def _sentencepiece_vocab(directory: Path, n_vocab: int) -> tuple[list[bytes], list[float], list[int]]:
    """Tokens, scores and types of ``directory/tokenizer.model`` padded to ``n_vocab``, with the
    added tokens of ``tokenizer_config.json`` (llama.cpp's converter,
    ``_create_vocab_sentencepiece``)."""
    import gguf
    from sentencepiece import SentencePieceProcessor

    sp = SentencePieceProcessor()
    sp.LoadFromFile(str(directory / "tokenizer.model"))
    kind = gguf.TokenType
    tokens = [f"[PAD{i}]".encode() for i in range(n_vocab)]
    scores, types = [-10000.0] * n_vocab, [int(kind.UNUSED)] * n_vocab
    for i in range(min(sp.vocab_size(), n_vocab)):
        tokens[i], scores[i] = sp.IdToPiece(i).encode("utf-8"), sp.GetScore(i)
        types[i] = int(kind.UNKNOWN if sp.IsUnknown(i) else kind.CONTROL if sp.IsControl(i)
                       else kind.UNUSED if sp.IsUnused(i) else kind.BYTE if sp.IsByte(i) else kind.NORMAL)
    config = directory / "tokenizer_config.json"
    added = json.loads(config.read_text(encoding="utf-8")).get("added_tokens_decoder", {}) if config.is_file() else {}
    for key, data in added.items():
        i, text = int(key), str(data["content"])
        if i >= n_vocab:
            continue
        special = data.get("special") or (text.startswith("<|") and text.endswith("|>")) \
            or text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        if not special:
            text = text.replace("\u2581", " ")  # the converter pre-normalizes user-defined spaces
        tokens[i], scores[i] = text.encode("utf-8"), -1000.0
        types[i] = int(kind.CONTROL if special else kind.USER_DEFINED)
    return tokens, scores, types


def _write_sentencepiece(writer: Any, tokens: list[bytes], scores: list[float], types: list[int],
                         directory: Path, n_vocab: int) -> None:
    import gguf

    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    gguf.SpecialVocab(directory, n_vocab=n_vocab).add_to_gguf(writer, quiet=True)
    writer.add_add_space_prefix(False)  # as the converter writes Gemma 3's


def _add_sentencepiece(writer: Any, directory: Path, n_vocab: int) -> str:
    if not (directory / "tokenizer.model").is_file():
        raise UnsupportedLayerError(f"tokenizer={str(directory)!r}: the directory has no tokenizer.model "
                                    "(SentencePiece) to build the vocabulary from")
    _write_sentencepiece(writer, *_sentencepiece_vocab(directory, n_vocab), directory, n_vocab)
    return f"SentencePiece tokenizer from {directory.name}/tokenizer.model"


def _add_hf_sentencepiece(writer: Any, tokenizer: Any, n_vocab: int) -> str:
    import gguf

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        vocab = gguf.LlamaHfVocab(Path(tmp))
        tokens, scores, types = [], [], []
        for text, score, kind in vocab.all_tokens():
            tokens.append(text)
            scores.append(score)
            types.append(int(kind))
        if len(tokens) > n_vocab:
            raise UnsupportedLayerError(f"the tokenizer has {len(tokens)} tokens, the model's embedding "
                                        f"{n_vocab} rows: it is not this model's tokenizer")
        for i in range(len(tokens), n_vocab):
            tokens.append(f"[PAD{i}]".encode())
            scores.append(-1000.0)
            types.append(int(gguf.TokenType.UNUSED))
        _write_sentencepiece(writer, tokens, scores, types, Path(tmp), n_vocab)
    return "SentencePiece-style tokenizer (byte-fallback BPE of tokenizer.json)"


def _add_bpe(writer: Any, tokenizer: Any, n_vocab: int) -> str:
    import gguf

    spec = _backend_spec(tokenizer)
    steps = _steps(spec.get("pre_tokenizer"))
    if spec.get("model", {}).get("type") != "BPE" or not any(k == "bytelevel" for k, _ in steps):
        raise UnsupportedLayerError(
            f"the tokenizer is not a byte-level BPE ({spec.get('model', {}).get('type')}, pre-tokenizer "
            f"{[k for k, _ in steps]}): pass tokenizer='FILE.gguf' (a GGUF of the source model, e.g. "
            "made by llama.cpp's convert_hf_to_gguf.py) or the directory holding its tokenizer.model")
    pre = PRE_TOKENIZERS.get(steps)
    if pre is None:
        raise UnsupportedLayerError(
            f"llama.cpp has no pre-tokenizer known here for this tokenizer ({spec.get('pre_tokenizer')}); "
            f"known: {', '.join(sorted(set(PRE_TOKENIZERS.values())))}. A wrong name would tokenize "
            "differently without an error: pass tokenizer='FILE.gguf' (a GGUF of the source model)")
    tokens, types = _tokens(tokenizer, n_vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    with tempfile.TemporaryDirectory() as tmp:  # SpecialVocab reads the saved files, as in the converter
        tokenizer.save_pretrained(tmp)
        gguf.SpecialVocab(tmp, load_merges=True, n_vocab=n_vocab).add_to_gguf(writer, quiet=True)
    return f"byte-level BPE tokenizer, pre-tokenizer {pre!r}"


def _tokens(tokenizer: Any, n_vocab: int) -> tuple[list[str], list[int]]:
    """Every id's token text and type (normal, control, user-defined, unused padding)."""
    import gguf

    vocab = tokenizer.get_vocab()
    if max(vocab.values()) >= n_vocab:
        raise UnsupportedLayerError(f"the tokenizer has ids up to {max(vocab.values())}, the model's "
                                    f"embedding {n_vocab} rows: it is not this model's tokenizer")
    by_id = {i: t for t, i in vocab.items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(n_vocab):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(int(gguf.TokenType.UNUSED))
            continue
        token = by_id[i]
        if i in added:
            if not added[i].normalized:  # llama.cpp expects added tokens pre-normalized
                token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False))
            special = added[i].special or (token.startswith("<|") and token.endswith("|>"))
            types.append(int(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED))
        else:
            types.append(int(gguf.TokenType.NORMAL))
        tokens.append(token)
    return tokens, types
