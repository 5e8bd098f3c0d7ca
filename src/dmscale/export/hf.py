"""Save an exported Hugging Face causal LM so that ``from_pretrained`` loads it without dmscale.

:func:`save_pretrained` writes a standard Hugging Face directory (``model.safetensors``,
``config.json``, ``generation_config.json``, the tokenizer) in one of two formats:

* **standard** -- every decoder layer has the same number of heads, key-value heads and FFN
  width (a search with ``SearchConfig(layer_uniform=True)``): the model's own config class
  with the new sizes (``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``,
  ``intermediate_size``, explicit ``head_dim``, ``num_hidden_layers`` after removed layers).
  ``AutoModelForCausalLM.from_pretrained(dir)`` loads it with plain transformers, and so does
  every tool that reads a standard config. Families: :data:`STANDARD_FAMILIES` -- Llama
  (incl. SmolLM2), Mistral, Qwen2, Qwen3, Gemma 3 text (with its hidden size kept).
* **per_layer** -- the layers differ (what DMS finds by default). Hugging Face has no
  standard config for heterogeneous layers, so the directory carries its own modeling code:
  ``config.json`` has ``model_type: "dmscale_<family>"`` (``dmscale_llama``,
  ``dmscale_qwen2``, ...), one ``[heads, kv_heads, intermediate]`` per layer in
  ``layer_sizes`` (``[0, 0, intermediate]``: a layer without attention, ``[heads, kv, 0]``:
  without FFN, from ``SearchConfig(depth_unit="sublayer")``), and an ``auto_map`` pointing at ``modeling_dmscale_<family>.py``, a
  40-line file that subclasses transformers' own classes of the family (``Qwen2ForCausalLM``,
  ...) and rebuilds each layer's projections at its own size with ``dmscale_per_layer.py``
  (both import only torch and transformers). ``from_pretrained(dir, trust_remote_code=True)``
  loads it without dmscale. Families: :data:`PER_LAYER_FAMILIES` -- Llama (SmolLM2, Llama
  2/3), Mistral, Qwen2 (Qwen2.5), Qwen3, Gemma 3 text (``gemma3_text``: its scaled
  embeddings keep the original factor in ``embed_scale``). Tools that need a standard
  architecture (vLLM, llama.cpp's converter) do not know ``dmscale_*`` -- search with
  ``layer_uniform=True`` for those.

Both formats keep the attention type of each kept layer (``layer_types``: sliding-window or
full attention, Qwen2/3 and Gemma 3) when a depth search removed layers.
:func:`check_save_pretrained` says before a search whether its result will save (a family
outside these raises, naming the fix); the ``hf:`` runs of the command line call it before
their first step.

Before returning, the saved directory is loaded back (in this process) and its logits are
compared with the model's on a probe sequence; a mismatch raises :class:`VerificationError`
instead of leaving a silently different checkpoint (``verify=False`` skips it and the second
copy of the model it costs).

Example:
    >>> import tempfile, torch, dmscale as dms
    >>> _ = dms.ensure_torchvision()
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    ...                   num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    >>> lm = LlamaForCausalLM(cfg).eval()
    >>> ids = {"input_ids": torch.randint(0, 32, (1, 6))}
    >>> searcher = dms.prepare(lm, ids, dms.SearchConfig("params", 0.6, layer_uniform=True))
    >>> _ = lm.train()  # one task-loss backward: importance (Eq. 4); a search trains many
    >>> lm(**ids, labels=ids["input_ids"]).loss.backward()
    >>> _ = searcher.meet_target()
    >>> small = searcher.export()
    >>> out = dms.save_pretrained(small, tempfile.mkdtemp())
    >>> hf_layer_sizes(small)["uniform"]
    True
"""

from __future__ import annotations

import contextlib
import copy
import importlib.resources
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from dmscale.core.errors import ConfigError, StructureError, UnsupportedLayerError, VerificationError
from dmscale.export.hf_sizes import STANDARD_FAMILIES, check_uniform_depth, find_hf_model, hf_layer_sizes
from dmscale.export.shrink import ZeroBranch

__all__ = ["save_pretrained", "hf_layer_sizes", "find_hf_model", "check_save_pretrained", "check_uniform_depth",
           "remote_files", "STANDARD_FAMILIES", "PER_LAYER_FAMILIES", "REMOTE_FILE", "SHARED_REMOTE_FILE"]

# model_type -> (the stem of its modeling_dmscale_<stem>.py, the prefix of its classes)
_PER_LAYER = {"llama": ("llama", "Llama"), "mistral": ("mistral", "Mistral"), "qwen2": ("qwen2", "Qwen2"),
              "qwen3": ("qwen3", "Qwen3"), "gemma3_text": ("gemma3", "Gemma3")}
PER_LAYER_FAMILIES = tuple(_PER_LAYER)
REMOTE_FILE = "modeling_dmscale_llama.py"  # the Llama family's (``remote_files`` for the others)
SHARED_REMOTE_FILE = "dmscale_per_layer.py"  # imported by every modeling_dmscale_<family>.py
_REMOTE_CLASSES = ("AutoConfig", "Config"), ("AutoModel", "Model"), ("AutoModelForCausalLM", "ForCausalLM")


def remote_files(model_type: str) -> tuple[str, str]:
    """``(modeling file, shared file)`` that a per-layer checkpoint of ``model_type`` carries."""
    if model_type not in _PER_LAYER:
        raise UnsupportedLayerError(
            f"no per-layer format for {model_type!r} (families: {', '.join(PER_LAYER_FAMILIES)})")
    return f"modeling_dmscale_{_PER_LAYER[model_type][0]}.py", SHARED_REMOTE_FILE


def check_save_pretrained(model: nn.Module, layer_uniform: bool = False, depth_unit: str = "block") -> None:
    """Raise before a search when :func:`save_pretrained` could not write its result.

    ``model`` is the Hugging Face causal LM to be searched (or a wrapper holding it), not yet
    prepared; ``layer_uniform`` the search's ``SearchConfig.layer_uniform``. Passes for
    :data:`PER_LAYER_FAMILIES` (any search) and :data:`STANDARD_FAMILIES` with
    ``layer_uniform=True``; ``depth_unit`` the search's ``SearchConfig.depth_unit``
    (:func:`check_uniform_depth`).

    Raises:
        ConfigError: ``layer_uniform`` with sublayer depth (:func:`check_uniform_depth`).
        UnsupportedLayerError: another family, or decoder layers that are not Llama-like
            (``self_attn.q/k/v/o_proj``, ``mlp.gate/up/down_proj``); the message names the
            family and what to do instead.
    """
    check_uniform_depth(model, layer_uniform, depth_unit)
    lm = find_hf_model(model)
    family = lm.config.model_type
    if family not in PER_LAYER_FAMILIES and not (layer_uniform and family in STANDARD_FAMILIES):
        standard_only = [f for f in STANDARD_FAMILIES if f not in PER_LAYER_FAMILIES]
        uniform = (f"; {', '.join(standard_only)} only with layer_uniform=True (--layer-uniform)"
                   if standard_only else "")
        raise UnsupportedLayerError(
            f"{type(lm).__name__} is a {family!r} model: its pruned widths save for from_pretrained "
            f"only for {', '.join(PER_LAYER_FAMILIES)}{uniform}. Search a model of one of those "
            "families, or prune this one from Python (dms.prepare) and keep the export with "
            "dmscale.save (loads with dmscale.load)")
    hf_layer_sizes(lm)


def _kept_layer_types(config: Any, sizes: dict[str, Any]) -> dict[str, Any]:
    """``layer_types`` of the kept layers when the family's config lists them."""
    if getattr(config, "layer_types", None) is None or sizes["layer_types"] is None:
        return {}
    return {"layer_types": list(sizes["layer_types"])}


def _refuse_removed_branches(sizes: dict[str, Any]) -> None:
    """Raise when a layer has no attention or no FFN: a standard config cannot say so."""
    bare = [i for i, s in enumerate(sizes["layers"]) if 0 in s]
    if bare:
        raise StructureError(
            f"layers {bare[:5]} have no attention or no FFN (a 0 in layer_sizes, from a search with "
            "depth_unit='sublayer'), which a standard config cannot state; save with "
            "mode='per_layer' (from_pretrained with trust_remote_code=True)")


def _standard_config(lm: Any, sizes: dict[str, Any]) -> Any:
    config = copy.deepcopy(lm.config)
    if config.model_type not in STANDARD_FAMILIES:
        raise UnsupportedLayerError(
            f"save_pretrained writes standard configs for {', '.join(STANDARD_FAMILIES)}, this "
            f"model is {config.model_type!r}; save with dmscale.save (loads with dmscale.load)")
    _refuse_removed_branches(sizes)
    heads, kv, ffn = sizes["layers"][0] if sizes["layers"] else (
        config.num_attention_heads, config.num_key_value_heads, config.intermediate_size)
    values = {"hidden_size": sizes["hidden_size"], "num_hidden_layers": len(sizes["layers"]),
              "num_attention_heads": heads, "num_key_value_heads": kv, "intermediate_size": ffn,
              "head_dim": sizes["head_dim"] or config.head_dim, **_kept_layer_types(config, sizes)}
    scale = sizes["embed_scale"]
    if scale is not None and abs(scale - sizes["hidden_size"] ** 0.5) > 1e-6 * scale:
        raise StructureError(
            f"{type(config).__name__} scales the embeddings by sqrt(hidden_size) = "
            f"{sizes['hidden_size'] ** 0.5:.4g}, the model by {scale:.4g} (its hidden size was "
            "pruned); keep it (SearchConfig(exclude=['model.embed_tokens']), --exclude "
            "lm.model.embed_tokens) or save with mode='per_layer'")
    try:
        return type(config).from_dict({**_plain_dict(config), **values})
    except Exception as err:  # transformers' strict validation raises its own classes
        raise StructureError(
            f"the pruned sizes {values} do not make a valid {type(config).__name__} "
            f"({str(err).splitlines()[-1].strip()}); keep the hidden size fixed "
            "(SearchConfig(exclude=['model.embed_tokens']) on the bare model, --exclude lm.model.embed_tokens "
            "on the command line), save "
            "with mode='per_layer' or with dmscale.save") from err


def _per_layer_config(lm: Any, sizes: dict[str, Any]) -> Any:
    import importlib

    config = lm.config
    if config.model_type not in PER_LAYER_FAMILIES:
        raise UnsupportedLayerError(
            f"layers of different widths can be saved for from_pretrained only for "
            f"{', '.join(PER_LAYER_FAMILIES)} (this model is {config.model_type!r}); save with "
            "dmscale.save (loads with dmscale.load)")
    modeling = remote_files(config.model_type)[0][:-3]
    prefix = f"DMScale{_PER_LAYER[config.model_type][1]}"
    config_class = getattr(importlib.import_module(f"dmscale.export.hf_remote.{modeling}"), f"{prefix}Config")
    layers = sizes["layers"]
    d = _plain_dict(config)
    d.update(model_type=config_class.model_type, hidden_size=sizes["hidden_size"],
             num_hidden_layers=len(layers), head_dim=sizes["head_dim"] or config.head_dim,
             num_attention_heads=max([1] + [s[0] for s in layers]),
             num_key_value_heads=max([1] + [s[1] for s in layers]),
             intermediate_size=max([1] + [s[2] for s in layers]), layer_sizes=[list(s) for s in layers],
             architectures=[f"{prefix}ForCausalLM"], **_kept_layer_types(config, sizes),
             auto_map={auto: f"{modeling}.{prefix}{cls}" for auto, cls in _REMOTE_CLASSES})
    if sizes["embed_scale"] is not None:
        d["embed_scale"] = float(sizes["embed_scale"])
    zeros = [[n for n, m in layer.named_children() if isinstance(m, ZeroBranch)] for layer in lm.model.layers]
    if any(zeros):  # the modules of removed branches (sublayer depth): no weights, zeros
        d["zero_modules"] = zeros
    return config_class.from_dict(d)


def _plain_dict(config: Any) -> dict[str, Any]:
    """The config as a dict, without the GGUF 'quantization' of a de-quantised model."""
    d = config.to_dict()
    q = d.get("quantization_config")
    if isinstance(q, dict) and str(q.get("quant_method", "")).lower().endswith("gguf"):
        del d["quantization_config"]
    return d


def save_pretrained(model: nn.Module, out_dir: str | os.PathLike, tokenizer: Any = None,
                    mode: str = "auto", verify: bool = True) -> Path:
    """Write ``model`` (an export of a Hugging Face causal LM) as a ``from_pretrained`` directory.

    Args:
        model: ``searcher.export()`` of a ``*ForCausalLM`` of :data:`STANDARD_FAMILIES` or
            :data:`PER_LAYER_FAMILIES` (or a wrapper holding one as its only PreTrainedModel
            child).
        out_dir: the directory (created; files of the same name are replaced).
        tokenizer: saved beside the weights when given.
        mode: "standard" (all layers equal; plain ``from_pretrained``), "per_layer" (the
            config lists each layer's sizes, loads with ``trust_remote_code=True``), or "auto"
            (standard when the layers are equal and the family's config accepts the sizes --
            Llama wants the hidden size divisible by the number of heads -- else per_layer,
            with a warning when the layers were equal).
        verify: load the directory back and compare logits (raises
            :class:`VerificationError` on a mismatch).

    Returns the directory. See the module docs for the formats and their limits.
    """
    if mode not in ("auto", "standard", "per_layer"):
        raise ConfigError(f"mode must be 'auto', 'standard' or 'per_layer', got {mode!r}")
    lm = find_hf_model(model)
    sizes = hf_layer_sizes(lm)
    config = None
    if mode == "auto":  # standard when the layers agree and the family's config accepts the sizes
        mode = "per_layer"
        if sizes["uniform"] and lm.config.model_type in STANDARD_FAMILIES \
                and not any(0 in s for s in sizes["layers"]):
            try:
                config, mode = _standard_config(lm, sizes), "standard"
            except StructureError as err:
                if lm.config.model_type not in PER_LAYER_FAMILIES:
                    raise
                warnings.warn(f"{err}; saving with per-layer sizes and custom code instead "
                              "(loads with trust_remote_code=True)", stacklevel=2)
    if mode == "standard":
        _refuse_removed_branches(sizes)
    if mode == "standard" and not sizes["uniform"]:
        distinct = sorted({tuple(s) for s in sizes["layers"]})
        raise StructureError(
            f"mode='standard' needs every layer to keep the same [heads, kv_heads, intermediate], "
            f"the layers have {len(distinct)} different ones ({distinct[:3]}...); search with "
            "SearchConfig(layer_uniform=True) / --layer-uniform, or save with mode='per_layer'")
    if config is None:
        config = _standard_config(lm, sizes) if mode == "standard" else _per_layer_config(lm, sizes)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [out / "config.json", out / SHARED_REMOTE_FILE, *out.glob("modeling_dmscale_*.py")]:
        if stale.exists():
            stale.unlink()
    with _dequantized(lm):
        lm.save_pretrained(out, safe_serialization=True)
    config.save_pretrained(out)  # replaces the config.json written with the unpruned sizes
    if mode == "per_layer":
        for name in remote_files(lm.config.model_type):
            source = importlib.resources.files("dmscale.export.hf_remote").joinpath(name)
            with importlib.resources.as_file(source) as path:
                shutil.copyfile(path, out / name)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    (out / "dmscale.json").write_text(json.dumps({"format": mode, "layer_sizes": sizes["layers"],
                                                  "hidden_size": sizes["hidden_size"]}, indent=1))
    if verify:
        _verify_saved(lm, out, remote=mode == "per_layer")
    return out


@contextlib.contextmanager
def _dequantized(lm: Any) -> Iterator[None]:
    """A model loaded from a GGUF file is de-quantised to plain float tensors but keeps its
    ``hf_quantizer``, which makes transformers refuse to save it: hide it while saving.
    Other quantizers (bitsandbytes, ...) hold packed weights dmscale never pruned: refused."""
    quantizer = getattr(lm, "hf_quantizer", None)
    if quantizer is None:
        yield
        return
    method = getattr(quantizer.quantization_config, "quant_method", None)
    method = getattr(method, "value", method)
    if method != "gguf" or any(not p.is_floating_point() for p in lm.parameters()):
        raise UnsupportedLayerError(
            f"the model is quantized ({method}); dmscale prunes and saves full-precision models: "
            "load it unquantized (dtype=torch.float32 or bfloat16) before dms.prepare")
    lm.hf_quantizer = None
    try:
        yield
    finally:
        lm.hf_quantizer = quantizer


def _verify_saved(lm: Any, out: Path, remote: bool) -> None:
    from transformers import AutoModelForCausalLM

    param = next(lm.parameters())
    loaded = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=remote, dtype=param.dtype)
    n = min(16, int(lm.config.vocab_size))
    ids = (torch.arange(n, device=param.device) * 7919 % lm.config.vocab_size).view(1, -1)
    was = lm.training
    lm.eval()
    try:
        with torch.no_grad():
            want = lm(input_ids=ids).logits.float()
            got = loaded.to(param.device).eval()(input_ids=ids).logits.float()
    finally:
        lm.train(was)
    diff = float((want - got).abs().max()) if want.shape == got.shape else float("inf")
    allowed = 1e-4 * max(1.0, float(want.abs().max()))
    if not diff <= allowed:
        raise VerificationError(
            f"the directory {out} does not load back as the same model: logits differ by {diff:.3g} "
            f"(allowed {allowed:.3g}, shapes {tuple(want.shape)} vs {tuple(got.shape)}). Please "
            "report it with the model; dmscale.save keeps the exact export")
