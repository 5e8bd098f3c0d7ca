"""Structured-pruning baselines for Llama-family causal LMs (the peers of DMS in Table 5).

All but one keep the hidden size and the embeddings (as the DMS run does with
``--exclude lm.model.embed_tokens``); each acts on a Hugging Face ``LlamaForCausalLM`` (or the
``CausalLM`` wrapper around one) in place:

* :func:`taylor_scores` -- LLM-Pruner's first-order Taylor importance, hand-written: per
  group, ``sum |w * dL/dw|`` over every weight of the group, the gradient accumulated over
  calibration batches of the language-model loss.
* :func:`magnitude_scores` -- the L2 norm of each group's weights (Torch-Pruning's
  ``GroupNormImportance(p=2)`` up to the reduction).
* :func:`tp_taylor_prune` -- the real Torch-Pruning package: its ``MetaPruner`` with
  ``GroupTaylorImportance``, FFN units only: its GQA head rule is not usable at a parameter
  target on transformers 5 (see the function and ``--probe-tp``).
* :func:`block_influence` -- ShortGPT: ``BI_l = 1 - mean_tokens cos(x_l, x_{l+1})`` of each
  decoder layer's input and output hidden states; :func:`remove_layers` drops layers.

Groups: a *KV group* of a GQA layer is one key/value head with the query heads that read
it (rows of q/k/v, columns of o); an *FFN unit* is one intermediate channel (rows of
gate/up, column of down). :func:`solve_uniform` picks the same number of KV groups and FFN
units for every layer so that the model's parameter count meets a target, with the kept
fraction of heads as close as it can be to the kept fraction of FFN units (Torch-Pruning's
LLM example prunes heads and channels with one ratio).

Example:
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> lm = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=24, intermediate_size=32,
    ...     num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, head_dim=4))
    >>> kv, ffn = solve_uniform(lm, int(0.7 * count_params(lm)))
    >>> prune_uniform(lm, magnitude_scores(lm), kv, ffn)
    >>> lm.model.layers[0].mlp.up_proj.out_features == ffn
    True
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

__all__ = ["decoder", "count_params", "group_sizes", "solve_uniform", "magnitude_scores",
           "taylor_scores", "accumulate_grads", "slice_linear", "prune_uniform", "prune_per_layer",
           "prune_structure", "block_influence",
           "remove_layers", "layers_for_target", "ffn_keep_for_target", "tp_taylor_prune",
           "hidden_ffn_count", "tp_hidden_ratio_for_target", "tp_hidden_prune"]

Scores = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (KV-group scores, FFN-unit scores)


def decoder(model: nn.Module) -> nn.Module:
    """The ``LlamaForCausalLM`` inside ``model`` (``model`` itself or a ``CausalLM`` wrapper)."""
    return model.lm if hasattr(model, "lm") and hasattr(model.lm, "model") else model


def count_params(model: nn.Module) -> int:
    """Distinct parameters (a tied embedding / head counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def group_sizes(model: nn.Module) -> dict[str, int]:
    """Shape facts of the first layer: heads, KV heads, head dim, FFN width, hidden size,
    and the parameters one KV group / one FFN unit holds in one layer."""
    lm = decoder(model)
    attn, mlp = lm.model.layers[0].self_attn, lm.model.layers[0].mlp
    hd = attn.head_dim
    kv = attn.k_proj.out_features // hd
    q = attn.q_proj.out_features // hd
    hidden = attn.q_proj.in_features
    per_group = q // kv
    # one KV group: per_group query heads (q rows, o columns) + one k and one v head (rows)
    kv_cost = (2 * per_group + 2) * hd * hidden
    kv_cost += hd * sum(n * int(m.bias is not None)
                        for n, m in ((per_group, attn.q_proj), (1, attn.k_proj), (1, attn.v_proj)))
    ffn_cost = 3 * hidden  # gate row, up row, down column (Llama MLPs have no bias by default)
    return {"heads": q, "kv_heads": kv, "head_dim": hd, "ffn": mlp.up_proj.out_features,
            "hidden": hidden, "kv_cost": kv_cost, "ffn_cost": ffn_cost, "per_group": per_group}


def solve_uniform(model: nn.Module, target: int) -> tuple[int, int]:
    """``(KV groups, FFN units)`` kept in every layer so the count is nearest ``target``.

    For each number of KV groups g the FFN width f is solved from the count (rounded to the
    nearest unit); of those, the (g, f) whose kept fractions g / G and f / F are closest wins.
    """
    lm, s = decoder(model), group_sizes(model)
    n_layers, full = len(lm.model.layers), count_params(model)
    best: tuple[float, int, int] | None = None
    for g in range(1, s["kv_heads"] + 1):
        cut_attn = n_layers * (s["kv_heads"] - g) * s["kv_cost"]
        f = round(s["ffn"] - (full - cut_attn - target) / (n_layers * s["ffn_cost"]))
        if not 1 <= f <= s["ffn"]:
            continue
        gap = abs(g / s["kv_heads"] - f / s["ffn"])
        if best is None or gap < best[0]:
            best = (gap, g, f)
    if best is None:
        raise ValueError(f"no uniform (KV groups, FFN units) reaches {target:,} parameters "
                         f"from {full:,} with {n_layers} layers kept")
    return best[1], best[2]


def _group_rows(s: dict[str, int], g: int) -> tuple[slice, slice]:
    """Rows of q_proj and of k/v_proj that KV group ``g`` owns."""
    hd, pg = s["head_dim"], s["per_group"]
    return slice(g * pg * hd, (g + 1) * pg * hd), slice(g * hd, (g + 1) * hd)


def _scores(model: nn.Module, value: Callable[[nn.Parameter], torch.Tensor]) -> Scores:
    """Per layer: a score per KV group and per FFN unit, the sum of ``value(w)`` (an
    elementwise tensor of w's shape) over the group's weights."""
    lm, s = decoder(model), group_sizes(model)
    out: Scores = []
    for layer in lm.model.layers:
        a, m = layer.self_attn, layer.mlp
        q, k, v, o = (value(x.weight) for x in (a.q_proj, a.k_proj, a.v_proj, a.o_proj))
        kv = torch.zeros(s["kv_heads"])
        for g in range(s["kv_heads"]):
            qr, kr = _group_rows(s, g)
            kv[g] = q[qr].sum() + k[kr].sum() + v[kr].sum() + o[:, qr].sum()
        ffn = value(m.gate_proj.weight).sum(1) + value(m.up_proj.weight).sum(1) + value(m.down_proj.weight).sum(0)
        out.append((kv, ffn.detach().float().cpu()))
    return out


@torch.no_grad()
def magnitude_scores(model: nn.Module) -> Scores:
    """L2 norm of each group's weights: sqrt(sum w^2) over the group."""
    sq = _scores(model, lambda w: w.detach() ** 2)
    return [(kv.sqrt(), ffn.sqrt()) for kv, ffn in sq]


def accumulate_grads(model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                     loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> int:
    """Sum the gradients of ``loss_fn(model(x), y)`` over ``batches`` into ``.grad`` (cleared
    first); returns the number of batches."""
    model.zero_grad(set_to_none=True)
    n = 0
    for x, y in batches:
        loss_fn(model(x), y).backward()
        n += 1
    return n


@torch.no_grad()
def taylor_scores(model: nn.Module) -> Scores:
    """LLM-Pruner's first-order Taylor importance: sum |w * grad| over the group's weights
    (``.grad`` from :func:`accumulate_grads`)."""
    for name, p in decoder(model).model.layers.named_parameters():
        if p.grad is None and p.dim() == 2:
            raise ValueError(f"layers.{name} has no gradient: call accumulate_grads first")
    return _scores(model, lambda w: (w.detach() * w.grad).abs())


def slice_linear(lin: nn.Linear, idx: torch.Tensor, dim: int) -> nn.Linear:
    """A new Linear with rows (dim 0, outputs) or columns (dim 1, inputs) ``idx`` of ``lin``."""
    w = lin.weight.detach().index_select(dim, idx.to(lin.weight.device)).clone()
    out_f, in_f = w.shape
    new = nn.Linear(in_f, out_f, bias=lin.bias is not None, device=w.device, dtype=w.dtype)
    new.weight.data.copy_(w)
    if lin.bias is not None:
        b = lin.bias.detach()
        new.bias.data.copy_(b.index_select(0, idx.to(b.device)) if dim == 0 else b)
    return new


@torch.no_grad()
def prune_uniform(model: nn.Module, scores: Scores, kv_keep: int, ffn_keep: int) -> None:
    """Keep the ``kv_keep`` highest-scoring KV groups and ``ffn_keep`` FFN units of every
    layer (kept in their original order); the config's head counts and FFN width follow."""
    lm, s = decoder(model), group_sizes(model)
    n = len(lm.model.layers)
    prune_per_layer(model, scores, [kv_keep] * n, [ffn_keep] * n)
    cfg = lm.config
    cfg.num_attention_heads = kv_keep * s["per_group"]
    cfg.num_key_value_heads = kv_keep
    cfg.intermediate_size = ffn_keep


def _check_widths(layers: Iterable[int], scores: Scores, kv_keep: list[int], ffn_keep: list[int]) -> None:
    """Raise unless each layer keeps between 1 and all of its KV groups and FFN units (``layers``
    name them in the message)."""
    for i, (kv, ffn), g_keep, f_keep in zip(layers, scores, kv_keep, ffn_keep):
        if not (1 <= g_keep <= len(kv) and 1 <= f_keep <= len(ffn)):
            raise ValueError(f"layer {i}: keep {g_keep} of {len(kv)} KV groups and {f_keep} of "
                             f"{len(ffn)} FFN units; each must be at least 1 and at most all")


@torch.no_grad()
def prune_per_layer(model: nn.Module, scores: Scores, kv_keep: list[int], ffn_keep: list[int]) -> None:
    """Keep, in layer ``i``, the ``kv_keep[i]`` highest-scoring KV groups and ``ffn_keep[i]``
    FFN units (kept in their original order): a given per-layer structure, the units chosen by
    ``scores``. The model runs (every attention module keeps its query heads per KV head); a
    config cannot describe unequal widths, so only ``head_dim`` is written to it."""
    lm, s = decoder(model), group_sizes(model)
    layers = lm.model.layers
    if not len(layers) == len(scores) == len(kv_keep) == len(ffn_keep):
        raise ValueError(f"one score pair and one width pair per layer: {len(layers)} layers, "
                         f"{len(scores)} scores, {len(kv_keep)} KV widths, {len(ffn_keep)} FFN widths")
    _check_widths(range(len(scores)), scores, kv_keep, ffn_keep)  # before any cut
    for layer, (kv, ffn), g_keep, f_keep in zip(layers, scores, kv_keep, ffn_keep):
        a, m = layer.self_attn, layer.mlp
        groups = torch.topk(kv, g_keep).indices.sort().values.tolist()
        q_idx = torch.cat([torch.arange(len(kv) * s["per_group"] * s["head_dim"])[_group_rows(s, g)[0]]
                           for g in groups])
        kv_idx = torch.cat([torch.arange(len(kv) * s["head_dim"])[_group_rows(s, g)[1]] for g in groups])
        a.q_proj = slice_linear(a.q_proj, q_idx, 0)
        a.k_proj = slice_linear(a.k_proj, kv_idx, 0)
        a.v_proj = slice_linear(a.v_proj, kv_idx, 0)
        a.o_proj = slice_linear(a.o_proj, q_idx, 1)
        units = torch.topk(ffn, f_keep).indices.sort().values
        m.gate_proj = slice_linear(m.gate_proj, units, 0)
        m.up_proj = slice_linear(m.up_proj, units, 0)
        m.down_proj = slice_linear(m.down_proj, units, 1)
        # num_key_value_groups (query heads per KV head) is unchanged: whole groups go
    lm.config.head_dim = s["head_dim"]  # no longer hidden / heads


@torch.no_grad()
def prune_structure(model: nn.Module, scores: Scores, kept_layers: list[int], kv_keep: list[int],
                    ffn_keep: list[int]) -> None:
    """Keep the decoder layers ``kept_layers`` and, in the ``i``-th of them, ``kv_keep[i]`` KV
    groups and ``ffn_keep[i]`` FFN units chosen by ``scores`` (one pair per layer of the full
    model, so the units are ranked in the original): a per-layer structure with depth. Checks
    everything before removing anything."""
    n = len(decoder(model).model.layers)
    kept = sorted(set(kept_layers))
    if not (set(kept) <= set(range(n)) and len(kept) == len(kept_layers) == len(kv_keep) == len(ffn_keep)
            and len(scores) == n):
        raise ValueError(f"kept layers {kept_layers} (distinct, of the model's {n}) need one KV width and "
                         f"one FFN width each, and the scores one pair per layer of the model: got "
                         f"{len(kv_keep)}, {len(ffn_keep)} widths and {len(scores)} score pairs")
    _check_widths(kept, [scores[i] for i in kept], kv_keep, ffn_keep)
    remove_layers(model, [i for i in range(n) if i not in set(kept)])
    prune_per_layer(model, [scores[i] for i in kept], kv_keep, ffn_keep)


@torch.no_grad()
def block_influence(model: nn.Module, batches: Iterable[torch.Tensor]) -> torch.Tensor:
    """ShortGPT's block influence of every decoder layer: 1 - cos(input, output) of its
    hidden states, averaged over every token of ``batches`` (token ids (B, T))."""
    lm = decoder(model)
    layers = lm.model.layers
    sums = torch.zeros(len(layers), dtype=torch.float64)
    count = 0
    seen: dict[int, torch.Tensor] = {}

    def hook(i: int) -> Callable[..., None]:
        def fn(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
            x = args[0] if args else kwargs["hidden_states"]
            y = out[0] if isinstance(out, tuple) else out
            cos = torch.nn.functional.cosine_similarity(x.float(), y.float(), dim=-1)  # (B, T)
            seen[i] = (1 - cos).double().sum()
        return fn

    handles = [layer.register_forward_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    was = model.training
    model.eval()
    try:
        for ids in batches:
            seen.clear()
            model(ids)
            sums += torch.stack([seen[i] for i in range(len(layers))])
            count += ids.numel()
    finally:
        for h in handles:
            h.remove()
        model.train(was)
    return (sums / max(1, count)).float()


def layers_for_target(model: nn.Module, bi: torch.Tensor, target: int) -> list[int]:
    """The lowest-BI layers to remove, fewest first, until the count is at most ``target``."""
    lm = decoder(model)
    per_layer = [count_params(layer) for layer in lm.model.layers]
    total, removed = count_params(model), []
    for i in torch.argsort(bi).tolist():
        if total <= target:
            break
        if len(removed) == len(per_layer) - 1:
            raise ValueError(f"{target:,} parameters needs removing every layer")
        removed.append(i)
        total -= per_layer[i]
    return sorted(removed)


def remove_layers(model: nn.Module, drop: list[int]) -> None:
    """Remove decoder layers ``drop`` in place (layer indices and the config follow)."""
    lm = decoder(model)
    kept = [layer for i, layer in enumerate(lm.model.layers) if i not in set(drop)]
    lm.model.layers = nn.ModuleList(kept)
    for i, layer in enumerate(kept):
        layer.self_attn.layer_idx = i
    cfg = lm.config
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = [t for i, t in enumerate(cfg.layer_types) if i not in set(drop)]
    cfg.num_hidden_layers = len(kept)


def ffn_keep_for_target(model: nn.Module, target: int) -> int:
    """FFN units kept in every layer so that the count is nearest ``target`` with every
    attention head kept (what Torch-Pruning can reach on a GQA Llama: FFN units only)."""
    lm, s = decoder(model), group_sizes(model)
    n_layers, full = len(lm.model.layers), count_params(model)
    per_unit = n_layers * s["ffn_cost"]
    keep = round((target - (full - s["ffn"] * per_unit)) / per_unit)
    if not 1 <= keep <= s["ffn"]:
        raise ValueError(f"{target:,} parameters is out of reach by FFN units alone: it needs {keep} "
                         f"of {s['ffn']} units per layer (the attention alone is "
                         f"{full - s['ffn'] * per_unit:,})")
    return keep


def _tp_prune(model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
              loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], **pruner: Any) -> None:
    """Run Torch-Pruning's ``MetaPruner(**pruner)`` with ``GroupTaylorImportance`` (gradients of
    ``loss_fn`` summed over ``batches``), local (uniform per layer), on ``model``'s decoder in place.

    The traced forward runs with eager attention and ``use_cache=False``, the only settings under
    which its LLM example builds at all here: with the cache, transformers 5 concatenates the
    keys onto an empty tensor and the dependency graph loops forever on that one-input concat;
    with SDPA its head grouping fails with a shape error. Both are restored after, and the
    gradients cleared.
    """
    import torch_pruning as tp

    lm, batches = decoder(model), list(batches)
    cfg = lm.config
    attn, cache = cfg._attn_implementation, cfg.use_cache
    cfg._attn_implementation, cfg.use_cache = "eager", False
    try:
        accumulate_grads(model, batches, loss_fn)
        meta = tp.pruner.MetaPruner(
            lm, example_inputs={"input_ids": batches[0][0][:1], "use_cache": False},
            importance=tp.importance.GroupTaylorImportance(), global_pruning=False,
            output_transform=lambda out: out.logits, **pruner)
        for group in meta.step(interactive=True):
            group.prune()
    finally:
        cfg._attn_implementation, cfg.use_cache = attn, cache
        model.zero_grad(set_to_none=True)


def _uniform_widths(lm: nn.Module, head_dim: int) -> dict[str, int]:
    """Query heads, KV heads and FFN units of every layer; raises if they differ across layers."""
    q = [layer.self_attn.q_proj.out_features // head_dim for layer in lm.model.layers]
    kv = [layer.self_attn.k_proj.out_features // head_dim for layer in lm.model.layers]
    ffn = [layer.mlp.up_proj.out_features for layer in lm.model.layers]
    if len(set(q)) > 1 or len(set(kv)) > 1 or len(set(ffn)) > 1 or q[0] % kv[0]:
        raise RuntimeError(f"Torch-Pruning left an irregular structure: query heads {q}, KV heads {kv}, "
                           f"FFN units {ffn}")
    return {"q_heads": q[0], "kv_heads": kv[0], "ffn": ffn[0]}


def tp_taylor_prune(model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                    ffn_keep: int) -> dict[str, Any]:
    """Prune ``model`` in place with Torch-Pruning (:func:`_tp_prune`), FFN units only
    (attention projections, embedding and head ignored: hidden size and heads kept), the ratio
    set so that ``ffn_keep`` units stay per layer. Returns what it kept.

    Heads are left alone because Torch-Pruning 1.6.1's GQA rule is not usable for an
    equal-parameter comparison: it never removes KV heads, and the query heads it removes per
    KV group are not monotonic in the ratio (on SmolLM2's 9 / 3 heads: one of three at ratio
    0.22, none at 0.34 or 0.54), and it leaves ``num_key_value_groups`` stale (the forward
    then fails).
    """
    lm, s = decoder(model), group_sizes(model)
    ratio = 1.0 - (ffn_keep + 0.5) / s["ffn"]  # TP keeps int(F * (1 - ratio)) = ffn_keep
    attention = [p for layer in lm.model.layers for p in (
        layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj)]
    _tp_prune(model, batches, loss_fn, pruning_ratio=ratio,
              ignored_layers=[lm.lm_head, lm.model.embed_tokens, *attention])
    kept = _uniform_widths(lm, s["head_dim"])
    cfg = lm.config
    cfg.num_attention_heads, cfg.num_key_value_heads = kept["q_heads"], kept["kv_heads"]
    cfg.head_dim, cfg.intermediate_size = s["head_dim"], kept["ffn"]
    return {**kept, "tp_ratio": round(ratio, 6)}


def _tp_kept(channels: int, ratio: float, round_to: int) -> int:
    """What Torch-Pruning's ``MetaPruner`` keeps of ``channels`` at ``ratio``: ``int(C * (1 - r))``
    rounded down to a multiple of ``round_to``."""
    kept = int(channels * (1 - ratio))
    return kept - kept % round_to


def hidden_ffn_count(model: nn.Module, hidden: int, ffn: int) -> int:
    """The parameter count of ``model`` with a hidden size of ``hidden`` and ``ffn`` FFN units in
    every layer, every head kept (a bias-free Llama: SmolLM2's layout; raises otherwise)."""
    lm, s = decoder(model), group_sizes(model)
    for name, mod in lm.model.layers.named_modules():
        if isinstance(mod, nn.Linear) and mod.bias is not None:
            raise ValueError(f"layers.{name} has a bias: hidden_ffn_count covers bias-free Llamas only")
    a = lm.model.layers[0].self_attn
    attn_w = a.q_proj.out_features + a.k_proj.out_features + a.v_proj.out_features + a.o_proj.in_features
    tied = lm.lm_head.weight is lm.model.embed_tokens.weight
    vocab, n_layers = lm.model.embed_tokens.num_embeddings, len(lm.model.layers)

    def dense(h: int, f: int) -> int:  # every tensor whose shape has h in it: embeddings, layers, norms
        return vocab * h * (1 if tied else 2) + n_layers * (h * attn_w + 3 * h * f + 2 * h) + h

    return count_params(model) - dense(s["hidden"], s["ffn"]) + dense(hidden, ffn)


def tp_hidden_ratio_for_target(model: nn.Module, target: int, round_to: int = 4) -> float:
    """The one ratio, for the hidden size and the FFN units alike (Torch-Pruning's LLM example
    prunes both with ``pruning_ratio``), whose kept widths give the count nearest ``target``:
    the middle of the run of ratios (steps of 1e-4) that keep those widths."""
    s = group_sizes(model)
    runs: dict[tuple[int, int], list[float]] = {}
    for i in range(9500):
        r = i / 10_000
        runs.setdefault((_tp_kept(s["hidden"], r, round_to), _tp_kept(s["ffn"], r, round_to)), []).append(r)
    (h, f), rs = min(runs.items(), key=lambda kv: abs(hidden_ffn_count(model, *kv[0]) - target))
    return rs[len(rs) // 2]


def tp_hidden_prune(model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                    ratio: float, round_to: int = 4) -> dict[str, Any]:
    """Prune ``model`` in place with Torch-Pruning (:func:`_tp_prune`) as its LLM example does,
    minus the heads: the hidden size (embedding, every projection's input or output, the RMSNorm
    weights) and the FFN units, one ``ratio`` for both, ``round_to`` channels, ``lm_head``
    ignored; head counts and head dims kept (its GQA head rule, see :func:`tp_taylor_prune`).
    A tied embedding stays tied. Returns what it kept.

    Example (a tiny random Llama; Torch-Pruning installed):
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> lm = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=48, intermediate_size=64,
        ...     num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, head_dim=8,
        ...     tie_word_embeddings=True))
        >>> ids = torch.randint(0, 32, (2, 9))
        >>> ce = lambda out, y: nn.functional.cross_entropy(out.logits.flatten(0, 1), y.flatten())
        >>> tp_hidden_prune(lm, [(ids[:, :-1], ids[:, 1:])], ce, 0.25)["hidden"]
        36

    Torch-Pruning 1.6.1's dependency graph loops forever on the hidden-size group of a GQA
    Llama with 2 query heads per KV head (SmolLM2 has 3; 1 and 3 build): bound the call with a
    timeout on a new model.
    """
    lm, s = decoder(model), group_sizes(model)
    tied = lm.lm_head.weight is lm.model.embed_tokens.weight
    heads = {}
    for layer in lm.model.layers:
        a = layer.self_attn
        heads.update({a.q_proj: s["heads"], a.k_proj: s["kv_heads"], a.v_proj: s["kv_heads"]})
    norms = [m for m in lm.modules() if type(m).__name__.endswith("RMSNorm")]
    _tp_prune(model, batches, loss_fn, pruning_ratio=ratio, ignored_layers=[lm.lm_head],
              num_heads=heads, prune_num_heads=False, prune_head_dims=False, round_to=round_to,
              unwrapped_parameters=[(m.weight, 0) for m in norms])
    hidden = lm.model.embed_tokens.embedding_dim
    if tied:  # both copies were cut with the hidden group's indices: tie them again
        if not torch.equal(lm.lm_head.weight, lm.model.embed_tokens.weight):
            raise RuntimeError("Torch-Pruning cut the tied embedding and lm_head differently")
        lm.lm_head.weight = lm.model.embed_tokens.weight
    kept = _uniform_widths(lm, s["head_dim"])
    want = (_tp_kept(s["hidden"], ratio, round_to), _tp_kept(s["ffn"], ratio, round_to))
    if (hidden, kept["ffn"]) != want or kept["q_heads"] != s["heads"] or any(
            m.weight.numel() != hidden for m in norms):
        raise RuntimeError(f"Torch-Pruning kept hidden {hidden}, FFN {kept['ffn']}, query heads "
                           f"{kept['q_heads']}, norms {[m.weight.numel() for m in norms][:3]}...; "
                           f"expected hidden, FFN {want} and {s['heads']} query heads")
    cfg = lm.config
    cfg.hidden_size, cfg.intermediate_size, cfg.head_dim = hidden, kept["ffn"], s["head_dim"]
    return {**kept, "hidden": hidden, "tp_ratio": round(ratio, 6)}
