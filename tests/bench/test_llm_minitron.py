"""The Minitron-style arm of bench/llm_baselines.py (bench/llm_minitron.py, Table 5 analog).

On a tiny random GQA Llama: the widths land on the parameter target with a config that
transformers saves; the count is predicted exactly; the importance is ModelOpt's aggregation
(|a| averaged over the sequence, L2 over the batch) and ranks a deliberately silenced query head,
FFN unit and hidden channel last; the prune keeps the top query heads within each KV group, runs
under eager and SDPA attention, keeps a tied head tied, and at full widths changes nothing; the
table-5 script pairs it by seed with DMS and the strongest other arms.
"""

from __future__ import annotations

import doctest
import sys
from pathlib import Path

import pytest
import torch

import dmscale as dms

ROOT = Path(__file__).resolve().parents[2]
dms.ensure_torchvision()
transformers = pytest.importorskip("transformers")
from bench import llm_baselines  # noqa: E402
from bench.lib import llm_baselines_runs  # noqa: E402
from bench.lib import llm_baselines_lib as lib  # noqa: E402
from bench.lib import llm_minitron as mt  # noqa: E402

VOCAB, HIDDEN, FFN, HD = 40, 72, 64, 4


def _lm(attn: str = "sdpa", tied: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
                                   num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=3,
                                   head_dim=HD, max_position_embeddings=32, tie_word_embeddings=tied)
    cfg._attn_implementation = attn
    return transformers.LlamaForCausalLM(cfg).eval()


def _ids(batch: int = 3, t: int = 10, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, t), generator=torch.Generator().manual_seed(seed))


def test_doctests_pass() -> None:
    assert doctest.testmod(mt).failed == 0


@pytest.mark.parametrize("fraction", [0.8, 0.5])
def test_minitron_hits_the_target_and_saves(fraction: float) -> None:
    lm = _lm()
    target = int(fraction * lib.count_params(lm))
    w = mt.minitron_widths(lm, target)
    predicted = mt.minitron_count(lm, **w)
    mt.minitron_prune(lm, mt.activation_scores(lm, [_ids()]), **w)
    got = lib.count_params(lm)
    assert got == predicted
    assert abs(got - target) <= 3 * 3 * w["hidden"] / 2  # half an FFN unit in each of 3 layers
    assert w["hidden"] % (3 * w["q_per_group"]) == 0 and w["hidden"] < HIDDEN and w["ffn"] < FFN
    assert mt.kept_widths(lm) == {"q_heads": 3 * w["q_per_group"], "kv_heads": 3, "hidden": w["hidden"],
                                  "ffn": w["ffn"]}
    assert lm(_ids()).logits.shape == (3, 10, VOCAB)
    assert llm_baselines_runs._config_saves(lm) == "ok"
    assert lm.lm_head.weight is lm.model.embed_tokens.weight


def test_widths_cut_heads_only_when_hidden_and_ffn_are_cut_as_hard() -> None:
    lm = _lm()
    full = lib.count_params(lm)
    mild = mt.minitron_widths(lm, int(0.9 * full))
    deep = mt.minitron_widths(lm, int(0.45 * full))
    assert mild["q_per_group"] == 2  # hidden / FFN near 0.9: nearer all heads (1.0) than half (0.5)
    assert deep["q_per_group"] == 1
    assert abs(deep["hidden"] / HIDDEN - 0.5) < abs(deep["hidden"] / HIDDEN - 1.0)
    kept = mt.minitron_widths(lm, int(0.45 * full), keep_heads=True)
    assert kept["q_per_group"] == 2 and kept["hidden"] < deep["hidden"]
    assert abs(mt.minitron_count(lm, **kept) - int(0.45 * full)) <= 3 * 3 * kept["hidden"] / 2


def test_importance_is_sequence_mean_then_batch_l2() -> None:
    lm = _lm()
    ids = _ids()
    seen = []
    h = lm.model.layers[1].mlp.down_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach()))
    scores = mt.activation_scores(lm, [ids[:2], ids[2:]])  # two batches, summed
    h.remove()
    a = torch.cat(seen)  # (3, T, FFN)
    expected = a.abs().mean(dim=1).pow(2).sum(dim=0).sqrt()
    torch.testing.assert_close(scores.ffn[1], expected)
    assert not torch.allclose(scores.ffn[1], a.abs().mean(dim=0).pow(2).sum(dim=0).sqrt())  # not batch-mean


def test_importance_ranks_silenced_units_last() -> None:
    lm = _lm()
    with torch.no_grad():
        lm.model.layers[0].mlp.up_proj.weight[5] = 0  # FFN unit 5: act(gate) * 0
        lm.model.layers[2].self_attn.v_proj.weight[HD:2 * HD] = 0  # KV group 1: its query heads 2, 3 output 0
        for layer in lm.model.layers:  # hidden channel 7: zero in every norm the importance reads
            layer.input_layernorm.weight[7] = 0
            layer.post_attention_layernorm.weight[7] = 0
    s = mt.activation_scores(lm, [_ids()])
    assert s.ffn[0].argmin().item() == 5 and s.ffn[0][5] == 0 and (s.ffn[0] > 0).sum() == FFN - 1
    assert sorted(s.heads[2].argsort()[:2].tolist()) == [2, 3] and (s.heads[2][[0, 1, 4, 5]] > 0).all()
    assert s.hidden.argmin().item() == 7 and (s.hidden > 0).sum() == HIDDEN - 1
    mt.minitron_prune(lm, s, q_per_group=2, hidden=HIDDEN - 1, ffn=FFN - 1)
    assert lm.model.layers[0].mlp.up_proj.weight.abs().sum(1).min() > 0  # the dead unit went
    assert (lm.model.layers[0].input_layernorm.weight != 0).all()  # the dead channel went


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_prune_keeps_the_top_query_heads_of_each_group(attn: str) -> None:
    lm = _lm(attn)
    q0 = lm.model.layers[0].self_attn.q_proj.weight.detach().clone()
    s = mt.activation_scores(lm, [_ids()])
    s.heads = [torch.tensor([1.0, 2.0, 4.0, 3.0, 5.0, 6.0]) for _ in s.heads]  # keep heads 1, 2, 5
    mt.minitron_prune(lm, s, q_per_group=1, hidden=HIDDEN, ffn=FFN)
    a = lm.model.layers[0].self_attn
    keep = torch.cat([torch.arange(h * HD, (h + 1) * HD) for h in (1, 2, 5)])
    torch.testing.assert_close(a.q_proj.weight, q0[keep])
    assert a.num_key_value_groups == 1 and lm.config.num_attention_heads == 3
    assert lm(_ids()).logits.isfinite().all()


def test_full_widths_change_nothing() -> None:
    lm = _lm(tied=False)
    ids = _ids()
    before = lm(ids).logits
    mt.minitron_prune(lm, mt.activation_scores(lm, [ids]), q_per_group=2, hidden=HIDDEN, ffn=FFN)
    torch.testing.assert_close(lm(ids).logits, before)


def test_prune_refuses_widths_before_cutting() -> None:
    lm = _lm()
    s = mt.activation_scores(lm, [_ids()])
    with pytest.raises(ValueError, match="keep 1-2 query heads per group"):
        mt.minitron_prune(lm, s, q_per_group=3, hidden=12, ffn=8)
    assert lib.count_params(lm) == lib.count_params(_lm())
    with pytest.raises(ValueError, match="no uniform"):
        mt.minitron_widths(lm, 10)


def test_table5_pairs_minitron_with_dms_the_best_other_baseline_and_tp_hidden(tmp_path: Path) -> None:
    """The Minitron arm is a row of the table and a baseline; its own line pairs it by seed with
    DMS, the best of the other baselines and the Torch-Pruning arm of the same scope."""
    from bench import llm_table5
    from table5_fakes import record as rec, table5_markdown

    rows = [rec("dms", 0, 80.0), rec("dms", 1, 80.0), rec("minitron", 0, 88.0), rec("minitron", 1, 96.0),
            rec("tp_taylor", 0, 80.0), rec("tp_taylor", 1, 100.0), rec("tp_hidden", 0, 110.0),
            rec("tp_hidden", 1, 120.0), rec("shortgpt", 0, 95.0)]
    md = table5_markdown(tmp_path, rows)
    assert "| 80% | Minitron activation importance" in md and "**92.0** (s0 88.0, s1 96.0)" in md
    line = [x for x in md.splitlines() if x.startswith("- 80%, Minitron")]
    assert len(line) == 1
    assert "+15.0% against DMS (seeds 0, 1: +10.0%, +20.0%; 95 % CI" in line[0]
    assert "+3.0% against Torch-Pruning Taylor, uniform (FFN only) (seeds 0, 1: +10.0%, -4.0%" in line[0]
    assert "-20.0% against Torch-Pruning Taylor, uniform (hidden size + FFN" in line[0]
    gap = [x for x in md.splitlines() if x.startswith("- 80%: DMS vs the best baseline")]
    assert "(Torch-Pruning Taylor, uniform (FFN only))" in gap[0]  # by mean: 90.0 < 92.0
    assert "minitron" in llm_table5.BASELINES
