"""Gemma 3 in llama.cpp's ``gemma3`` architecture: what the GGUF export checks and writes
beyond the Llama family's (part of :mod:`dmscale.export.gguf`).

llama.cpp's graph (``src/models/gemma3.cpp``) scales the embeddings by ``sqrt(hidden)`` and the
queries by ``1/sqrt(head_dim)`` (``1/sqrt(hidden/heads)`` for the 62-layer 27B), applies its
q/k norms and the post-attention and post-FFN norms, and runs the sliding-window layers with
their own rotary base; which layers slide is one boolean per layer
(``gemma3.attention.sliding_window_pattern``, ``load_swa_pattern`` in ``src/llama-model.cpp``),
so the layers a depth search keeps keep their own attention.
"""

from __future__ import annotations

from typing import Any

from dmscale.core.errors import UnsupportedLayerError

__all__ = ["check_gemma3", "gemma3_metadata"]


def check_gemma3(lm: Any) -> None:
    """Refuse a Gemma 3 whose scales llama.cpp's ``gemma3`` graph would not reproduce."""
    config = lm.config
    hidden = lm.get_input_embeddings().embedding_dim
    scale = getattr(lm.get_input_embeddings(), "scalar_embed_scale", hidden ** 0.5)
    if abs(float(scale) - hidden ** 0.5) > 1e-6 * hidden ** 0.5:
        raise UnsupportedLayerError(
            f"Gemma 3 scales its embeddings by {float(scale):.4g}, llama.cpp by sqrt(hidden) = {hidden ** 0.5:.4g} "
            "(the hidden size was pruned): keep it (--exclude lm.model.embed_tokens; a --layer-uniform "
            "search keeps it) to export GGUF")
    n_layer = len(lm.model.layers)
    heads = max(1, int(config.num_attention_heads))
    ours = float(config.query_pre_attn_scalar) ** -0.5
    theirs = (hidden / heads) ** -0.5 if n_layer == 62 else float(config.head_dim) ** -0.5
    if abs(ours - theirs) > 1e-6 * theirs:
        raise UnsupportedLayerError(
            f"Gemma 3 scales its queries by query_pre_attn_scalar^-0.5 = {ours:.4g}, llama.cpp's gemma3 graph "
            f"with {n_layer} layers by {theirs:.4g}; export it with --format hf instead")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise UnsupportedLayerError("Gemma 3 with attention logit soft-capping: llama.cpp's gemma3 graph has none")
    local = dict((getattr(config, "rope_parameters", None) or {}).get("sliding_attention") or {})
    if local.get("rope_type", "default") != "default":
        raise UnsupportedLayerError(f"Gemma 3's sliding layers use rotary scaling {local['rope_type']!r}; "
                                    "llama.cpp scales only the global layers")


def gemma3_metadata(w: Any, lm: Any) -> None:
    """The sliding window, which kept layers slide, the sliding layers' rotary base and the
    final soft-capping of a Gemma 3 (see the module docs)."""
    config = lm.config
    types = [getattr(layer.self_attn, "layer_type", None) or "full_attention" for layer in lm.model.layers]
    if any(t == "sliding_attention" for t in types):
        w.add_sliding_window(int(config.sliding_window))
        w.add_sliding_window_pattern([t == "sliding_attention" for t in types])
        local = (getattr(config, "rope_parameters", None) or {}).get("sliding_attention") or {}
        w.add_rope_freq_base_swa(float(local.get("rope_theta", getattr(config, "rope_local_base_freq", 10000.0))))
    if getattr(config, "final_logit_softcapping", None):
        w.add_final_logit_softcapping(float(config.final_logit_softcapping))
