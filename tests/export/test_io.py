"""Saving a pruned model (safetensors + structure) and loading it onto the original architecture."""

from __future__ import annotations

import pytest
import torch

import dmscale as dms

dms.ensure_torchvision()
transformers = pytest.importorskip("transformers")


def _gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=3, n_head=4,
                                  bos_token_id=1, eos_token_id=2)
    return transformers.GPT2LMHeadModel(cfg).eval(), cfg


def test_save_load_round_trip_on_a_tied_gpt2(tmp_path):
    model, cfg = _gpt2()
    ids = torch.randint(3, 64, (1, 10), generator=torch.Generator().manual_seed(0))
    searcher = dms.prepare(model, {"input_ids": ids}, dms.SearchConfig(resource="params", target=0.6))
    with torch.no_grad():
        for t in list(searcher.gates.width) + list(searcher.gates.depth):
            t.a.fill_(0.5 * t.max_ratio)
    searcher.randomize_importance(0)  # untrained: random kept elements (tied weights shrink alike)
    small = searcher.export().eval()
    dms.save(small, searcher.structure(), tmp_path)
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "structure.json").is_file()
    again = dms.load(transformers.GPT2LMHeadModel(cfg).eval(), tmp_path)
    assert again.lm_head.weight is again.transformer.wte.weight  # still tied
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, small(ids).logits)
        g1 = again.generate(ids, max_new_tokens=5, do_sample=False)
        g2 = small.generate(ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(g1, g2)


def test_load_reports_a_missing_file(tmp_path):
    model, _ = _gpt2()
    with pytest.raises(FileNotFoundError, match="structure.json is missing"):
        dms.load(model, tmp_path)


def test_structure_for_another_architecture_is_refused_and_model_untouched():
    model, cfg = _gpt2()
    ids = torch.randint(3, 64, (1, 6))
    searcher = dms.prepare(model, {"input_ids": ids}, dms.SearchConfig(target=0.5, importance="index"))
    with torch.no_grad():
        for t in searcher.gates.width:
            t.a.fill_(0.5 * t.max_ratio)
    structure = searcher.structure()
    cfg2 = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=64, n_layer=3, n_head=4)
    other = transformers.GPT2LMHeadModel(cfg2)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(dms.StructureError, match="was made for shape"):
        dms.apply_structure(other, structure)
    after = other.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
