"""Issue 55, item 1: ``dmscale eval RUN --lm-eval TASKS --lm-eval-data DIR`` gives exactly the
accuracies lm-evaluation-harness's own ``simple_evaluate`` gives on the run's exported ``hf/``
directory, with the harness's own task definitions read from the official files; a changed
label changes them (the check can fail); the original is evaluated once and shown beside."""

from __future__ import annotations

import json
import shutil

import pytest

from dmscale.cli import main
from llm_data import llm_data
from tiny_hf import TEXT_CHARS, make_tiny_hf

pytest.importorskip("lm_eval")

TASKS = ("boolq", "arc_easy", "winogrande")
LIMIT = 12


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    """A finished p- search of a tiny Llama (per-layer widths) on text."""
    root = tmp_path_factory.mktemp("lm_eval_run")
    model_dir, data = make_tiny_hf(root, TEXT_CHARS)
    run = root / "run"
    mp = pytest.MonkeyPatch()
    mp.setenv("DMSCALE_CACHE", str(root / "token-cache"))
    try:
        rc = main(["search", "--model", f"hf:{model_dir}", "--task", "text", "--data", str(data),
                   "--pipeline", "p-", "--epochs", "0.02", "--resource", "params", "--target", "0.8",
                   "--seq-len", "32", "--batch-size", "4", "--structure-lr", "0.05", "--threads", "1",
                   "--test-limit", "200", "--distill-weight", "0", "--out", str(run), "--quiet"])
    finally:
        mp.undo()
    assert rc == 0
    return run, model_dir


def _harness_reference(hf_dir, data_dir, tmp):
    """lm-evaluation-harness alone: the exported directory loaded by its ``hf`` model, each
    task's own YAML with the data read from a JSON Lines file in the task's fields, converted
    here from the official files independently of dmscale."""
    import lm_eval.tasks
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    root = __import__("pathlib").Path(lm_eval.tasks.__file__).parent
    sources = {"boolq": ("boolq.dev.jsonl", "validation", root / "super_glue/boolq/default.yaml"),
               "arc_easy": ("arc-easy.test.jsonl", "test", root / "arc/arc_easy.yaml"),
               "winogrande": ("winogrande.dev.jsonl", "validation", root / "winogrande/default.yaml")}
    for task, (name, split, yaml) in sources.items():
        rows = [json.loads(line) for line in (data_dir / name).read_text().splitlines()[:LIMIT]]
        if task == "boolq":
            rows = [{"passage": r["passage"], "question": r["question"], "label": 1 if r["answer"] else 0}
                    for r in rows]
        elif task == "arc_easy":
            rows = [{"question": r["question"]["stem"], "answerKey": r["answerKey"],
                     "choices": {"text": [c["text"] for c in r["question"]["choices"]],
                                 "label": [c["label"] for c in r["question"]["choices"]]}} for r in rows]
        path = tmp / f"{task}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        other = [s for s in ("training", "validation", "test") if s != split]
        (tmp / f"{task}.yaml").write_text(
            f"include: {yaml}\ntask: {task}\ndataset_path: json\ndataset_name: null\n"
            f"dataset_kwargs:\n  data_files:\n    {split}: {path}\n{split}_split: {split}\n"
            + "".join(f"{s}_split: null\n" for s in other))
    out = simple_evaluate(model="hf", model_args={"pretrained": str(hf_dir), "trust_remote_code": True,
                                                  "dtype": "float32"},
                          tasks=list(TASKS), task_manager=TaskManager(include_path=str(tmp), include_defaults=False),
                          limit=LIMIT, num_fewshot=0, device="cpu", batch_size=8)
    return {t: {k.split(",")[0]: v for k, v in r.items() if k.split(",")[0] in ("acc", "acc_norm")}
            for t, r in out["results"].items()}


def _eval(run, data_dir, capsys):
    rc = main(["eval", str(run), "--lm-eval", ",".join(TASKS), "--lm-eval-data", str(data_dir),
               "--lm-eval-limit", str(LIMIT), "--threads", "1"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads((run / "summary.json").read_text())["lm_eval"], out


def test_eval_gives_the_harness_s_own_accuracies(hf_run, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    run, _ = hf_run
    data = llm_data()
    record, out = _eval(run, data, capsys)
    reference = _harness_reference(run / "hf", data, tmp_path)
    for task in TASKS:
        found = record["found"][task]
        assert found["examples"] == LIMIT
        for metric, value in reference[task].items():
            assert found[metric] == value, (task, metric)  # exactly: the same requests, the same scores
    # the original is evaluated the same way and shown beside the found model
    assert set(record["original"]) == set(TASKS)
    line = (f"boolq acc ({LIMIT} examples): {100 * record['original']['boolq']['acc']:.2f} +- "
            f"{100 * record['original']['boolq']['acc_stderr']:.2f} -> {100 * record['found']['boolq']['acc']:.2f}")
    assert line in out and line in (run / "report.md").read_text()


def test_a_changed_label_changes_the_accuracy(hf_run, tmp_path, capsys):
    """The check of the check: a copy of the data with one BoolQ answer flipped gives an accuracy
    that differs from the harness's on the true labels by exactly one example."""
    run, _ = hf_run
    data = llm_data()
    broken = tmp_path / "data"
    shutil.copytree(data, broken)
    (broken / "boolq.dev.jsonl").chmod(0o644)
    rows = (broken / "boolq.dev.jsonl").read_text().splitlines()
    first = json.loads(rows[0])
    first["answer"] = not first["answer"]
    rows[0] = json.dumps(first)
    (broken / "boolq.dev.jsonl").write_text("\n".join(rows) + "\n")
    reference = _harness_reference(run / "hf", data, tmp_path)
    record, _ = _eval(run, broken, capsys)
    assert abs(record["found"]["boolq"]["acc"] - reference["boolq"]["acc"]) == pytest.approx(1 / LIMIT)
    assert record["found"]["arc_easy"]["acc"] == reference["arc_easy"]["acc"]


def test_a_missing_task_file_is_refused_before_any_model_loads(hf_run, tmp_path, capsys, monkeypatch):
    run, _ = hf_run
    import dmscale.run.pipeline as pipeline
    import dmscale.run.saved_runs as saved

    for module in (pipeline, saved):
        monkeypatch.setattr(module, "load_run_model", lambda *a, **k: pytest.fail("a model was loaded"))
    (tmp_path / "empty").mkdir()
    rc = main(["eval", str(run), "--lm-eval", "arc_easy", "--lm-eval-data", str(tmp_path / "empty")])
    err = capsys.readouterr().err
    assert rc == 2 and f"no file {tmp_path / 'empty' / 'arc-easy.test.jsonl'}" in err


def test_a_search_ends_with_the_llm_evaluation(hf_run, tmp_path, capsys, monkeypatch):
    """``--lm-eval`` / ``--ppl`` on the search itself: summary.json holds original -> found,
    the found model's perplexity is the library's on the run's model, and the original's is
    the model as loaded."""
    import dmscale as dms
    from dmscale.run.saved_runs import load_run_model
    from dmscale.tasks.hf_model import load_hf_model, load_hf_tokenizer

    monkeypatch.setenv("DMSCALE_CACHE", str(tmp_path / "token-cache"))
    _, model_dir = hf_run
    data = llm_data()
    run = tmp_path / "run"
    text = tmp_path / "plays.txt"
    text.write_text((model_dir.parent / "plays.txt").read_text())
    wiki = data / "wiki.test.raw"
    rc = main(["search", "--model", f"hf:{model_dir}", "--task", "text", "--data", str(text),
               "--pipeline", "p-", "--epochs", "0.02", "--resource", "params", "--target", "0.8",
               "--seq-len", "32", "--batch-size", "4", "--structure-lr", "0.05", "--threads", "1",
               "--test-limit", "200", "--distill-weight", "0", "--out", str(run), "--quiet",
               "--lm-eval", "arc_easy", "--lm-eval-data", str(data), "--lm-eval-limit", "4",
               "--ppl", str(wiki), "--ppl-limit", "1024"])
    assert rc == 0, capsys.readouterr().err
    record = json.loads((run / "summary.json").read_text())["lm_eval"]
    assert record["found"]["arc_easy"]["examples"] == 4
    tok = load_hf_tokenizer(str(model_dir))
    found = dms.evaluate_lm(load_run_model(run)[0], tok, ppl=[wiki], ppl_limit=1024)["wikitext2"]
    original = dms.evaluate_lm(load_hf_model(str(model_dir)), tok, ppl=[wiki], ppl_limit=1024)["wikitext2"]
    assert record["found"]["wikitext2"]["ppl"] == pytest.approx(found["ppl"], rel=1e-6)
    assert record["original"]["wikitext2"]["ppl"] == pytest.approx(original["ppl"], rel=1e-6)
    assert found["windows"] == 1024 // 128 and found["ppl"] != pytest.approx(original["ppl"], rel=1e-4)


def test_lm_eval_on_a_model_without_a_tokenizer_is_refused_before_the_run(tmp_path, capsys):
    rc = main(["search", "--task", "digits", "--lm-eval", "arc_easy", "--out", str(tmp_path / "r")])
    assert rc == 2 and "give --model hf:PATH" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
