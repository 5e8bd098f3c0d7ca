"""Issue 55, item 2: ``--task text --data alpaca.json``: instruction records rendered with the
Alpaca template or the tokenizer's chat template, the loss on the response tokens or on all,
a record without its fields refused with its index."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dmscale.cli import main
from dmscale.config.run_config import RunConfig
from dmscale.data.instructions import ALPACA_PROMPT, is_instruction_file, read_instructions, render
from dmscale.tasks.instruct import InstructionTask, encode_record
from dmscale.tasks.registry import build_task
from dmscale.tasks.text_windows import IGNORE
from tiny_hf import make_tiny_hf

RECORDS = [{"instruction": f"Say the number {i}.", "input": "" if i % 2 else f"the number {i}",
            "output": f"{i} is the number."} for i in range(40)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("instruct")
    model_dir, _ = make_tiny_hf(root, 20_000)
    data = root / "alpaca.json"
    data.write_text(json.dumps(RECORDS))
    return model_dir, data


def _tok(model_dir):
    from dmscale.tasks.hf_model import load_hf_tokenizer

    return load_hf_tokenizer(str(model_dir))


def test_the_alpaca_template_is_stanford_alpaca_s():
    prompt, response = render({"instruction": "Translate.", "input": "bonjour", "output": "hello"}, "alpaca")
    assert prompt == ("Below is an instruction that describes a task, paired with an input that provides "
                      "further context. Write a response that appropriately completes the request.\n\n"
                      "### Instruction:\nTranslate.\n\n### Input:\nbonjour\n\n### Response:\n")
    assert response == "hello" and prompt == ALPACA_PROMPT.format(instruction="Translate.", input="bonjour")


@pytest.mark.parametrize("loss_on", ["response", "all"])
def test_the_loss_covers_the_response_or_every_token(tiny, loss_on):
    model_dir, _ = tiny
    tok = _tok(model_dir)
    rec = RECORDS[1]
    ex = encode_record(rec, tok, "alpaca", loss_on, 10_000)
    prompt, response = render(rec, "alpaca")
    n_prompt = len(tok(prompt)["input_ids"])
    n_response = len(tok(response, add_special_tokens=False)["input_ids"]) + 1  # + EOS
    assert len(ex["ids"]) == n_prompt + n_response and ex["ids"][-1] == tok.eos_token_id
    scored = np.flatnonzero(ex["targets"] != IGNORE)
    if loss_on == "response":
        assert scored.tolist() == list(range(n_prompt - 1, n_prompt + n_response - 1))
        assert tok.decode(ex["targets"][scored][:-1].tolist()) == response
    else:
        assert len(scored) == len(ex["ids"]) - 1


def test_the_chat_template_frames_the_turns(tiny):
    model_dir, _ = tiny
    tok = _tok(model_dir)
    tok.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<s>assistant: {% endif %}")
    prompt, response = render(RECORDS[0], "chat", tok)
    assert prompt == "<s>user: Say the number 0.\n\nthe number 0\n<s>assistant: "
    assert response == "0 is the number.\n"
    tok.chat_template = None
    with pytest.raises(Exception, match="no chat template"):
        render(RECORDS[0], "chat", tok)


def test_a_record_without_its_fields_is_refused_with_its_index(tiny, tmp_path, capsys):
    model_dir, _ = tiny
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(RECORDS[:3] + [{"instruction": "no output here"}] + RECORDS[3:]))
    rc = main(["search", "--model", f"hf:{model_dir}", "--task", "text", "--data", str(bad),
               "--out", str(tmp_path / "run"), "--pipeline", "p-"])
    err = capsys.readouterr().err
    assert rc != 0 and "record 3 has no string output" in err, err
    assert not (tmp_path / "run").exists()


def test_instruction_files_are_told_from_documents(tiny, tmp_path):
    _, data = tiny
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"text": "a story"}) + "\n")
    lines = tmp_path / "alpaca.jsonl"
    lines.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    assert is_instruction_file(str(data)) and is_instruction_file(str(lines))
    assert not is_instruction_file(str(docs)) and read_instructions(lines) == read_instructions(data)


def test_a_search_finetunes_on_instructions(tiny, tmp_path, capsys):
    """The task's batches score only response tokens, the held-out records are the last 10 %,
    and a p search with the original as teacher runs end to end on them."""
    model_dir, data = tiny
    cfg = RunConfig(command="search", task="text", model=f"hf:{model_dir}", data=str(data), seq_len=256,
                    pipeline="p", prompt_format="alpaca")
    task = build_task(cfg)
    assert isinstance(task, InstructionTask) and len(task.test) == 4 and len(task.train) == 36
    x, y = task.train_batch(0, 3, 0)
    assert x.shape == y.shape and (y != IGNORE).sum() < y.numel()
    run = tmp_path / "run"
    rc = main(["search", "--model", f"hf:{model_dir}", "--task", "text", "--data", str(data), "--pipeline", "p",
               "--pretrain-epochs", "0", "--epochs", "0.2", "--retrain-epochs", "0.2", "--seq-len", "256",
               "--batch-size", "4", "--resource", "params", "--target", "0.8", "--teacher", "supernet",
               "--threads", "1", "--out", str(run), "--quiet"])
    assert rc == 0, capsys.readouterr().err
    summary = json.loads((run / "summary.json").read_text())
    assert summary["evals"]["final"]["examples"] == sum(t["scored"] for t in task.test)
    assert "alpaca prompts, loss on response tokens" in summary["task"]
