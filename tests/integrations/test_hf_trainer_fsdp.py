"""DMSTrainer under sharding: accelerate's FSDP2 plugin on two gloo ranks (against one process on
the same global batch), and the refusals of DeepSpeed, FSDP1 and the unsupported FSDP settings."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

import dmscale as dms

dms.ensure_torchvision()
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from dmscale.core.errors import ConfigError  # noqa: E402
from dmscale.core.masks import GATES_NAME  # noqa: E402
from dmscale.integrations._sharding import deepspeed_error, keep_gates_replicated  # noqa: E402
from dmscale.integrations.hf_trainer import DMSTrainer  # noqa: E402

from test_hf_trainer import VOCAB, RandomTokens, _args, run_torchrun, tiny_llama  # noqa: E402


def _prepared():
    model = tiny_llama()
    example = {"input_ids": torch.randint(0, VOCAB, (1, 16))}
    return model, dms.prepare(model, example, dms.SearchConfig("params", 0.6, layer_uniform=True))


def _plugin(**kw) -> SimpleNamespace:
    return SimpleNamespace(**{"fsdp_version": 2, "cpu_ram_efficient_loading": False, "ignored_modules": None, **kw})


def test_fsdp2_plugin_keeps_the_gates_replicated():
    model, searcher = _prepared()
    plugin = _plugin()
    frame = keep_gates_replicated(plugin, model, searcher, torch.device("cpu"))
    assert plugin.ignored_modules == GATES_NAME  # accelerate fullmatches it against module names
    assert all(p.is_meta for p in frame.parameters()) and hasattr(frame, GATES_NAME)
    plugin = _plugin(ignored_modules="model.rotary_emb")  # the user's own ignored modules stay
    keep_gates_replicated(plugin, model, searcher, torch.device("cpu"))
    assert plugin.ignored_modules == f"(?:model.rotary_emb)|{GATES_NAME}"
    mine = model.model.embed_tokens
    plugin = _plugin(ignored_modules=[mine])
    keep_gates_replicated(plugin, model, searcher, torch.device("cpu"))
    assert plugin.ignored_modules == [mine, getattr(model, GATES_NAME)]


def test_unsupported_fsdp_settings_are_refused_with_the_fix():
    model, searcher = _prepared()
    cpu = torch.device("cpu")
    with pytest.raises(ConfigError, match=r"FSDP1 .*FlatParameter.*Expected FSDP2, got FSDP1.*\"version\": 2"):
        keep_gates_replicated(_plugin(fsdp_version=1), model, searcher, cpu)
    with pytest.raises(ConfigError, match=r"cpu_ram_efficient_loading.*meta device.*False"):
        keep_gates_replicated(_plugin(cpu_ram_efficient_loading=True), model, searcher, cpu)
    wrapper = torch.nn.Sequential(model)
    with pytest.raises(ConfigError, match=r"attached to a LlamaForCausalLM inside the trained Sequential"):
        keep_gates_replicated(_plugin(), wrapper, searcher, cpu)


def test_deepspeed_is_refused_saying_why_and_pointing_at_fsdp2(tmp_path):
    message = str(deepspeed_error("TrainingArguments(deepspeed=...)"))
    for part in ("engine.step()", "after the step", "ZeRO-3", "empty placeholder", GATES_NAME,
                 "Expected DDP or FSDP2, got DeepSpeed", 'fsdp_config={"version": 2}'):
        assert part in message, part

    class UnderDeepSpeed(DMSTrainer):  # DeepSpeed itself is not installed here: only its flag
        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            self.is_deepspeed_enabled = True

    model = tiny_llama()
    with pytest.raises(ConfigError, match=r"DeepSpeed \(TrainingArguments\(deepspeed=\.\.\.\)\) is not supported"):
        UnderDeepSpeed(model=model, args=_args(tmp_path), train_dataset=RandomTokens(),
                       search_config=dms.SearchConfig("params", 0.6),
                       example_inputs={"input_ids": torch.randint(0, VOCAB, (1, 16))})
    assert not hasattr(model, GATES_NAME)  # refused: the model as it came


@pytest.mark.filterwarnings("ignore:the structural parameters are stepped by SGD")
@pytest.mark.slow  # two processes importing transformers, one more run and a fresh process: ~40 s on 2 cores
def test_dms_trainer_under_accelerate_fsdp2_on_two_gloo_ranks(tmp_path):
    """TrainingArguments(fsdp=True, fsdp_config={"version": 2}) on 2 gloo ranks (FSDP switched on
    after the Accelerator is built: accelerate enables it on accelerators only), 2 micro-batches
    per step, SGD: the same structural parameters, importance and structure on both ranks, equal
    to one process on the same global batch; one export, by rank 0, which loads with
    ``from_pretrained`` in a process without dmscale and computes what one process's export does."""
    from safetensors.torch import load_file

    from hf_fresh import load_fresh
    from hf_fsdp_script import main

    rc, err = run_torchrun("hf_fsdp_script.py", str(tmp_path), "fsdp")
    assert rc == 0, err[-3000:]
    ranks = [json.loads((tmp_path / f"fsdp-rank{r}.json").read_text()) for r in (0, 1)]
    one = main(str(tmp_path), "one")
    assert [r["sharded"] for r in ranks] == [True, True] and not one["sharded"]
    for key in ("a", "importance", "structure", "losses"):
        assert ranks[0][key] == ranks[1][key], key
    assert ranks[0]["structure"] == one["structure"]
    for key, tol in (("a", 1e-7), ("importance", 1e-12), ("losses", 1e-5)):
        assert torch.allclose(torch.tensor(ranks[0][key]), torch.tensor(one[key]), rtol=1e-5, atol=tol), key
    assert [r["found"] for r in ranks] == [True, False]  # rank 0 exports, the other gets None
    sharded_found, one_found = tmp_path / "found-fsdp", tmp_path / "found-one"
    weights, reference = (load_file(str(d / "model.safetensors")) for d in (sharded_found, one_found))
    assert weights.keys() == reference.keys()
    for name, w in weights.items():
        assert w.shape == reference[name].shape and torch.allclose(w, reference[name], atol=1e-6), name
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    fresh = load_fresh([(str(sharded_found), False), (str(one_found), False)], ids, new_tokens=4)
    assert not fresh[0]["dmscale_loaded"] and fresh[0]["class"] == "LlamaForCausalLM"
    assert torch.allclose(fresh[0]["logits"], fresh[1]["logits"], atol=1e-5)
    assert torch.equal(fresh[0]["tokens"], fresh[1]["tokens"])


def test_fsdp_asked_for_on_the_cpu_warns_that_accelerate_runs_without_it(tmp_path):
    import os

    args = _args(tmp_path)  # one process refuses fsdp=True: the arguments torchrun's ranks would get
    args.fsdp_plugin_args = {"fsdp_version": 2}
    before = dict(os.environ)  # accelerate's plugin may set FSDP_* variables: put them back after
    try:
        with pytest.warns(UserWarning, match=r"accelerate did not enable it .*not on the CPU.*runs DDP"):
            trainer = DMSTrainer(model=tiny_llama(), args=args, train_dataset=RandomTokens(),
                                 search_config=dms.SearchConfig("params", 0.6),
                                 example_inputs={"input_ids": torch.randint(0, VOCAB, (1, 16))})
    finally:
        os.environ.clear()
        os.environ.update(before)
    assert not trainer.is_fsdp_enabled and trainer._shard_frame is None
