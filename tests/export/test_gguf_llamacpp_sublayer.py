"""A sublayer-depth GGUF export runs in llama.cpp itself (slow): the real SmolLM2-135M (all 30
layers) with importance from 8 batches of Shakespeare training windows, three layers without
attention and two without FFN (the least important branches by that importance; layer 0's
attention pinned with ``keep_depth``, as ``--export gguf`` does), then widths fitted to 0.85x
its parameters. Written per-layer (``deci``) as f32, ``llama-simple``'s greedy continuation
equals transformers' ``generate(do_sample=False)`` token for token and ``llama-perplexity`` is
within 1 % of transformers' over the same tokens; the f16 and q8_0 files are within 2 % of f32.

Binaries: ``bash scripts/build_llamacpp.sh`` (the tests skip without them).
"""

from __future__ import annotations

import copy

import pytest
import torch

import dmscale as dms
from dmscale.export.gguf import gguf_architecture, gguf_keep_depth, gguf_layer_sizes
from llamacpp import CTX, accumulate_importance, greedy_equal, load_smollm2, perplexities, train_windows

pytestmark = pytest.mark.slow

NO_ATTENTION, NO_FFN = 3, 2


def _least_important(searcher: dms.Searcher) -> list[int]:
    """The depth units to drop: the NO_ATTENTION least important attention branches, then the
    NO_FFN least important FFN branches of other layers."""
    (stage,) = searcher.space.depth
    importance = searcher.gates.depth[0].importance
    order = sorted(range(len(stage.blocks)), key=lambda i: float(importance[i]))
    attention = [i for i in order if stage.blocks[i].name.endswith("self_attn")][:NO_ATTENTION]
    taken = {stage.blocks[i].layer.name for i in attention}
    ffn = [i for i in order if stage.blocks[i].name.endswith("mlp") and stage.blocks[i].layer.name not in taken]
    return attention + ffn[:NO_FFN]


@pytest.fixture(scope="module")
def pruned():
    """``(export, tokenizer, source .gguf)``: the pruned SmolLM2 (see the module docs)."""
    base, tokenizer, source = load_smollm2()
    model = copy.deepcopy(base)
    batches = train_windows(tokenizer)
    searcher = dms.prepare(model, {"input_ids": batches[0][:1]}, dms.SearchConfig(
        "params", 0.85, depth_unit="sublayer", exclude=["model.embed_tokens"],
        keep_depth=gguf_keep_depth(model)))
    accumulate_importance(model, batches)
    drop = _least_important(searcher)
    (gate,) = searcher.gates.depth
    with torch.no_grad():  # exactly those units go, the others stay
        gate.importance.add_(1.0)
        gate.importance[drop] = torch.arange(len(drop), dtype=gate.importance.dtype) * 1e-3
        gate.set_count(gate.n_units - len(drop))
    searcher.freeze_depth()
    resources = searcher.meet_target()  # the widths fill the budget the dropped branches left
    small = searcher.export().eval()
    assert resources["hard"] <= resources["target"]
    assert resources["hard"] == dms.count(small, {"input_ids": batches[0][:1]})["params"]
    return small, tokenizer, source


def test_sublayer_smollm2_runs_in_llamacpp(pruned, tmp_path):
    small, tokenizer, source = pruned
    sizes = gguf_layer_sizes(small)[1]
    no_attention = [i for i, s in enumerate(sizes) if s[0] == 0]
    no_ffn = [i for i, s in enumerate(sizes) if s[2] == 0]
    assert len(no_attention) == NO_ATTENTION and 0 not in no_attention and len(no_ffn) == NO_FFN
    assert all(sizes[i][0] > 0 for i in no_ffn) and len(sizes) == 30
    assert gguf_architecture(small) == "deci"
    path = dms.save_gguf(small, tmp_path / "model.gguf", tokenizer=source, gguf_type="f32")
    text = greedy_equal(small, tokenizer, path)
    ppl_cpp, ppl_hf, tokens = perplexities(small, path, tmp_path)
    print(f"SmolLM2 sublayer (no attention {no_attention}, no FFN {no_ffn}): {text!r}; perplexity "
          f"llama.cpp {ppl_cpp:.4f}, transformers {ppl_hf:.4f} ({len(tokens)} tokens, ctx {CTX})")
    assert abs(ppl_cpp / ppl_hf - 1) < 0.01
    assert ppl_hf < 400  # a pruned model with some sense (the unpruned one: about 83)


def test_sublayer_smollm2_f16_and_q8_0(pruned, tmp_path):
    small, tokenizer, source = pruned
    f32 = perplexities(None, dms.save_gguf(small, tmp_path / "f32.gguf", tokenizer=source, gguf_type="f32"),
                       tmp_path)[0]
    for kind in ("f16", "q8_0"):
        ppl = perplexities(None, dms.save_gguf(small, tmp_path / f"{kind}.gguf", tokenizer=source,
                                               gguf_type=kind), tmp_path)[0]
        print(f"SmolLM2 sublayer {kind}: perplexity {ppl:.4f} (f32 {f32:.4f})")
        assert abs(ppl / f32 - 1) < 0.02, (kind, ppl, f32)
