"""Write an exported Hugging Face causal LM as a GGUF file that llama.cpp (and so Ollama and
LM Studio) runs, with the ``gguf`` package (llama.cpp's own writer).

Which llama.cpp architecture a model is written as:

============================  ==========================  ===================================
family (``model_type``)       every layer the same size   layers of different sizes (DMS)
============================  ==========================  ===================================
Llama (SmolLM2), Mistral      ``llama``                   ``deci`` (per-layer arrays)
Qwen2 / Qwen2.5               ``qwen2``                   ``deci`` (with the q/k/v biases)
Qwen3                         ``qwen3``                   refused: search ``--layer-uniform``
Gemma 3 (``gemma3_text``)     ``gemma3``                  refused: search ``--layer-uniform``
============================  ==========================  ===================================

llama.cpp reads ``feed_forward_length`` and ``attention.head_count(_kv)`` as a scalar or one
value per layer for every architecture, but only ``deci`` (``src/models/deci.cpp``) builds each
layer at its own size; its graph is Llama's (RMSNorm, SwiGLU, rotary embeddings in GGML's
pair-wise layout) and applies optional q/k/v biases, so Qwen2's per-layer exports fit it too.
A layer without attention is written with ``n_head = n_head_kv = 0`` and no attention tensors;
a layer without FFN but with attention gets a one-unit FFN of zeros (exactly no change):
llama.cpp's ``deci`` graph skips the whole layer, attention included, when ``n_ff = 0``.
The first layer must keep its attention: llama.cpp reads the head size (``n_embd_head_k``,
``n_rot``) only when layer 0 has heads (``hparams.n_head() > 0`` in ``llama-model.cpp``), so
``attention.key_length`` cannot stand in for it. A sublayer-depth search pins that branch with
``SearchConfig(keep_depth=gguf_keep_depth(model))``, which ``--export gguf`` does.

As llama.cpp's converter does: Llama-layout q/k projections (``llama``, ``deci``) are permuted
from Hugging Face's rotate-half layout to GGML's pair-wise one (Qwen's ``qwen2``/``qwen3``
graphs use the rotate-half layout and take them as they are); a tied ``lm_head`` writes no
``output.weight``; 1-D tensors and norms stay float32, the matrices take ``gguf_type``
(``q8_0`` falls back to f16 for a matrix whose rows are not a multiple of 32).

Gemma 3 as the converter writes it (``conversion/gemma.py``): every norm weight plus one
(Gemma's RMSNorm scales by ``1 + w``), q/k in the rotate-half layout, the global and the
sliding layers' rotary bases (``rope.freq_base``, ``rope.freq_base_swa``), the window, and which
layers slide as one boolean per kept layer (``attention.sliding_window_pattern``, read by
llama.cpp's ``load_swa_pattern``), so a depth search keeps each layer's own attention.
llama.cpp scales the embeddings by ``sqrt(hidden)`` and the queries by ``1/sqrt(head_dim)``: a
model whose factors differ (a pruned hidden size, another ``query_pre_attn_scalar``) is refused.

The file is written to a temporary name beside ``path`` and renamed, so a failure never
leaves a half-written model. The tokenizer is embedded by :mod:`dmscale.export.gguf_vocab`.

Example:
    >>> import tempfile, torch, dmscale as dms
    >>> _ = dms.ensure_torchvision()
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> lm = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64,
    ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    >>> path = save_gguf(lm, tempfile.mkdtemp() + "/model.gguf", gguf_type="f32")
    >>> import gguf; gguf.GGUFReader(path).fields["general.architecture"].contents()
    'llama'
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from dmscale.core.errors import StructureError, UnsupportedLayerError
from dmscale.core.masks import GATES_NAME
from dmscale.export.gguf_gemma3 import check_gemma3, gemma3_metadata
from dmscale.export.gguf_vocab import add_tokenizer
from dmscale.export.hf import find_hf_model

__all__ = ["save_gguf", "check_gguf", "gguf_keep_depth", "gguf_layer_sizes", "gguf_architecture",
           "GGUF_TYPES", "UNIFORM_ARCH", "PER_LAYER_ARCH"]

GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")
UNIFORM_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}
PER_LAYER_ARCH = {"llama": "deci", "mistral": "deci", "qwen2": "deci"}
_PERMUTED = ("llama", "deci")  # architectures that rotate pairs (GGML's NORM rope): permute q/k
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def check_gguf(model: nn.Module, layer_uniform: bool) -> None:
    """Raise before a search when its result could not be written as GGUF.

    ``model`` is the Hugging Face causal LM to be searched (or a wrapper holding it);
    ``layer_uniform`` the search's ``SearchConfig.layer_uniform``.

    Raises:
        UnsupportedLayerError: a family llama.cpp cannot run with layers of different sizes
            (the fix: ``--layer-uniform``), or one it cannot run at all from here; an
            export whose first layer has no attention (the fix: ``keep_depth``).
    """
    lm = find_hf_model(model)
    family = lm.config.model_type
    if family not in UNIFORM_ARCH:
        raise UnsupportedLayerError(
            f"{type(lm).__name__} is a {family!r} model: GGUF export supports "
            f"{', '.join(sorted(UNIFORM_ARCH))} (with layers of different sizes only "
            f"{', '.join(sorted(PER_LAYER_ARCH))}); export it with --format hf instead")
    if not layer_uniform and family not in PER_LAYER_ARCH:
        raise UnsupportedLayerError(
            f"{type(lm).__name__} ({family}): llama.cpp runs {family} only with every layer the same "
            f"size (its per-layer architecture 'deci' is Llama's graph, without {family}'s "
            "q/k norms); search with --layer-uniform (SearchConfig(layer_uniform=True)) to export GGUF")
    _rope(lm.config, lm, UNIFORM_ARCH[family] if layer_uniform else PER_LAYER_ARCH[family])
    if family == "gemma3_text":
        check_gemma3(lm)
    else:
        _check_attention_types(lm)
    _check_first_attention(lm)


def _check_first_attention(lm: Any) -> None:
    """Refuse a decoder whose first layer has no attention (see the module docs)."""
    stack = getattr(getattr(lm, "model", None), "layers", None)
    attn = getattr(stack[0], "self_attn", None) if isinstance(stack, nn.ModuleList) and len(stack) else None
    if attn is not None and _part(attn, "q_proj") is None:
        raise UnsupportedLayerError(
            "model.layers.0 has no attention: llama.cpp reads the head size from the first layer "
            "only when it has heads; search with the first layer's attention kept "
            "(SearchConfig(keep_depth=['model.layers.0.self_attn']); --export gguf does this), or "
            "with depth_unit='block'")


def gguf_keep_depth(model: nn.Module) -> list[str]:
    """The module names of ``model`` whose depth units a search must keep for its result to
    run in llama.cpp: the first decoder layer's attention (``SearchConfig(keep_depth=...)``).

    Example:
        >>> import dmscale as dms
        >>> _ = dms.ensure_torchvision()
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> lm = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64,
        ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8))
        >>> gguf_keep_depth(lm)
        ['model.layers.0.self_attn']

    Raises:
        UnsupportedLayerError: no Hugging Face decoder stack with ``self_attn`` at ``model.layers``.
    """
    lm = find_hf_model(model)
    stack = getattr(getattr(lm, "model", None), "layers", None)
    attn = getattr(stack[0], "self_attn", None) if isinstance(stack, nn.ModuleList) and len(stack) else None
    if attn is None:
        raise UnsupportedLayerError(f"{type(lm).__name__}: no attention at model.layers.0.self_attn to keep")
    return [next(name for name, m in model.named_modules() if m is attn)]


def _check_attention_types(lm: Any) -> None:
    types = getattr(lm.config, "layer_types", None) or []
    if any(t != "full_attention" for t in types):
        raise UnsupportedLayerError(
            f"{lm.config.model_type} with sliding-window layers ({sorted(set(types))}): llama.cpp's "
            f"{lm.config.model_type} graph attends to the whole context; export with --format hf")


def _part(module: Any, name: str) -> nn.Linear | None:
    """A projection, or None when the export removed it (absent, or no rows / columns)."""
    p = getattr(module, name, None) if module is not None else None
    if p is None or (isinstance(p, nn.Linear) and p.weight.numel() == 0):
        return None
    if not isinstance(p, nn.Linear):
        raise UnsupportedLayerError(f"{name} is a {type(p).__name__}, not a Linear layer")
    return p


def gguf_layer_sizes(lm: Any) -> tuple[int, list[list[int]]]:
    """``(head_dim, [[heads, kv_heads, ffn], ...])`` of a Llama-family decoder, 0 for a removed
    attention or FFN (read from the projection shapes).

    Raises:
        UnsupportedLayerError: not a Llama-family decoder stack; StructureError: shapes that
            do not fit together or head sizes that differ between layers.
    """
    stack = getattr(getattr(lm, "model", None), "layers", None)
    if not isinstance(stack, nn.ModuleList):
        raise UnsupportedLayerError(f"{type(lm).__name__}: no decoder stack at model.layers")
    dims, sizes = set(), []
    for i, layer in enumerate(stack):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        try:
            q, k, v, o = (_part(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
            gate, up, down = (_part(mlp, n) for n in ("gate_proj", "up_proj", "down_proj"))
        except UnsupportedLayerError as err:
            raise UnsupportedLayerError(f"model.layers.{i}: {err}") from None
        heads = kv = ffn = 0
        if any(p is not None for p in (q, k, v, o)):
            if None in (q, k, v, o) or not hasattr(attn, "head_dim"):
                raise StructureError(f"model.layers.{i}: the attention has only some of q/k/v/o_proj")
            d = int(attn.head_dim)
            dims.add(d)
            heads, kv = q.out_features // d, k.out_features // d
            if q.out_features % d or k.out_features % d or v.out_features != k.out_features \
                    or o.in_features != q.out_features or heads % kv:
                raise StructureError(f"model.layers.{i}: attention shapes q {tuple(q.weight.shape)}, "
                                     f"k {tuple(k.weight.shape)}, o {tuple(o.weight.shape)} do not fit head_dim {d}")
        if any(p is not None for p in (gate, up, down)):
            if None in (gate, up, down) or up.out_features != gate.out_features \
                    or down.in_features != gate.out_features:
                raise StructureError(f"model.layers.{i}: the MLP's gate/up/down_proj do not fit together")
            ffn = gate.out_features
        sizes.append([heads, kv, ffn])
    if len(dims) != 1:
        raise StructureError(f"head_dim must be one size in every layer with attention, found {sorted(dims)}")
    return dims.pop(), sizes


def gguf_architecture(model: nn.Module) -> str:
    """The llama.cpp architecture ``model`` is written as (see the module docs)."""
    lm = find_hf_model(model)
    _, sizes = gguf_layer_sizes(lm)
    uniform = all(s == sizes[0] for s in sizes) and 0 not in sizes[0]
    check_gguf(lm, layer_uniform=uniform)
    return (UNIFORM_ARCH if uniform else PER_LAYER_ARCH)[lm.config.model_type]


def _rope(config: Any, lm: Any, arch: str) -> tuple[float, torch.Tensor | None, dict[str, Any]]:
    """``(freq_base, rope_freqs factors or None, extra scaling keys)`` of the model's rotary
    embedding; raises for a rotary scaling llama.cpp's architecture would not reproduce."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if "full_attention" in params:
        params = dict(params["full_attention"])
    theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if float(params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0) or 1.0)) != 1.0:
        raise UnsupportedLayerError("a partial rotary embedding is not supported by the GGUF export")
    if kind == "default":
        return theta, None, {}
    if kind == "linear":
        return theta, None, {"linear": float(params["factor"])}
    if kind == "llama3" and arch in _PERMUTED:
        rotary = getattr(getattr(lm, "model", None), "rotary_emb", None)
        inv = getattr(rotary, "inv_freq", None)
        if inv is None:
            raise UnsupportedLayerError("llama3 rotary scaling without model.rotary_emb.inv_freq")
        dim = 2 * inv.numel()
        base = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        return theta, (base / inv.double()).float(), {}  # llama.cpp divides each frequency by it
    raise UnsupportedLayerError(f"rotary scaling {kind!r} is not supported by the GGUF export to "
                                f"{arch} (supported: default, linear, llama3 for Llama)")


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Hugging Face's rotate-half rows of each head -> GGML's interleaved pairs (q/k, weight or bias)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensors(lm: Any, arch: str, sizes: list[list[int]], head_dim: int) -> Iterator[tuple[str, torch.Tensor]]:
    """``(Hugging Face name, float32 tensor)`` of everything the GGUF file holds, in llama.cpp's layout."""
    tied = lm.get_output_embeddings() is None or \
        lm.get_output_embeddings().weight.data_ptr() == lm.get_input_embeddings().weight.data_ptr()
    for name, t in lm.state_dict().items():
        if name == "lm_head.weight" and tied:
            continue
        t = t.detach().float().cpu()
        if arch == "gemma3" and name.endswith("norm.weight"):
            t = t + 1.0  # Gemma3RMSNorm: x * (1 + w); llama.cpp's norm: x * w
        m = _LAYER.match(name)
        if m is None:
            yield name, t
            continue
        heads, kv, ffn = sizes[int(m.group(1))]
        if (".self_attn." in name or ".input_layernorm." in name) and heads == 0:
            continue  # no attention: llama.cpp's deci creates none of its tensors
        if ".post_attention_layernorm." in name and ffn == 0 and heads == 0:
            continue  # an empty layer
        if ".mlp." in name and ffn == 0:
            continue
        if arch in _PERMUTED and name.endswith(("q_proj.weight", "q_proj.bias")):
            t = _permute(t, heads)
        elif arch in _PERMUTED and name.endswith(("k_proj.weight", "k_proj.bias")):
            t = _permute(t, kv)
        yield name, t
    hidden = lm.get_input_embeddings().embedding_dim
    state = lm.state_dict()
    for i, (heads, _, ffn) in enumerate(sizes):
        if ffn == 0 and heads > 0:  # deci skips the layer's attention with n_ff = 0: a zero FFN instead
            for part, shape in (("gate_proj", (1, hidden)), ("up_proj", (1, hidden)), ("down_proj", (hidden, 1))):
                yield f"model.layers.{i}.mlp.{part}.weight", torch.zeros(shape)
            norm = f"model.layers.{i}.post_attention_layernorm.weight"
            if norm not in state:  # removed with its FFN branch (a ZeroBranch); deci needs ffn_norm
                yield norm, torch.ones(hidden)


def _write_metadata(w: Any, lm: Any, arch: str, sizes: list[list[int]], head_dim: int,
                    file_type: Any, rope: tuple[float, torch.Tensor | None, dict[str, Any]]) -> None:
    import gguf

    config = lm.config
    uniform = arch != "deci"
    heads, kvs, ffns = ([s[j] for s in sizes] for j in range(3))
    if arch == "deci":  # the zero FFN of a layer with attention and no FFN (see _tensors)
        ffns = [1 if f == 0 and h > 0 else f for h, f in zip(heads, ffns)]
    w.add_block_count(len(sizes))
    w.add_context_length(int(getattr(config, "max_position_embeddings", 0) or 4096))
    w.add_embedding_length(lm.get_input_embeddings().embedding_dim)
    w.add_feed_forward_length(ffns[0] if uniform else ffns)
    w.add_head_count(heads[0] if uniform else heads)
    w.add_head_count_kv(kvs[0] if uniform else kvs)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    w.add_vocab_size(lm.get_input_embeddings().num_embeddings)
    theta, _, extra = rope
    w.add_rope_freq_base(theta)
    if arch == "gemma3":
        gemma3_metadata(w, lm)
    if "linear" in extra:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(extra["linear"])
    w.add_file_type(file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _qtype(name: str, data: Any, wanted: Any) -> Any:
    import gguf

    if data.ndim <= 1 or name.endswith("_norm.weight"):
        return gguf.GGMLQuantizationType.F32
    return wanted


def save_gguf(model: nn.Module, path: str | os.PathLike, tokenizer: Any = None,
              gguf_type: str = "f16") -> Path:
    """Write ``model`` (an export of a Hugging Face causal LM) as a GGUF file for llama.cpp.

    Args:
        model: ``searcher.export()`` of a ``*ForCausalLM`` of Llama (SmolLM2), Mistral, Qwen2
            or Qwen3 (or a wrapper holding it, such as the text task's ``CausalLM``).
        path: the file written (replaced when it exists).
        tokenizer: a path to a ``.gguf`` file whose tokenizer is copied (the most exact:
            the file the model came from), or the Hugging Face tokenizer (byte-level BPE);
            None writes no tokenizer (with a warning).
        gguf_type: ``f32``, ``f16``, ``bf16`` or ``q8_0`` for the weight matrices.

    Returns the path. Raises :class:`UnsupportedLayerError` for what llama.cpp cannot run (see
    the module docs) and :class:`StructureError` for a model still prepared for a search.
    """
    import gguf

    if gguf_type not in GGUF_TYPES:
        raise UnsupportedLayerError(f"gguf_type must be one of {', '.join(GGUF_TYPES)}, got {gguf_type!r}")
    lm = find_hf_model(model)
    if hasattr(lm, GATES_NAME) or hasattr(model, GATES_NAME):
        raise StructureError("the model is still prepared for a search (it has dms_gates): save "
                             "searcher.export(), the physically smaller copy")
    head_dim, sizes = gguf_layer_sizes(lm)
    arch = gguf_architecture(lm)
    rope = _rope(lm.config, lm, arch)
    qtype = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
             "bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0}[gguf_type]
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[gguf_type]
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], len(sizes))
    writer = gguf.GGUFWriter(tmp, arch)
    try:
        _write_metadata(writer, lm, arch, sizes, head_dim, file_type, rope)
        add_tokenizer(writer, tokenizer, lm.get_input_embeddings().num_embeddings)
        if not any("general.name" in kv for kv in writer.kv_data):  # else copied from the source GGUF
            writer.add_name(Path(getattr(lm.config, "_name_or_path", "") or type(lm).__name__).name)  # no paths
        for hf_name, t in _tensors(lm, arch, sizes, head_dim):
            name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            if name is None:
                raise UnsupportedLayerError(f"{hf_name}: no GGUF tensor of {arch} for it")
            data = t.numpy()
            q = _qtype(name, data, qtype)
            try:
                encoded = gguf.quants.quantize(data, q)
            except gguf.QuantError:  # rows not a multiple of the block: f16, as the converter
                q = gguf.GGMLQuantizationType.F16
                encoded = gguf.quants.quantize(data, q)
            writer.add_tensor(name, encoded, raw_dtype=q)
        if rope[1] is not None:
            writer.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", rope[1].numpy())
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, out)
    finally:
        writer.close()
        if tmp.exists():
            tmp.unlink()
    return out
