"""Attention heads: handlers for timm ViT, Hugging Face Llama-family, GPT-2 and BERT attention.

An attention module is one opaque operation. Its heads become one searchable dimension
named ``<module>.heads`` (lambda = 4N, paper A.1.1) whose element is a key/value group: with
grouped-query attention (GQA) a unit is one KV head together with its query heads, so every
remaining KV head keeps the same number of query heads and ``num_key_value_groups`` stays
valid. The head mask multiplies each head's output before the output projection, which is
``V' = V m_head`` of the paper (the Q and K masks only rescale scores of heads whose output
is masked anyway).

Per-head dims (the paper's m_qk and m_v) are searched for timm ``Attention``, as one dim
``<module>.head_dim`` shared by q, k and v (timm reshapes all three with one ``head_dim``):
their channels get the mask m_head x m_hd on the qkv projection's output. The supernet
scales scores by s_old = original_head_dim ** -0.5; the export folds s_old / s_new into the
query rows of ``qkv`` (weight and bias) and sets ``scale = s_new`` (new_head_dim ** -0.5),
so fused SDPA, which scales by 1/sqrt(new head dim), and the explicit path, which uses
``scale``, both compute the supernet's scores: ``fused_attn`` stays as it was and the export
keeps the fast kernel. Not searched: Hugging Face and nn.MultiheadAttention head dims (the
scale is derived from the head dim, GPT-2 from the value dim, and RoPE rotates dims i and
i + D/2 together). Their exports therefore need no fold: pruning whole heads (or KV groups)
leaves every kept head's dim, and so its softmax scale, unchanged, and no export switches a
fused path off (Hugging Face keeps its ``attn_implementation``, nn.MultiheadAttention is
never pruned).

Example:
    >>> import dmscale as dms
    >>> _ = dms.ensure_torchvision()
    >>> import timm, torch
    >>> vit = timm.create_model("deit_tiny_patch16_224", pretrained=False, img_size=32, num_classes=4)
    >>> space = dms.discover(vit, torch.randn(1, 3, 32, 32))
    >>> [d.size for d in space.width if d.name.endswith(".heads")][:2]
    [3, 3]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch
from torch import nn

from dmscale.core._compat import ensure_torchvision
from dmscale.core.errors import StructureError
from dmscale.trace.handlers.base import (Handler, _slice_param, handler_for, register_family_loader, register_handler,
                       register_weight_standardised)

if TYPE_CHECKING:
    from dmscale.trace.protocol import TraceRecorder

__all__ = ["AttentionSpec", "attention_handler", "CONV1D"]


@dataclass
class AttentionSpec:
    """Where an attention module keeps its projections and head counts.

    Attributes:
        name: handler name (stored in structure files).
        q, k, v: child names of separate projections, or None with ``qkv``.
        qkv: child name of a fused projection laid out as (3, heads, head_dim).
        o: child name of the output projection, None when the module returns the heads'
            concatenated outputs (BERT: the projection lives in a sibling module).
        heads: ``module -> (num_heads, num_kv_heads, head_dim)``.
        update: ``(module, kept_units, kept_head_dim) -> None``: fix head-count and head-dim
            attributes after pruning (``kept_head_dim`` None: head dim not searched).
        head_dim: ``module -> bool``: search the per-head dim too (one dim shared by q, k and
            v, m_qk = m_v), where the model code allows it.
        o_returned: the module's (first) output is ``o``'s output, through dropout at most
            (known model code: ``return self.o_proj(h), weights``), so a depth mask on the
            module's output may be folded into ``o``'s weight and bias.
    """

    name: str
    q: str | None
    k: str | None
    v: str | None
    qkv: str | None
    o: str | None
    heads: Callable[[nn.Module], tuple[int, int, int]]
    update: Callable[[nn.Module, int, int | None], None]
    head_dim: Callable[[nn.Module], bool] = lambda m: False
    o_returned: bool = False


def _first_output(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out[0]


def _cross_head_child(spec: AttentionSpec, m: nn.Module, head_dim: int) -> str | None:
    """A child with weights other than the projections, unless it only holds per-head-dim
    weights (Qwen3 / Gemma3 q_norm and k_norm over ``head_dim``, shared by every head)."""
    projections = {spec.q, spec.k, spec.v, spec.qkv, spec.o} - {None}
    for child, module in m.named_children():
        if child in projections:
            continue
        for p in module.parameters():
            if p.dim() != 1 or p.numel() != head_dim:
                return child
    return None


def attention_handler(spec: AttentionSpec) -> Handler:
    """A :class:`Handler` for attention modules described by ``spec``."""

    def trace(tr: "TraceRecorder", name: str, m: nn.Module, args: tuple, out: Any) -> None:
        x = args[0]  # the tracer passes the first tensor input (hidden_states) positionally
        y = _first_output(out)
        in_ids = tr.take_channel_label(tr.label_of(x), x.dim() - 1, f"input of {name}")
        n_heads, n_kv, d = spec.heads(m)
        group = n_heads // n_kv
        units = tr.produce(name + ".heads", n_kv, kind="heads")
        other = _cross_head_child(spec, m, d)
        if other is not None:  # e.g. OLMo-2's q_norm over all heads at once: heads stay fixed
            tr.pin_ids(units, f"{name}.{other} has weights across all heads (not per head)")
        dims = None
        if spec.head_dim(m) and group == 1:  # (head, dim) channels: mask m_head * m_hd
            dims = tr.produce(name + ".head_dim", d)
            q_ids = kv_ids = tr.product(units, dims)
        else:
            q_ids, kv_ids = np.repeat(units, group * d), np.repeat(units, d)

        masked = dims is not None  # Q' = Q m_qk m_head etc. (A.1.1) on the projections' outputs

        def child(attr: str | None, ins: np.ndarray | None, outs: np.ndarray | None,
                  mask_output: bool = False) -> None:
            if attr is None:
                return
            full = f"{name}.{attr}"
            tr.record_layer(full, handler_for(m.get_submodule(attr)).name, ins, outs, mask_output=mask_output)

        if spec.qkv is not None:
            child(spec.qkv, in_ids, np.concatenate([q_ids, kv_ids, kv_ids]), masked)
        else:
            child(spec.q, in_ids, q_ids, masked)
            child(spec.k, in_ids, kv_ids, masked)
            child(spec.v, in_ids, kv_ids, masked)
        # QK^T and AV: MACs proportional to the heads kept (x the head dim kept, if searched)
        tr.record_layer(name + ".core", "attention_core", units, dims,
                        macs_sides=("in", "out") if masked else ("in",), virtual=True)
        tr.record_layer(name, spec.name, units, dims, macs_sides=(), macs_override=0)
        if spec.o is not None:
            o_mod = m.get_submodule(spec.o)
            width = o_mod.weight.shape[0] if handler_for(o_mod).name == "linear" else o_mod.weight.shape[1]
            o_ids = tr.produce(f"{name}.{spec.o}", width)
            child(spec.o, q_ids, o_ids)
            tr.set_label(y, y.dim() - 1, o_ids)
        else:
            tr.set_label(y, y.dim() - 1, q_ids)

    def prune(m: nn.Module, in_keep: torch.Tensor | None, out_keep: torch.Tensor | None) -> None:
        _, n_kv, _ = spec.heads(m)
        units = n_kv if in_keep is None else int(in_keep.numel())
        spec.update(m, units, None if out_keep is None else int(out_keep.numel()))

    output_layer = (lambda m: spec.o) if spec.o is not None and spec.o_returned else None
    def kv_shape(m: nn.Module) -> tuple[int, int]:  # (KV heads, head dim) of the module now
        _, n_kv, d = spec.heads(m)
        return int(n_kv), int(d)

    return Handler(spec.name, trace, prune, lambda m: {}, lambda m: (), channel_dim=-1,
                   output_layer=output_layer, kv_shape=kv_shape)


# ----------------------------------------------------------------------------- Conv1D (GPT-2)


def _conv1d_trace(tr: "TraceRecorder", name: str, m: nn.Module, args: tuple, out: torch.Tensor) -> None:
    x = args[0]
    in_ids = tr.take_channel_label(tr.label_of(x), x.dim() - 1, f"input of {name}")
    out_ids = tr.produce(name, m.weight.shape[1])
    tr.record_layer(name, "conv1d", in_ids, out_ids)
    tr.set_label(out, out.dim() - 1, out_ids)


def _conv1d_prune(m: nn.Module, in_keep: torch.Tensor | None, out_keep: torch.Tensor | None) -> None:
    _slice_param(m, "weight", 1, out_keep)  # Hugging Face Conv1D: weight is (in, out)
    _slice_param(m, "bias", 0, out_keep)
    _slice_param(m, "weight", 0, in_keep)
    m.nf = m.weight.shape[1]
    if hasattr(m, "nx"):
        m.nx = m.weight.shape[0]


CONV1D = Handler(
    "conv1d", _conv1d_trace, _conv1d_prune, lambda m: {"weight": {1: "out", 0: "in"}, "bias": {0: "out"}},
    lambda m: ("in", "out"), channel_dim=-1,
)

# ----------------------------------------------------------------------------- families


def _set(**attrs: Callable[[nn.Module, int], int]) -> Callable[[nn.Module, int, int | None], None]:
    def update(m: nn.Module, kept: int, head_dim: int | None) -> None:
        for attr, fn in attrs.items():
            setattr(m, attr, fn(m, kept))
    return update


def _update_timm(m: nn.Module, kept: int, head_dim: int | None) -> None:
    if head_dim is not None and head_dim != m.head_dim:
        _fold_timm_scale(m, head_dim)
        m.head_dim = head_dim
    m.num_heads = kept
    m.attn_dim = kept * m.head_dim


def _timm_supernet_scale(m: nn.Module) -> float:
    """The softmax scale the supernet's forward used: fused SDPA scales by 1/sqrt of q's
    last dim (the unpruned ``head_dim``), the explicit path by the stored ``m.scale``."""
    return float(m.head_dim) ** -0.5 if getattr(m, "fused_attn", False) else float(m.scale)


def _fold_timm_scale(m: nn.Module, new_head_dim: int) -> None:
    """Give a timm Attention whose head dim shrinks to ``new_head_dim`` the supernet's scores
    on both paths: the q rows of ``qkv`` are multiplied by s_old / s_new, ``m.scale = s_new``
    (s_new = new_head_dim ** -0.5), so that fused SDPA (which scales by 1/sqrt(new_head_dim))
    and the explicit path (``m.scale``) both compute (q s_old / s_new) k^T s_new = q k^T s_old.

    Called once per module, before ``m.head_dim`` changes. The q rows are the first third of
    qkv's output dim ((3, heads, head_dim) layout) whether or not qkv is already sliced: the
    structure keeps the q, k and v channels in that order.
    """
    s_old, s_new = _timm_supernet_scale(m), float(new_head_dim) ** -0.5
    qkv = m.qkv
    if not isinstance(qkv, nn.Linear):  # a replaced projection (no plain q rows to scale):
        m.scale, m.fused_attn = s_old, False  # the explicit path, with the supernet's scale
        return
    rows = qkv.weight.shape[0]
    if rows % 3:
        raise StructureError(f"timm Attention qkv: expected an output dim divisible by 3 "
                             f"(q, k, v), got {rows}")
    factor = s_old / s_new
    with torch.no_grad():
        for p in (qkv.weight, qkv.bias):
            if p is not None:
                q = p[: rows // 3]  # (heads * head_dim, in) weight rows / (heads * head_dim,) bias
                q.copy_((q.double() * factor).to(p.dtype))
    m.scale = s_new


def _timm_head_dim_ok(m: nn.Module) -> bool:
    """timm reshapes q, k, v with one head_dim and scales by the stored self.scale on the
    non-fused path; a q/k norm over head_dim would change with the kept dims."""
    return isinstance(m.q_norm, nn.Identity) and isinstance(m.k_norm, nn.Identity) and hasattr(m, "scale")


def _hf_qkvo_heads(m: nn.Module) -> tuple[int, int, int]:
    d = m.head_dim
    n_heads = m.q_proj.weight.shape[0] // d
    n_kv = m.k_proj.weight.shape[0] // d
    return n_heads, n_kv, d


def _is_hf_qkvo(m: nn.Module) -> bool:
    """Hugging Face Llama-family attention: q/k/v/o_proj Linears, head_dim, KV groups."""
    return all(isinstance(getattr(m, c, None), nn.Linear) for c in ("q_proj", "k_proj", "v_proj", "o_proj")) \
        and hasattr(m, "head_dim") and hasattr(m, "num_key_value_groups") and type(m).__module__.startswith("transformers")


HF_QKVO = AttentionSpec("attn_hf_qkvo", "q_proj", "k_proj", "v_proj", None, "o_proj", _hf_qkvo_heads,
                        _set(), o_returned=True)


def _mha_trace(tr: "TraceRecorder", name: str, m: nn.Module, args: tuple, out: Any) -> None:
    """torch.nn.MultiheadAttention derives head_dim = embed_dim // num_heads and uses one
    embed_dim for its input, its q/k/v width and its output: neither its heads nor the
    hidden dim around it can shrink without changing the class. Both stay fixed."""
    for t in args:
        tr.pin_label(tr.label_of(t), f"nn.MultiheadAttention {name} (embed_dim and heads are fixed)")
    tr.record_layer(name, "mha", None, None, macs_sides=())


MHA = Handler("mha", _mha_trace, lambda m, i, o: None, lambda m: {}, lambda m: (), channel_dim=-1)
register_handler(nn.MultiheadAttention, MHA)

_REGISTERED: set[str] = set()


def register_available() -> None:
    """Register the families whose library the process has imported (no import cost)."""
    import sys

    if "transformers" in sys.modules and "transformers" not in _REGISTERED:
        _REGISTERED.add("transformers")
        _register_transformers()
    if "timm" in sys.modules and "timm" not in _REGISTERED:
        _REGISTERED.add("timm")
        _register_timm()


def _register_transformers() -> None:
    register_handler(_is_hf_qkvo, attention_handler(HF_QKVO))
    try:
        from transformers.pytorch_utils import Conv1D
        from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
        from transformers.models.bert.modeling_bert import BertSelfAttention
    except Exception:  # transformers missing or incompatible: nothing to register
        Conv1D = GPT2Attention = BertSelfAttention = None
    if Conv1D is not None:
        register_handler(Conv1D, CONV1D)
        register_handler(
            lambda m: isinstance(m, GPT2Attention) and not m.is_cross_attention,
            attention_handler(AttentionSpec(
                "attn_gpt2", None, None, None, "c_attn", "c_proj",
                lambda m: (m.num_heads, m.num_heads, m.head_dim),
                _set(num_heads=lambda m, k: k, embed_dim=lambda m, k: k * m.head_dim,
                     split_size=lambda m, k: k * m.head_dim))))
        register_handler(BertSelfAttention, attention_handler(AttentionSpec(
            "attn_bert", "query", "key", "value", None, None,
            lambda m: (m.num_attention_heads, m.num_attention_heads, m.attention_head_size),
            _set(num_attention_heads=lambda m, k: k, all_head_size=lambda m, k: k * m.attention_head_size))))


def _register_timm() -> None:
    try:
        ensure_torchvision()
        from timm.layers.attention import Attention as TimmAttention
    except Exception:
        TimmAttention = None
    try:
        from timm.layers import std_conv
    except Exception:
        std_conv = None
    for cls in ("StdConv2d", "StdConv2dSame", "ScaledStdConv2d", "ScaledStdConv2dSame"):
        if hasattr(std_conv, cls):
            register_weight_standardised(getattr(std_conv, cls))
    if TimmAttention is not None:
        register_handler(
            lambda m: type(m) is TimmAttention and m.gate is None,
            attention_handler(AttentionSpec(
                "attn_timm", None, None, None, "qkv", "proj",
                lambda m: (m.num_heads, m.num_heads, m.head_dim), _update_timm, _timm_head_dim_ok,
                o_returned=True)))


register_family_loader(register_available)
