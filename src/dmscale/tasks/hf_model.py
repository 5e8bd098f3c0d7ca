"""``--model hf:PATH``: a local pretrained Hugging Face causal LM as the supernet.

``PATH`` is a model directory (``config.json`` + weights, as ``save_pretrained`` writes it)
or a ``.gguf`` file (transformers de-quantises it to float32; needs the ``gguf`` package).
Nothing is downloaded: the path must exist on this machine. The model is loaded in float32
with its own tokenizer and wrapped in :class:`~dmscale.tasks.language.CausalLM` so that it
takes token ids and returns logits; its module names therefore start with ``lm.`` (e.g.
``--exclude lm.model.embed_tokens``).

The pretrained weights are the supernet of pipelines ``p`` and ``p-`` (no pretraining phase
unless ``--pretrain-epochs`` asks for one, which then continues training on the task's text).

Example:
    >>> parse_hf_spec("hf:/models/smol"), parse_hf_spec("llama")
    ('/models/smol', None)
    >>> try:
    ...     load_hf_tokenizer("/no/such/model")
    ... except ConfigError as err:
    ...     print(str(err).split(":")[0])
    --model hf
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dmscale.config.run_config import ConfigError
from dmscale.tasks.registry import register_models

__all__ = ["HF_PREFIX", "parse_hf_spec", "is_hf_model", "hf_source", "hf_config", "load_hf_model",
           "load_hf_tokenizer", "save_hf_dir", "check_hf_dir", "HF_DIR", "GGUF_FILE", "check_gguf_run",
           "gguf_pinned_depth", "save_gguf_file", "gguf_tokenizer", "save_hf_outputs"]

HF_DIR = "hf"  # the Hugging Face directory inside a run directory of an hf: model
GGUF_FILE = "model.gguf"  # the llama.cpp file of a run with --export gguf

HF_PREFIX = "hf:"


def parse_hf_spec(model: str | None) -> str | None:
    """The path of ``hf:PATH``, or None for any other model name."""
    if model and model.startswith(HF_PREFIX):
        return model[len(HF_PREFIX):]
    return None


def is_hf_model(model: str | None) -> bool:
    """True for ``--model hf:PATH``."""
    return parse_hf_spec(model) is not None


def hf_source(path: str) -> tuple[str, dict[str, Any]]:
    """``(directory, extra from_pretrained kwargs)`` for a model directory or a ``.gguf`` file.

    Raises:
        ConfigError: the path does not exist, is not a model directory, or a GGUF file needs
            a package that is missing.
    """
    if not path:
        raise ConfigError("--model hf: needs a path: --model hf:DIR (a Hugging Face model "
                          "directory) or --model hf:FILE.gguf")
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"--model hf:{path}: no such file or directory (give a local model "
                          "directory with config.json, or a .gguf file; nothing is downloaded)")
    _need("transformers", path)
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ConfigError(f"--model hf:{path}: a file must be a .gguf model; for other "
                              "formats give the model directory (with config.json)")
        _need("gguf", path)
        return str(p.parent), {"gguf_file": p.name}
    if not (p / "config.json").is_file():
        raise ConfigError(f"--model hf:{path}: the directory has no config.json (give the "
                          "directory that save_pretrained wrote, or hf:FILE.gguf)")
    return str(p), {}


def _need(package: str, path: str) -> None:
    if importlib.util.find_spec(package) is None:
        raise ConfigError(f"--model hf:{path} needs the '{package}' package: pip install 'dmscale[llm]'")


def _import_transformers() -> Any:
    from dmscale.core._compat import ensure_torchvision

    ensure_torchvision()  # transformers imports torchvision when it is installed
    import transformers

    return transformers


def load_hf_tokenizer(path: str) -> Any:
    """The tokenizer saved with the model at ``path`` (a directory or a ``.gguf`` file).

    Raises:
        ConfigError: the path or the tokenizer cannot be loaded.
    """
    directory, extra = hf_source(path)
    transformers = _import_transformers()
    try:
        return transformers.AutoTokenizer.from_pretrained(directory, **extra)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"--model hf:{path}: cannot load its tokenizer ({str(err).splitlines()[0]}); "
                          "save the tokenizer beside the model (tokenizer.save_pretrained(DIR))") from None


def hf_config(path: str) -> Any:
    """The ``transformers`` config of the causal LM at ``path`` (a directory or ``.gguf`` file).

    Raises:
        ConfigError: the path or its config cannot be read, or the model is not a causal LM.
    """
    directory, extra = hf_source(path)
    transformers = _import_transformers()
    try:
        config = transformers.AutoConfig.from_pretrained(directory, **extra)
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError(f"--model hf:{path}: cannot read its config ({str(err).splitlines()[0]})") from None
    if type(config) not in transformers.MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ConfigError(f"--model hf:{path}: a {config.model_type!r} model is not a causal LM "
                          "(AutoModelForCausalLM cannot load it); give a decoder-only language "
                          "model such as Llama, Qwen2, Mistral or SmolLM2")
    return config


@register_models("hf")
def load_hf_model(path: str, args: dict[str, Any] | None = None) -> nn.Module:
    """The causal LM at ``path`` in float32, wrapped so that ``model(ids)`` returns logits.

    ``args`` (``--model-args``) are passed to ``from_pretrained`` (e.g. ``revision``-free
    options such as ``attn_implementation=eager``).

    Raises:
        ConfigError: missing path or package, or the checkpoint is not a causal LM.
    """
    from dmscale.tasks.language import CausalLM

    directory, extra = hf_source(path)
    transformers = _import_transformers()
    hf_config(path)
    try:
        lm = transformers.AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch.float32, **extra, **dict(args or {}))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"--model hf:{path}: cannot load the model ({str(err).splitlines()[0]})") from None
    return CausalLM(lm)


def check_hf_dir(model: nn.Module, spec: str, layer_uniform: bool, depth_unit: str = "block") -> None:
    """Refuse, before the first step, an ``hf:`` run whose found model could not be written
    as ``RUN/hf`` (:func:`dmscale.export.hf.check_save_pretrained`): a family without a
    ``from_pretrained`` format for pruned widths would otherwise train, then fail to save.

    Raises:
        ConfigError: naming the family, the families that save and what to do instead.
    """
    from dmscale.core.errors import UnsupportedLayerError
    from dmscale.export.hf import check_save_pretrained

    try:
        check_save_pretrained(model, layer_uniform, depth_unit)
    except UnsupportedLayerError as err:
        raise ConfigError(f"--model {spec}: an hf: run ends by writing the found model as {HF_DIR}/ "
                          f"in the run directory for from_pretrained, and this one cannot be: {err}") from None


def save_hf_dir(model: nn.Module, out: str | Path, spec: str, tokenizer: Any = None) -> str:
    """Write the exported ``model`` of an ``hf:`` run as a ``from_pretrained`` directory with
    the original tokenizer (:func:`dmscale.save_pretrained`: standard format when every layer
    has the same sizes, i.e. after ``--layer-uniform``, per-layer otherwise); returns the
    format written (``"standard"`` or ``"per_layer"``)."""
    import json

    from dmscale.export.hf import save_pretrained

    path = parse_hf_spec(spec)
    if path is None:
        raise ConfigError(f"--model {spec} is not a Hugging Face model (hf:PATH)")
    if tokenizer is None:
        tokenizer = load_hf_tokenizer(path)
    was = model.training
    model.eval()
    try:
        save_pretrained(model, out, tokenizer=tokenizer)
    finally:
        model.train(was)
    return str(json.loads((Path(out) / "dmscale.json").read_text(encoding="utf-8"))["format"])


def check_gguf_run(model: nn.Module, spec: str, layer_uniform: bool) -> None:
    """Refuse, before the first step, an ``hf:`` run with ``--export gguf`` whose found model
    llama.cpp could not run (:func:`dmscale.export.gguf.check_gguf`).

    Raises:
        ConfigError: naming the family and the fix (``--layer-uniform`` where it is one).
    """
    from dmscale.core.errors import UnsupportedLayerError
    from dmscale.export.gguf import check_gguf

    try:
        check_gguf(model, layer_uniform)
    except UnsupportedLayerError as err:
        raise ConfigError(f"--model {spec} --export gguf: the found model would be written as "
                          f"{GGUF_FILE} for llama.cpp, and this one cannot be: {err}") from None


def gguf_pinned_depth(model: nn.Module, export: str | None, depth_unit: str) -> list[str]:
    """The modules whose depth units an ``hf:`` search keeps so that its ``--export gguf``
    runs in llama.cpp (``SearchConfig.keep_depth``): with sublayer depth the first layer's
    attention (:func:`dmscale.export.gguf.gguf_keep_depth`), else nothing (a removed first
    block leaves the next one, with its attention, first)."""
    if export != "gguf" or depth_unit != "sublayer":
        return []
    from dmscale.core.errors import UnsupportedLayerError
    from dmscale.export.gguf import gguf_keep_depth

    try:
        return gguf_keep_depth(model)
    except UnsupportedLayerError as err:
        raise ConfigError(f"--export gguf --depth-unit sublayer: {err}") from None


def gguf_tokenizer(spec: str, tokenizer: Any = None) -> Any:
    """The tokenizer a GGUF export of ``hf:PATH`` embeds: the source file itself when it is a
    ``.gguf`` (its tokenizer is copied verbatim), the directory of a Gemma model with its
    ``tokenizer.model`` (the SentencePiece vocabulary, built as llama.cpp's converter builds it),
    else ``tokenizer`` or the directory's."""
    path = parse_hf_spec(spec)
    if path is None:
        raise ConfigError(f"--model {spec} is not a Hugging Face model (hf:PATH)")
    if path.lower().endswith(".gguf"):
        return str(Path(path).expanduser())
    if (Path(path).expanduser() / "tokenizer.model").is_file() and hf_config(path).model_type.startswith("gemma"):
        return str(Path(path).expanduser())  # its SentencePiece model, as llama.cpp's converter reads it
    return tokenizer if tokenizer is not None else load_hf_tokenizer(path)


def save_gguf_file(model: nn.Module, out: str | Path, spec: str, gguf_type: str = "f16",
                   tokenizer: Any = None) -> str:
    """Write the exported ``model`` of an ``hf:`` run as a GGUF file for llama.cpp
    (:func:`dmscale.export.gguf.save_gguf`) with the source's tokenizer; returns the
    llama.cpp architecture written."""
    from dmscale.export.gguf import gguf_architecture, save_gguf

    was = model.training
    model.eval()
    try:
        save_gguf(model, out, tokenizer=gguf_tokenizer(spec, tokenizer), gguf_type=gguf_type)
    finally:
        model.train(was)
    return gguf_architecture(model)


def save_hf_outputs(model: nn.Module, run_dir: str | Path, spec: str, export: str | None,
                    gguf_type: str = "f16", tokenizer: Any = None) -> list[str]:
    """The end of an ``hf:`` run: ``RUN/hf`` (:func:`save_hf_dir`) and, with ``export="gguf"``,
    ``RUN/model.gguf`` (:func:`save_gguf_file`); returns one line per file for the run's log."""
    run_dir = Path(run_dir)
    fmt = save_hf_dir(model, run_dir / HF_DIR, spec, tokenizer=tokenizer)
    how = "from_pretrained" + (" (trust_remote_code=True)" if fmt == "per_layer" else "")
    lines = [f"saved {run_dir / HF_DIR}: Hugging Face {fmt} format with the tokenizer (loads with {how})"]
    if export == "gguf":
        arch = save_gguf_file(model, run_dir / GGUF_FILE, spec, gguf_type, tokenizer=tokenizer)
        lines.append(f"saved {run_dir / GGUF_FILE}: GGUF ({arch}, {gguf_type}) for llama.cpp / Ollama")
    return lines
