"""An ``hf:`` run writes ``RUN/hf`` at its end (issue 32): a Qwen2 search saves its per-layer
widths; a model that cannot be saved is refused before the first step with the fix named,
and under torchrun a save error on rank 0 is every rank's (one message, no rank left at a
barrier until gloo times out).
"""

from __future__ import annotations

import json
import os
import re
import sys
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dmscale as dms
from dmscale.cli import main
from spawn_ranks import spawn_ranks
from tiny_hf import tiny_tokenizer
from torchrun_util import leave_process_group, run_group

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["--task", "text", "--pipeline", "p", "--resource", "params", "--target", "0.7", "--seq-len", "16",
          "--batch-size", "4", "--epochs", "0.05", "--retrain-epochs", "0", "--test-limit", "200",
          "--optimizer", "adamw", "--structure-lr", "0.05", "--threads", "1", "--quiet"]


def _save(lm: nn.Module, tok, root: Path, name: str) -> Path:
    lm.save_pretrained(root / name)
    tok.save_pretrained(root / name)
    return root / name


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A tiny Qwen2 and a tiny GPT-2 with one byte-level tokenizer, and a text file."""
    dms.ensure_torchvision()
    import transformers

    from dmscale.data import shakespeare_text

    root = tmp_path_factory.mktemp("hf_families")
    text = shakespeare_text(max_chars=20_000)
    tok = tiny_tokenizer(text)
    (root / "plays.txt").write_text(text, encoding="utf-8")
    ids = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    qwen2 = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, **ids))
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2,
                                                                n_positions=64, **ids))
    return {"qwen2": _save(qwen2, tok, root, "qwen2"), "gpt2": _save(gpt2, tok, root, "gpt2"),
            "data": root / "plays.txt"}


@pytest.fixture(autouse=True)
def _token_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DMSCALE_CACHE", str(tmp_path / "token-cache"))


def test_qwen2_search_writes_per_layer_hf_dir(models, tmp_path, capsys):
    """The issue's run (in one process): a per-layer Qwen2 search ends with RUN/hf, which
    from_pretrained loads with trust_remote_code as the run's model."""
    from transformers import AutoModelForCausalLM

    from dmscale.run.pipeline import load_run_model

    run = tmp_path / "run"
    rc = main(["search", "--model", f"hf:{models['qwen2']}", "--data", str(models["data"]), *COMMON,
               "--out", str(run)])
    assert rc == 0, capsys.readouterr().err
    config = json.loads((run / "hf" / "config.json").read_text())
    assert config["model_type"] == "dmscale_qwen2" and (run / "hf" / "modeling_dmscale_qwen2.py").is_file()
    small, _ = load_run_model(run)
    assert config["layer_sizes"] == [[layer.self_attn.q_proj.out_features // 16, layer.self_attn.k_proj.out_features // 16,
                                      layer.mlp.gate_proj.out_features] for layer in small.lm.model.layers]
    lm = AutoModelForCausalLM.from_pretrained(run / "hf", trust_remote_code=True).eval()
    ids = torch.randint(0, config["vocab_size"], (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(lm(input_ids=ids).logits, small.eval()(ids), atol=1e-5, rtol=1e-5)


def test_a_model_that_cannot_be_saved_is_refused_before_the_first_step(models, tmp_path, capsys,
                                                                       monkeypatch):
    from dmscale.engine.loop import StepLoop

    def no_step(*args, **kwargs):
        raise AssertionError("a step ran before the refusal")

    monkeypatch.setattr(StepLoop, "run", no_step)
    run = tmp_path / "run"
    for extra in ([], ["--layer-uniform"]):
        rc = main(["search", "--model", f"hf:{models['gpt2']}", "--data", str(models["data"]), *COMMON,
                   *extra, "--out", str(run)])
        err = capsys.readouterr().err
        assert rc == 2, err
        assert err.count("error:") == 1 and "Traceback" not in err
        assert "'gpt2' model" in err and "llama, mistral, qwen2, qwen3, gemma3_text" in err
        assert "dmscale.save" in err and "hf/" in err
        assert not run.exists()  # refused before the first step: the new run leaves nothing


def _save_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """One rank of ``model_checks.save_hf`` whose write fails on rank 0 (the only rank that writes)."""
    import dmscale.run.model_checks as phases
    from dmscale.core.errors import VerificationError

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))

    def failing(*args, **kwargs):
        raise VerificationError("logits differ by 1")

    phases.save_hf_outputs = failing  # what save_hf calls on the writing rank
    from dmscale.engine.rundir import RunDir

    cfg = SimpleNamespace(model="hf:m", export=None, gguf_type="f16")
    host = SimpleNamespace(rd=RunDir(out_dir, writes=rank == 0), cfg=cfg, task=None, log=print)
    try:
        phases.save_hf(host, nn.Linear(1, 1) if rank == 0 else None)
        result = None
    except Exception as err:  # what each rank raises
        result = f"{type(err).__name__}: {err}"
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    leave_process_group()


def test_a_save_error_on_rank0_is_every_ranks_error(tmp_path):
    got = spawn_ranks(_save_worker, 2, tmp_path, deadline_s=120)
    assert got[0] == "VerificationError: logits differ by 1"
    assert got[1] == "DMScaleError: rank 0 of 2 failed: VerificationError: logits differ by 1"


@pytest.mark.slow
def test_torchrun_refusal_is_one_message(models, tmp_path):
    """``torchrun --nproc_per_node 2``: both ranks refuse (status 2; the launcher stops a rank
    still exiting when the other has), rank 0 says it once, no rank prints a traceback (the
    launcher's report of the failed ranks follows)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1",
               DMSCALE_CACHE=str(tmp_path / "cache"))
    proc = run_group([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                      "-m", "dmscale", "search", "--model", f"hf:{models['gpt2']}", "--data",
                      str(models["data"]), *COMMON, "--out", str(tmp_path / "run")],
                     cwd=ROOT, env=env, timeout=300)
    assert proc.returncode != 0
    assert proc.stderr.count("dmscale search: error:") == 1, proc.stderr[-3000:]
    assert "'gpt2' model" in proc.stderr
    ranks = proc.stderr.split("torch/distributed/elastic")[0]  # the launcher's report follows
    assert "Traceback" not in ranks and "barrier" not in proc.stderr.lower(), proc.stderr[-3000:]
    assert re.search(r"exitcode\s*:\s*2\b", proc.stderr), proc.stderr[-3000:]  # the refusal's status
    assert not (tmp_path / "run").exists()
