"""``dmscale inspect --memory`` of an ``hf:`` model builds it from its config on the meta
device (src/dmscale/run/inspect_memory.py, src/dmscale/tasks/hf_meta.py): the numbers of the
loaded model, without reading a weight."""

from __future__ import annotations

import json
import resource
import time

import pytest
import torch

from dmscale.cli import main
from dmscale.config.run_config import ConfigError, RunConfig
from dmscale.run.inspect_memory import inspect_memory
from tiny_hf import make_tiny_hf

# the Llama-2-7B shape of docs/distributed.md's worked example
LLAMA_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
            "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_hf(tmp_path_factory.mktemp("hf"), text_chars=20_000)


def _cfg(model: str, data: str | None = None, **kw) -> RunConfig:
    opts = {"task": "text", "model": model, "seq_len": 32, "batch_size": 8, "optimizer": "adamw",
            "precision": "bf16", "shard": "fsdp", "distill_hidden": 1.0, "pipeline": "p", **kw}
    return RunConfig(command="search", data=data, **opts)


def test_the_meta_estimate_is_the_loaded_models(tiny):
    model_dir, data = tiny
    cfg = _cfg(f"hf:{model_dir}", str(data))
    meta, loaded = inspect_memory(cfg, world_size=2), inspect_memory(cfg, world_size=2, load=True)
    same = {k: v for k, v in meta.as_dict().items() if k != "notes"}
    assert same == {k: v for k, v in loaded.as_dict().items() if k != "notes"}
    assert meta.gates > 0 and meta.teacher > 0  # prepared on meta: the gates counted exactly
    assert "without its weights" in meta.notes[0] and not any("weights (" in n for n in loaded.notes)
    (model_dir.parent / "only").mkdir()
    (model_dir.parent / "only" / "config.json").write_text((model_dir / "config.json").read_text())
    bare = inspect_memory(_cfg(f"hf:{model_dir.parent / 'only' / 'config.json'}"), world_size=2)
    assert bare.total == meta.total  # a bare config.json: no tokenizer, no weights, no data


def test_a_config_only_7b_llama_is_planned_in_seconds_without_memory(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_7B))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux: the peak so far
    start = time.perf_counter()
    args = ["inspect", "--task", "text", "--model", f"hf:{tmp_path}", "--memory", "--pipeline", "p", "--world-size", "8",
            "--shard", "fsdp", "--precision", "bf16", "--optimizer", "adamw", "--batch-size", "16",
            "--seq-len", "2048", "--out", str(tmp_path / "plan.json")]
    assert main(args) == 0
    seconds = time.perf_counter() - start
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss
    assert grew < 2 * 2**20, f"the peak RSS grew by {grew / 2**20:.1f} GiB (27 GB are the weights)"
    assert seconds < 60
    plan = json.loads((tmp_path / "plan.json").read_text())
    text = capsys.readouterr().out
    assert "6.74G parameters, 8 rank(s)" in text and "without its weights" in text
    gib = {k: plan[k] / 2**30 for k in ("weights", "optimizer_state", "teacher", "communication", "activations")}
    assert round(gib["weights"], 2) == 3.14 and round(gib["optimizer_state"], 2) == 6.28
    assert round(gib["teacher"], 2) == 1.57 and round(gib["communication"], 2) == 3.62
    assert 0 < plan["gates"] < 16 * 2**20  # a few MB: every searched element's importance
    assert plan["total"] < 0.9 * 80e9


def test_an_hf_model_needs_the_text_task_and_a_causal_lm(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_7B))
    with pytest.raises(ConfigError, match="goes with --task text"):
        inspect_memory(_cfg(f"hf:{tmp_path}", task="digits", distill_hidden=0.0))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "vit"}))
    with pytest.raises(ConfigError, match="not a causal LM"):
        inspect_memory(_cfg(f"hf:{tmp_path}"))
    assert torch.get_default_device().type == "cpu"  # the meta device does not leak
