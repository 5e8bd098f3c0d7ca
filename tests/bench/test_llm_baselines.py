"""The LLM pruning baselines of bench/llm_baselines.py (Table 5 analog, issues 9 and 10).

On a tiny random GQA Llama: the uniform pruners (Taylor, magnitude) land within one FFN unit
per layer of the target parameter count, keep the hidden size, and the pruned model runs with
the right shapes and equals a hand-sliced reference; Taylor ranks by |w * grad|; ShortGPT
removes the layers of lowest block influence and the count ends at or under the target;
the Torch-Pruning arm (the real package) prunes a transformers-5 GQA Llama (SDPA, cache on:
both restored after its eager, cache-less trace), lands on the target and keeps exactly the
FFN units of the hand-written Taylor.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import dmscale as dms

ROOT = Path(__file__).resolve().parents[2]
dms.ensure_torchvision()
transformers = pytest.importorskip("transformers")
from bench.lib import llm_baselines_lib as lib  # noqa: E402
from bench.lib import llm_baselines_runs  # noqa: E402

VOCAB, HIDDEN, FFN = 40, 24, 32


def _lm(layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
                                   num_hidden_layers=layers, num_attention_heads=6,
                                   num_key_value_heads=3, head_dim=4, max_position_embeddings=32,
                                   tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(cfg).eval()


def _ids(batch: int = 2, t: int = 12) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, t), generator=torch.Generator().manual_seed(1))


def test_group_sizes_match_the_count() -> None:
    lm = _lm()
    s = lib.group_sizes(lm)
    assert (s["heads"], s["kv_heads"], s["per_group"], s["head_dim"], s["ffn"]) == (6, 3, 2, 4, FFN)
    layer = lm.model.layers[0]
    norms = sum(p.numel() for p in layer.input_layernorm.parameters()) * 2
    assert lib.count_params(layer) == 3 * s["kv_cost"] + FFN * s["ffn_cost"] + norms


@pytest.mark.parametrize("method", ["magnitude", "taylor"])
@pytest.mark.parametrize("fraction", [0.8, 0.5])
def test_uniform_pruners_hit_the_target(method: str, fraction: float) -> None:
    lm = _lm()
    full = lib.count_params(lm)
    target = int(fraction * full)
    kv, ffn = lib.solve_uniform(lm, target)
    if method == "taylor":
        ids = _ids()
        n = lib.accumulate_grads(lm, [(ids[:, :-1], ids[:, 1:])],
                                 lambda out, y: torch.nn.functional.cross_entropy(
                                     out.logits.flatten(0, 1), y.flatten()))
        assert n == 1
        scores = lib.taylor_scores(lm)
    else:
        scores = lib.magnitude_scores(lm)
    lib.prune_uniform(lm, scores, kv, ffn)
    got = lib.count_params(lm)
    per_unit = 2 * lib.group_sizes(lm)["ffn_cost"]  # rounding: half an FFN unit in each layer
    assert abs(got - target) <= per_unit, (got, target)
    assert got < full
    for layer in lm.model.layers:
        assert layer.self_attn.k_proj.out_features == kv * 4
        assert layer.self_attn.q_proj.out_features == kv * 2 * 4
        assert layer.mlp.down_proj.in_features == ffn
        assert layer.self_attn.o_proj.out_features == HIDDEN  # hidden size kept
    logits = lm(_ids()).logits
    assert logits.shape == (2, 12, VOCAB) and torch.isfinite(logits).all()


def test_uniform_prune_equals_hand_slicing() -> None:
    """Keeping KV group 2 and FFN units {0, 5} by hand gives the same logits."""
    lm, ref = _lm(1), _lm(1)
    kv = torch.tensor([0.0, 0.1, 5.0])
    ffn = torch.zeros(FFN)
    ffn[[0, 5]] = 1.0
    lib.prune_uniform(lm, [(kv, ffn)], 1, 2)
    a, m = ref.model.layers[0].self_attn, ref.model.layers[0].mlp
    q_rows, kv_rows, units = torch.arange(16, 24), torch.arange(8, 12), torch.tensor([0, 5])
    with torch.no_grad():
        for lin, rows in ((a.q_proj, q_rows), (a.k_proj, kv_rows), (a.v_proj, kv_rows)):
            lin.weight.data = lin.weight.data[rows]
        a.o_proj.weight.data = a.o_proj.weight.data[:, q_rows]
        m.gate_proj.weight.data = m.gate_proj.weight.data[units]
        m.up_proj.weight.data = m.up_proj.weight.data[units]
        m.down_proj.weight.data = m.down_proj.weight.data[:, units]
        torch.testing.assert_close(lm(_ids()).logits, ref(_ids()).logits)


def test_per_layer_prune_keeps_each_layers_widths_and_top_units() -> None:
    """Unequal widths per layer: each layer keeps its own count of the highest-scoring KV
    groups and FFN units, the count drops by exactly what went, and the model still runs."""
    lm = _lm(2)
    full, s = lib.count_params(lm), lib.group_sizes(lm)
    scores = lib.magnitude_scores(lm)
    lib.prune_per_layer(lm, scores, [3, 1], [FFN, 5])
    a0, a1 = lm.model.layers[0].self_attn, lm.model.layers[1].self_attn
    assert (a0.k_proj.out_features, a1.k_proj.out_features) == (12, 4)
    assert (a0.q_proj.out_features, a1.q_proj.out_features, a1.o_proj.in_features) == (24, 8, 8)
    assert [layer.mlp.up_proj.out_features for layer in lm.model.layers] == [FFN, 5]
    assert lib.count_params(lm) == full - 2 * s["kv_cost"] - (FFN - 5) * s["ffn_cost"]
    kv1, ffn1 = scores[1]
    ref = _lm(2).model.layers[1]
    g = int(kv1.argmax())
    torch.testing.assert_close(a1.k_proj.weight, ref.self_attn.k_proj.weight[4 * g:4 * g + 4])
    units = ffn1.topk(5).indices.sort().values
    torch.testing.assert_close(lm.model.layers[1].mlp.down_proj.weight, ref.mlp.down_proj.weight[:, units])
    logits = lm(_ids()).logits
    assert logits.shape == (2, 12, VOCAB) and torch.isfinite(logits).all()


def test_per_layer_prune_with_equal_widths_is_the_uniform_prune() -> None:
    lm, ref = _lm(2), _lm(2)
    lib.prune_per_layer(lm, lib.magnitude_scores(lm), [2, 2], [7, 7])
    lib.prune_uniform(ref, lib.magnitude_scores(ref), 2, 7)
    with torch.no_grad():
        torch.testing.assert_close(lm(_ids()).logits, ref(_ids()).logits)


@pytest.mark.parametrize("kv, ffn, match", [([2, 0], [7, 5], "layer 1: keep 0 of 3 KV groups"),
                                            ([3, 3], [FFN + 1, 5], "layer 0: .* 33 of 32 FFN units"),
                                            ([3], [FFN], "2 layers, 2 scores, 1 KV widths")])
def test_per_layer_prune_refuses_widths_it_cannot_keep(kv: list[int], ffn: list[int], match: str) -> None:
    lm = _lm(2)
    before = [p.shape for p in lm.parameters()]
    with pytest.raises(ValueError, match=match):
        lib.prune_per_layer(lm, lib.magnitude_scores(lm), kv, ffn)
    assert [p.shape for p in lm.parameters()] == before  # checked before any layer is cut


def test_prune_structure_keeps_the_given_layers_and_their_widths() -> None:
    lm, ref = _lm(4), _lm(4)
    scores = lib.magnitude_scores(lm)
    lib.prune_structure(lm, scores, [0, 2, 3], [3, 1, 2], [FFN, 5, 10])
    assert lm.config.num_hidden_layers == 3 and [layer.self_attn.layer_idx for layer in lm.model.layers] == [0, 1, 2]
    assert [layer.mlp.up_proj.out_features for layer in lm.model.layers] == [FFN, 5, 10]
    assert [layer.self_attn.k_proj.out_features // 4 for layer in lm.model.layers] == [3, 1, 2]
    for new, i, k in zip(lm.model.layers, [0, 2, 3], [FFN, 5, 10]):  # units ranked in the original layer i
        units = torch.topk(scores[i][1], k).indices.sort().values
        torch.testing.assert_close(new.mlp.up_proj.weight, ref.model.layers[i].mlp.up_proj.weight[units])
    assert lm(_ids()).logits.shape == (2, 12, VOCAB)


@pytest.mark.parametrize("kept, kv, ffn, match", [
    ([0, 5], [1, 1], [4, 4], "distinct, of the model's 4"), ([0, 0], [1, 1], [4, 4], "distinct"),
    ([0, 1], [1], [4, 4], "one KV width"), ([0, 1], [1, 4], [4, 4], "layer 1: keep 4 of 3 KV groups")])
def test_prune_structure_refuses_before_removing_anything(kept: list[int], kv: list[int], ffn: list[int],
                                                          match: str) -> None:
    lm = _lm(4)
    before = [p.shape for p in lm.parameters()]
    with pytest.raises(ValueError, match=match):
        lib.prune_structure(lm, lib.magnitude_scores(lm), kept, kv, ffn)
    assert [p.shape for p in lm.parameters()] == before and len(lm.model.layers) == 4


def test_taylor_scores_are_abs_weight_times_grad() -> None:
    lm = _lm(1)
    ids = _ids()
    lib.accumulate_grads(lm, [(ids[:, :-1], ids[:, 1:])],
                         lambda out, y: out.logits.pow(2).mean())
    (kv, ffn), = lib.taylor_scores(lm)
    m = lm.model.layers[0].mlp
    want = sum((lin.weight * lin.weight.grad).abs().sum(1) for lin in (m.gate_proj, m.up_proj)) \
        + (m.down_proj.weight * m.down_proj.weight.grad).abs().sum(0)
    torch.testing.assert_close(ffn, want.detach())
    k = lm.model.layers[0].self_attn.k_proj
    assert kv[1] >= (k.weight * k.weight.grad).abs()[4:8].sum() - 1e-6


def _alarm(seconds: int) -> None:
    def fail(*_: Any) -> None:
        raise TimeoutError(f"no result within {seconds} s")
    signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)


@pytest.mark.parametrize("fraction", [0.9, 0.8])
def test_torch_pruning_taylor_keeps_the_hand_taylor_ffn_units(fraction: float) -> None:
    pytest.importorskip("torch_pruning")
    lm, ref = _lm(2), _lm(2)
    assert lm.config.use_cache and lm.config._attn_implementation == "sdpa"
    ids = _ids()
    batches = [(ids[:, :-1], ids[:, 1:]), (ids.flip(0)[:, :-1], ids.flip(0)[:, 1:])]
    loss = lambda out, y: torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), y.flatten())  # noqa: E731
    full = lib.count_params(lm)
    keep = lib.ffn_keep_for_target(lm, int(fraction * full))
    _alarm(120)  # Torch-Pruning's graph can loop forever on transformers 5 (--probe-tp): fail instead
    try:
        chosen = lib.tp_taylor_prune(lm, batches, loss, keep)
    finally:
        signal.alarm(0)
    assert chosen["ffn"] == keep and (chosen["q_heads"], chosen["kv_heads"]) == (6, 3)
    # nearest whole unit in each of the 2 layers: within 2 x half a unit of the target
    assert abs(lib.count_params(lm) - int(fraction * full)) <= lib.group_sizes(ref)["ffn_cost"]
    assert lm.config.use_cache and lm.config._attn_implementation == "sdpa"  # restored
    assert lm.config.intermediate_size == keep and all(p.grad is None for p in lm.parameters())
    lib.accumulate_grads(ref, batches, loss)
    for layer, old, (_, ffn) in zip(lm.model.layers, ref.model.layers, lib.taylor_scores(ref)):
        want = torch.topk(ffn, keep).indices.sort().values
        torch.testing.assert_close(layer.mlp.up_proj.weight, old.mlp.up_proj.weight[want])
        torch.testing.assert_close(layer.mlp.down_proj.weight, old.mlp.down_proj.weight[:, want])
        torch.testing.assert_close(layer.self_attn.q_proj.weight, old.self_attn.q_proj.weight)
    assert lm(ids).logits.shape == (2, 12, VOCAB)


def _lm3(tied: bool = True) -> torch.nn.Module:
    """A tiny GQA Llama with 3 query heads per KV head (SmolLM2's ratio): Torch-Pruning 1.6.1's
    graph loops forever on the hidden-size group of a 2-per-KV-head model (``_lm``)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                                   head_dim=8, max_position_embeddings=32, tie_word_embeddings=tied)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("tied", [True, False])
def test_hidden_ffn_count_is_the_count_of_the_cut_model(tied: bool) -> None:
    lm = _lm3(tied)
    assert lib.hidden_ffn_count(lm, 48, 64) == lib.count_params(lm)
    ref = _lm3(tied)
    scores = [(torch.ones(2), torch.arange(64.0)) for _ in range(2)]
    lib.prune_uniform(ref, scores, 2, 40)  # FFN only: the formula's f term
    assert lib.hidden_ffn_count(lm, 48, 40) == lib.count_params(ref)
    emb = 2 if not tied else 1  # every hidden channel: VOCAB (x2 untied) + per layer q,k,v,o,3 FFN, 2 norms, final norm
    assert lib.hidden_ffn_count(lm, 47, 64) == lib.count_params(lm) - (
        emb * VOCAB + 2 * (48 + 16 + 16 + 48 + 3 * 64 + 2) + 1)


@pytest.mark.parametrize("fraction", [0.8, 0.6])
def test_torch_pruning_hidden_cuts_every_hidden_channel_alike_and_lands_nearest(fraction: float) -> None:
    """The tp_hidden arm: one ratio for the hidden size and the FFN units, the kept widths the
    TP-reachable pair nearest the target, the count exactly as predicted, and every tensor that
    carries the hidden size cut at the same channels (the pruned model is the original restricted
    to them): embedding columns, norms, q/k/v inputs, o and down outputs; the tie kept."""
    pytest.importorskip("torch_pruning")
    lm, ref = _lm3(), _lm3()
    assert lm.config.use_cache and lm.config._attn_implementation == "sdpa"
    ids = _ids()
    batches = [(ids[:, :-1], ids[:, 1:])]
    loss = lambda out, y: torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), y.flatten())  # noqa: E731
    full = lib.count_params(lm)
    target = int(fraction * full)
    ratio = lib.tp_hidden_ratio_for_target(lm, target)
    _alarm(120)
    try:
        chosen = lib.tp_hidden_prune(lm, batches, loss, ratio)
    finally:
        signal.alarm(0)
    h, f = chosen["hidden"], chosen["ffn"]
    assert h < 48 and f < 64 and h % 4 == 0 and f % 4 == 0 and (chosen["q_heads"], chosen["kv_heads"]) == (6, 2)
    assert lib.count_params(lm) == lib.hidden_ffn_count(ref, h, f)
    reachable = {(lib._tp_kept(48, r / 1000, 4), lib._tp_kept(64, r / 1000, 4)) for r in range(950)}
    best = min(abs(lib.hidden_ffn_count(ref, *hf) - target) for hf in reachable)
    assert abs(lib.count_params(lm) - target) == best
    assert lm.lm_head.weight is lm.model.embed_tokens.weight
    assert lm.config.use_cache and lm.config._attn_implementation == "sdpa"  # restored
    assert (lm.config.hidden_size, lm.config.intermediate_size) == (h, f)
    assert all(p.grad is None for p in lm.parameters())
    # which hidden channels survived: the embedding's columns, found in the original's
    old_emb, new_emb = ref.model.embed_tokens.weight, lm.model.embed_tokens.weight
    idx = torch.tensor([int((old_emb - new_emb[:, [j]]).abs().sum(0).argmin()) for j in range(h)])
    assert idx.unique().numel() == h
    torch.testing.assert_close(new_emb, old_emb[:, idx])
    torch.testing.assert_close(lm.model.norm.weight, ref.model.norm.weight[idx])
    for new, old in zip(lm.model.layers, ref.model.layers):
        torch.testing.assert_close(new.input_layernorm.weight, old.input_layernorm.weight[idx])
        torch.testing.assert_close(new.post_attention_layernorm.weight, old.post_attention_layernorm.weight[idx])
        for name in ("q_proj", "k_proj", "v_proj"):
            torch.testing.assert_close(getattr(new.self_attn, name).weight, getattr(old.self_attn, name).weight[:, idx])
        torch.testing.assert_close(new.self_attn.o_proj.weight, old.self_attn.o_proj.weight[idx])
        torch.testing.assert_close(new.mlp.down_proj.weight.shape, torch.Size([h, f]))
    assert lm(ids).logits.shape == (2, 12, VOCAB)


def test_a_hidden_size_off_the_head_count_cannot_be_saved() -> None:
    """What the tp_hidden rows record: transformers refuses to save a config whose hidden size is
    no multiple of the query heads (SmolLM2 cut to hidden 500 with 9 heads)."""
    from bench import llm_baselines

    lm = _lm3()
    assert llm_baselines_runs._config_saves(lm) == "ok"
    lm.config.hidden_size = 44
    assert "not a multiple of the number of attention heads" in llm_baselines_runs._config_saves(lm)


def test_ffn_keep_for_target_refuses_what_ffn_units_cannot_reach() -> None:
    lm = _lm()
    full, s = lib.count_params(lm), lib.group_sizes(lm)
    assert lib.ffn_keep_for_target(lm, full) == FFN
    assert lib.ffn_keep_for_target(lm, full - 2 * 5 * s["ffn_cost"]) == FFN - 5  # 2 layers
    with pytest.raises(ValueError, match="out of reach by FFN units alone"):
        lib.ffn_keep_for_target(lm, int(0.2 * full))


def test_shortgpt_removes_the_lowest_influence_layers() -> None:
    lm = _lm(4)
    # layer 2 copies its input (output projections zeroed): block influence exactly 0
    with torch.no_grad():
        lm.model.layers[2].self_attn.o_proj.weight.zero_()
        lm.model.layers[2].mlp.down_proj.weight.zero_()
    ids = _ids()
    bi = lib.block_influence(lm, [ids])
    assert bi.shape == (4,) and bi[2].abs() < 1e-6 and (bi[[0, 1, 3]] > 1e-3).all()
    full, per_layer = lib.count_params(lm), lib.count_params(lm.model.layers[0])
    target = full - per_layer - 1  # one layer is not enough: two go
    drop = lib.layers_for_target(lm, bi, target)
    order = torch.argsort(bi).tolist()
    assert drop == sorted(order[:2]) and 2 in drop
    lib.remove_layers(lm, drop)
    assert lib.count_params(lm) == full - 2 * per_layer <= target
    assert lm.config.num_hidden_layers == 2
    assert [layer.self_attn.layer_idx for layer in lm.model.layers] == [0, 1]
    assert lm(ids).logits.shape == (2, 12, VOCAB)
    assert lm.generate(ids[:1, :4], max_new_tokens=3, do_sample=False).shape == (1, 7)


def test_table5_epochs_give_the_exact_step_counts() -> None:
    """bench/llm_table5.py turns step counts into the pipeline's epoch fractions: the pipeline's
    ``ceil(epochs * steps_per_epoch)`` must give the steps back (an off-by-one would give the
    baselines one weight step more or less than the DMS run)."""
    import argparse
    import math

    from bench import llm_table5

    args = argparse.Namespace(batch_size=4, seq_len=128)
    spe = 1_407_001 // (4 * 128)
    assert [math.ceil(llm_table5._epochs(s, args) * spe) for s in range(1, 301)] == list(range(1, 301))


def test_table5_table_pairs_dms_with_the_best_baseline_by_seed(tmp_path: Path) -> None:
    import json

    from table5_fakes import record as rec, table5_markdown

    rows = [rec("dms", 0, 80.0), rec("dms", 1, 90.0), rec("shortgpt", 0, 100.0), rec("shortgpt", 1, 100.0),
            rec("taylor", 0, 120.0), rec("taylor", 1, 60.0)]  # taylor: mean 90 < shortgpt's 100
    md = table5_markdown(tmp_path, rows)
    assert "| 80% | DMS_p + distillation" in md and "**85.0** (s0 80.0, s1 90.0)" in md
    gap = [line for line in md.splitlines() if line.startswith("- 80%")]
    assert len(gap) == 1 and "LLM-Pruner Taylor" in gap[0]
    assert "+33.3%, -50.0%" in gap[0]  # 1 - 80/120, 1 - 90/60, paired by seed
    assert (tmp_path / "t5.png").is_file() and len(json.loads((tmp_path / "t5.json").read_text())) == 6


def test_table5_pairs_each_dms_search_space_with_the_best_baseline(tmp_path: Path) -> None:
    """The FFN-only DMS rows (attention excluded) get their own comparison line and their own
    structure line (no KV groups to report), beside the default DMS rows."""
    from table5_fakes import record, table5_markdown

    def rec(method: str, seed: int, ppl: float, kv: list[int]) -> dict:
        if not method.startswith("dms"):
            return record(method, seed, ppl)
        return record(method, seed, ppl, structure={"layers": [30], "kv_groups": kv, "ffn": [1536, 900, 800]},
                      search_end=0.99, cost={"hard": 99.0, "target": 100.0})

    rows = [rec("dms", 0, 80.0, [3, 2, 2]), rec("dms_ffn", 0, 70.0, []), rec("tp_taylor", 0, 100.0, [])]
    md = table5_markdown(tmp_path, rows)
    gap = [line for line in md.splitlines() if line.startswith("- 80%")]
    assert len(gap) == 2 and gap[0].startswith("- 80%: DMS vs") and "+20.0%" in gap[0]
    assert "FFN units and depth only" in gap[1] and "+30.0%" in gap[1] and "Torch-Pruning" in gap[1]
    kept = [line for line in md.splitlines() if line.startswith("- DMS")]
    assert "KV groups 7/90" in kept[0] and "FFN only" in kept[1] and "attention kept" in kept[1]


def test_table5_reports_dms_widths_alone_against_dms_and_the_best_baseline(tmp_path: Path) -> None:
    """The ``dms_widths`` ablation (DMS's per-layer widths, finetuned from the original) is a row
    of its own and is compared, paired by seed, with DMS and with the best baseline, never
    counted as a baseline."""
    from table5_fakes import record, table5_markdown

    def rec(method: str, seed: int, ppl: float) -> dict:
        if method != "dms":
            return record(method, seed, ppl)
        return record(method, seed, ppl, structure={"layers": [30], "kv_groups": [3, 2], "ffn": [1536, 900]},
                      search_end=0.99, cost={"hard": 99.0, "target": 100.0})

    rows = [rec("dms", 0, 80.0), rec("dms", 1, 80.0), rec("dms_widths", 0, 88.0), rec("dms_widths", 1, 84.0),
            rec("tp_taylor", 0, 100.0), rec("tp_taylor", 1, 90.0)]
    md = table5_markdown(tmp_path, rows)
    assert "| 80% | DMS_p's per-layer widths" in md and "**86.0** (s0 88.0, s1 84.0)" in md
    gap = [line for line in md.splitlines() if line.startswith("- 80%")]
    assert len(gap) == 2 and "Torch-Pruning" in gap[0]  # the best baseline is still Torch-Pruning
    assert "+7.5% against DMS (seeds 0, 1: +10.0%, +5.0%; 95 % CI [-24.3%, +39.3%])" in gap[1]
    assert "-9.3% against Torch-Pruning" in gap[1] and "(seeds 0, 1: -12.0%, -6.7%; 95 % CI" in gap[1]


def test_table5_dms_widths_needs_the_kept_layers_of_a_shallower_structure(tmp_path: Path) -> None:
    import argparse
    import json

    from bench import llm_table5

    (tmp_path / "dms_t0.8_s0.json").write_text(json.dumps(
        {"structure": {"layers": [29], "kv_groups": [3] * 29, "ffn": [900] * 29}}))  # an older record
    args = argparse.Namespace(target=0.8, seed=0, cache=tmp_path)
    with pytest.raises(SystemExit, match="kept 29 of 30 layers and its record does not say which"):
        llm_table5._dms_widths(args)
    kept = [i for i in range(30) if i != 7]
    (tmp_path / "dms_t0.8_s0.json").write_text(json.dumps(
        {"structure": {"layers": [29], "kept_layers": kept, "kv_groups": [3] * 29, "ffn": [900] * 29}}))
    assert llm_table5._dms_widths(args) == {"kv_groups": [3] * 29, "ffn": [900] * 29, "kept_layers": kept}
    (tmp_path / "dms_t0.5_s0.json").write_text(json.dumps(
        {"structure": {"layers": [30], "kv_groups": [2] * 30, "ffn": [500] * 30}}))  # full depth, older
    assert llm_table5._dms_widths(argparse.Namespace(target=0.5, seed=0, cache=tmp_path))["kept_layers"] == list(range(30))
    with pytest.raises(SystemExit, match="run the DMS arm first"):
        llm_table5._dms_widths(argparse.Namespace(target=0.5, seed=1, cache=tmp_path))


def test_table5_structure_summary_names_the_kept_layers(tmp_path: Path) -> None:
    import json

    from bench import llm_table5

    layers = [f"lm.model.layers.{i}" for i in range(30)]
    width = [{"name": f"{n}.self_attn.heads", "kept": 2} for n in layers] + [
        {"name": f"{n}.mlp.up_proj", "kept": 100 + i} for i, n in enumerate(layers)]
    kept = [n for i, n in enumerate(layers) if i not in (3, 17)]
    (tmp_path / "structure.json").write_text(json.dumps({"width": width, "depth": [{"kept": kept}]}))
    s = llm_table5.structure_summary(tmp_path / "structure.json")
    assert s["layers"] == [28] and s["kept_layers"] == [i for i in range(30) if i not in (3, 17)]
    assert s["ffn"] == [100 + i for i in s["kept_layers"]] and s["kv_groups"] == [2] * 28


def test_table5_checks_equal_weight_steps_seed_by_seed(tmp_path: Path) -> None:
    """A seed whose DMS search took a finish step (71 weight steps) is paired with baselines that
    finetuned 71 too: no flag. The flag is raised only where a seed's two arms differ (it was
    raised for any mix of step counts across seeds)."""
    from table5_fakes import record as rec, table5_markdown

    rows = [rec("dms", 0, 80.0, 70), rec("dms", 1, 80.0, 71), rec("tp_taylor", 0, 90.0, 70),
            rec("tp_taylor", 1, 90.0, 71)]
    gap = lambda rows: [x for x in table5_markdown(tmp_path, rows).splitlines() if x.startswith("- 80%")]  # noqa: E731
    assert len(gap(rows)) == 1 and "NOT at equal" not in gap(rows)[0]
    assert "NOT at equal weight steps (seed 1: 71 vs 70)" in gap([rec("tp_taylor", 1, 90.0, 70)])[0]


def test_results_record_the_workdir_relative_to_the_checkout():
    """The json of a run names ``--workdir`` relative to the checkout (no machine's paths in
    bench/results), a path outside it as given."""
    from bench import llm_baselines

    assert llm_baselines._shown(llm_baselines.ROOT / "bench" / "runs" / "x") == "bench/runs/x"
    assert llm_baselines._shown(Path("/elsewhere/runs")) == "/elsewhere/runs"
