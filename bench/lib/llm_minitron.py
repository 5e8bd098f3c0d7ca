"""Minitron-style width pruning of a Llama-family causal LM (a Table 5 baseline).

Minitron (Muralidharan et al. 2024, "Compact Language Models via Pruning and Knowledge
Distillation") ranks attention heads, FFN units and embedding (hidden) channels by their
*activations* on a small calibration set -- forward passes only -- prunes every layer to the same
widths, and recovers with logits distillation from the unpruned model. NVIDIA ModelOpt ships it
as ``modelopt.torch.prune`` mode ``mcore_minitron``, which works on Megatron-Core models only
(it imports Megatron-Core and Transformer Engine); this module is the same method, hand-written
for a Hugging Face ``LlamaForCausalLM``, its importance aggregated exactly as ModelOpt 0.47's
hooks aggregate it:

* per channel of an activation ``a`` of shape (batch, sequence, C): ``|a|`` averaged over the
  sequence, then the L2 norm over the batch's sequences (summed squares across calibration
  batches, one square root at the end);
* **heads** (:func:`activation_scores`): the input of ``o_proj`` (the attention heads' outputs),
  per channel as above, then the L2 norm over each head's ``head_dim`` channels;
* **FFN units**: the input of ``down_proj`` (``act(gate) * up``), per channel;
* **hidden channels**: the outputs of every layer's two RMSNorms (``input_layernorm`` and
  ``post_attention_layernorm``, the norms ModelOpt hooks through its fused layernorm-linears),
  per channel, summed over the norms.

GQA: as ModelOpt's ``NumAttentionHeadsHp``, query heads are pruned *within* each KV group, the
same number in every group (the top ones of each group by importance, per layer); the KV heads
are all kept. Hidden channels are one global choice (embedding, every norm and projection, the
tied head); FFN units and heads are chosen per layer at one width for all layers.

The widths (:func:`minitron_widths`), Minitron's width-only recipe: the hidden size and the FFN
units are cut at one kept fraction (Minitron-8B from Nemotron-4 15B: 6144 -> 4096 and 24576 ->
16384, both 2/3), and query heads only when their own kept fraction lies nearer that fraction
than keeping all of them does (Minitron-8B kept all 48 heads; Minitron-4B, cut further from 8B,
halved them to 24 beside 0.75 / 0.56 of hidden / FFN): for each number of query heads per
group, the (hidden, FFN) pair with the closest kept fractions that meets the target; of those,
the one whose head fraction is nearest its hidden / FFN fraction. The hidden size is a multiple
of the kept query heads (transformers 5 refuses to save a Llama config otherwise).

Example (a tiny random Llama):
    >>> import dmscale as dms; _ = dms.ensure_torchvision()
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> lm = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=24, intermediate_size=32,
    ...     num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, head_dim=4,
    ...     tie_word_embeddings=True))
    >>> w = minitron_widths(lm, int(0.7 * count_params(lm)))
    >>> expected = minitron_count(lm, **w)
    >>> minitron_prune(lm, activation_scores(lm, [torch.randint(0, 32, (2, 8))]), **w)
    >>> lm.config.hidden_size == w["hidden"] and count_params(lm) == expected
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import nn

from dmscale.errors import ConfigError
from bench.lib.llm_baselines_lib import count_params, decoder, group_sizes, hidden_ffn_count, slice_linear

__all__ = ["MinitronScores", "activation_scores", "minitron_count", "minitron_widths", "minitron_prune",
           "kept_widths"]


@dataclass
class MinitronScores:
    """Activation importance: per layer, one score per query head and per FFN unit; one score
    per hidden channel for the whole model."""

    heads: list[torch.Tensor]  # per layer (query heads,), KV group g owns heads g * P .. g * P + P - 1
    ffn: list[torch.Tensor]  # per layer (FFN units,)
    hidden: torch.Tensor  # (hidden,)


def _channel_sq(a: torch.Tensor) -> torch.Tensor:
    """(batch, sequence, C) -> (C,): the squares, summed over the batch, of |a| averaged over the
    sequence (ModelOpt's per-batch accumulation; the square root comes at the end)."""
    a = a.detach().float()
    if a.dim() == 2:  # (sequence, C): one sequence
        a = a[None]
    return a.abs().mean(dim=1).pow(2).sum(dim=0)


@torch.no_grad()
def activation_scores(model: nn.Module, batches: Iterable[torch.Tensor]) -> MinitronScores:
    """Minitron's activation importance of every query head, FFN unit and hidden channel of
    ``model``, from forward passes over ``batches`` (token ids (B, T)); the model is left as it
    was (mode, hooks)."""
    lm, s = decoder(model), group_sizes(model)
    layers = lm.model.layers
    sums: dict[tuple[str, int], torch.Tensor] = {}

    def add(key: tuple[str, int], a: torch.Tensor) -> None:
        sq = _channel_sq(a)
        sums[key] = sums[key] + sq if key in sums else sq

    def pre(key: tuple[str, int]) -> Callable[..., None]:
        return lambda mod, args: add(key, args[0])

    def post(key: tuple[str, int]) -> Callable[..., None]:
        return lambda mod, args, out: add(key, out)

    handles = []
    for i, layer in enumerate(layers):
        handles += [layer.self_attn.o_proj.register_forward_pre_hook(pre(("heads", i))),
                    layer.mlp.down_proj.register_forward_pre_hook(pre(("ffn", i))),
                    layer.input_layernorm.register_forward_hook(post(("norm", 2 * i))),
                    layer.post_attention_layernorm.register_forward_hook(post(("norm", 2 * i + 1)))]
    was = model.training
    model.eval()
    try:
        n = 0
        for ids in batches:
            model(ids)
            n += 1
    finally:
        for h in handles:
            h.remove()
        model.train(was)
    if n == 0:
        raise ConfigError("activation_scores needs at least one calibration batch; got none")
    hd = s["head_dim"]
    heads = [sums["heads", i].sqrt().view(-1, hd).norm(dim=1).cpu() for i in range(len(layers))]
    ffn = [sums["ffn", i].sqrt().cpu() for i in range(len(layers))]
    hidden = torch.stack([sums["norm", j].sqrt() for j in range(2 * len(layers))]).sum(0).cpu()
    return MinitronScores(heads=heads, ffn=ffn, hidden=hidden)


def minitron_count(model: nn.Module, q_per_group: int, hidden: int, ffn: int) -> int:
    """The parameter count of ``model`` (a bias-free Llama, every layer alike) with
    ``q_per_group`` query heads per KV group, a hidden size of ``hidden`` and ``ffn`` FFN units
    in every layer."""
    lm, s = decoder(model), group_sizes(model)
    cut_heads = (s["per_group"] - q_per_group) * s["kv_heads"]  # query rows and o_proj columns go
    return hidden_ffn_count(model, hidden, ffn) - len(lm.model.layers) * 2 * cut_heads * s["head_dim"] * hidden


def minitron_widths(model: nn.Module, target: int, keep_heads: bool = False) -> dict[str, int]:
    """``{"q_per_group", "hidden", "ffn"}`` whose count is nearest ``target``, by the rule of the
    module docstring (hidden and FFN at one kept fraction, heads cut only when that fraction is
    nearer theirs; the hidden size a multiple of the query heads kept); ``keep_heads`` keeps
    every head whatever the fraction (the Minitron-8B recipe at any target)."""
    s = group_sizes(model)
    per_ffn_unit = 3 * len(decoder(model).model.layers)  # gate row, up row, down column: x hidden
    options = []
    for q in range(s["per_group"] if keep_heads else 1, s["per_group"] + 1):
        step = q * s["kv_heads"]
        best = None
        for h in range(step, s["hidden"] + 1, step):
            f = round((target - minitron_count(model, q, h, 0)) / (per_ffn_unit * h))
            if not 1 <= f <= s["ffn"]:
                continue
            gap = abs(h / s["hidden"] - f / s["ffn"])
            if best is None or gap < best[0]:
                best = (gap, h, f)
        if best is not None:
            _, h, f = best
            ratio = (h / s["hidden"] + f / s["ffn"]) / 2
            options.append((abs(q / s["per_group"] - ratio), -q, {"q_per_group": q, "hidden": h, "ffn": f}))
    if not options:
        raise ConfigError(f"no uniform (query heads, hidden size, FFN units) reaches {target:,} parameters "
                          f"from {count_params(model):,}: give a target between the smallest such model "
                          f"and the full one")
    return min(options, key=lambda o: o[:2])[2]


def _top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` highest scores, in their original order."""
    return torch.topk(scores, k).indices.sort().values


def _norm_slice(norm: nn.Module, idx: torch.Tensor) -> None:
    norm.weight = nn.Parameter(norm.weight.detach().index_select(0, idx.to(norm.weight.device)).clone())


@torch.no_grad()
def minitron_prune(model: nn.Module, scores: MinitronScores, q_per_group: int, hidden: int, ffn: int) -> None:
    """Keep, in every layer, the ``q_per_group`` most important query heads of each KV group and
    the ``ffn`` most important FFN units, and model-wide the ``hidden`` most important hidden
    channels (embedding, every RMSNorm, every projection's input or output, the head; a tied
    head stays tied); the config follows. Checks the widths before cutting anything."""
    lm, s = decoder(model), group_sizes(model)
    layers, hd, pg = lm.model.layers, s["head_dim"], s["per_group"]
    if not (1 <= q_per_group <= pg and 1 <= hidden <= s["hidden"] and 1 <= ffn <= s["ffn"]) or \
            len(scores.heads) != len(layers) or len(scores.ffn) != len(layers):
        raise ConfigError(f"keep 1-{pg} query heads per group, 1-{s['hidden']} hidden channels and "
                          f"1-{s['ffn']} FFN units, with scores for each of the {len(layers)} layers: got "
                          f"{q_per_group}, {hidden}, {ffn} and {len(scores.heads)} / {len(scores.ffn)} layers")
    keep_h = _top(scores.hidden, hidden)
    tied = lm.lm_head.weight is lm.model.embed_tokens.weight
    emb = lm.model.embed_tokens
    emb.weight = nn.Parameter(emb.weight.detach()[:, keep_h.to(emb.weight.device)].clone())
    emb.embedding_dim = hidden
    if tied:
        lm.lm_head = nn.Linear(hidden, emb.num_embeddings, bias=False, device=emb.weight.device,
                               dtype=emb.weight.dtype)
        lm.lm_head.weight = emb.weight
    else:
        lm.lm_head = slice_linear(lm.lm_head, keep_h, 1)
    _norm_slice(lm.model.norm, keep_h)
    for layer, head_scores, ffn_scores in zip(layers, scores.heads, scores.ffn):
        a, m = layer.self_attn, layer.mlp
        heads = torch.cat([g * pg + _top(head_scores[g * pg:(g + 1) * pg], q_per_group)
                           for g in range(s["kv_heads"])])
        q_idx = (heads[:, None] * hd + torch.arange(hd)).flatten()
        units = _top(ffn_scores, ffn)
        a.q_proj = slice_linear(slice_linear(a.q_proj, q_idx, 0), keep_h, 1)
        a.k_proj = slice_linear(a.k_proj, keep_h, 1)
        a.v_proj = slice_linear(a.v_proj, keep_h, 1)
        a.o_proj = slice_linear(slice_linear(a.o_proj, q_idx, 1), keep_h, 0)
        a.num_key_value_groups = q_per_group
        m.gate_proj = slice_linear(slice_linear(m.gate_proj, units, 0), keep_h, 1)
        m.up_proj = slice_linear(slice_linear(m.up_proj, units, 0), keep_h, 1)
        m.down_proj = slice_linear(slice_linear(m.down_proj, units, 1), keep_h, 0)
        _norm_slice(layer.input_layernorm, keep_h)
        _norm_slice(layer.post_attention_layernorm, keep_h)
    cfg = lm.config
    cfg.hidden_size, cfg.intermediate_size, cfg.head_dim = hidden, ffn, hd
    cfg.num_attention_heads = q_per_group * s["kv_heads"]


def kept_widths(model: nn.Module) -> dict[str, int]:
    """Query heads, KV heads, hidden size and FFN units of ``model``'s first layer (every layer
    alike after :func:`minitron_prune`)."""
    lm = decoder(model)
    a = lm.model.layers[0].self_attn
    return {"q_heads": a.q_proj.out_features // a.head_dim, "kv_heads": a.k_proj.out_features // a.head_dim,
            "hidden": lm.model.embed_tokens.embedding_dim, "ffn": lm.model.layers[0].mlp.up_proj.out_features}
