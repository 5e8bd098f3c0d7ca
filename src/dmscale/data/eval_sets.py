"""Local copies of the standard LLM evaluation sets, read in their official formats.

lm-evaluation-harness reads its tasks' data from the Hugging Face hub. Offline, a user has
the official files instead (the copies the DMS paper, LLM-Pruner and Minitron report on);
this module says which file each task reads from a data directory (``--lm-eval-data DIR``),
converts its records to the fields the harness's task expects, and reads the text of a
perplexity set as the dataset's own loader splits it into rows.

==================  =============================  =========  ==================================
harness task        file in DIR (official format)  split      conversion
==================  =============================  =========  ==================================
``boolq``           ``boolq.dev.jsonl``            validation ``answer`` (bool) -> ``label`` (0/1)
``winogrande``      ``winogrande.dev.jsonl``       validation as it is (``sentence``, ``option1/2``,
                                                              ``answer`` "1"/"2")
``arc_easy``        ``arc-easy.test.jsonl``        test       ``question.stem`` -> ``question``,
                                                              ``question.choices`` -> ``choices``
                                                              {``text``, ``label``}
``arc_challenge``   ``arc-challenge.test.jsonl``   test       as ``arc_easy``
==================  =============================  =========  ==================================

Perplexity rows (:func:`text_rows`), as the Hugging Face loaders make them: a WikiText file
(``wiki.*.raw``) gives one row per line, the line with its newline, and ``""`` for a blank
line (the ``wikitext`` loader); any other file gives each line stripped of surrounding
whitespace (the ``ptb_text_only`` loader's ``sentence``). The protocols then join the rows
with ``"\\n\\n"``.

Example:
    >>> import json, pathlib, tempfile
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> rec = {"question": {"stem": "2+2?", "choices": [{"text": "4", "label": "A"}]}, "answerKey": "A"}
    >>> _ = (d / "arc-easy.test.jsonl").write_text(json.dumps(rec) + "\\n")
    >>> path = convert_task_data("arc_easy", d, d / "out")
    >>> json.loads(path.read_text())
    {'question': '2+2?', 'choices': {'text': ['4'], 'label': ['A']}, 'answerKey': 'A'}
    >>> missing_files(["arc_easy", "boolq"], d)
    {'boolq': 'no file .../boolq.dev.jsonl (the official validation split, see dmscale.data.eval_sets)'}
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from dmscale.core.errors import DataError

__all__ = ["EvalSet", "EVAL_SETS", "convert_task_data", "missing_files", "text_rows", "perplexity_name"]


def _boolq(rec: dict[str, Any]) -> dict[str, Any]:
    return {"question": rec["question"], "passage": rec["passage"], "label": int(bool(rec["answer"]))}


def _winogrande(rec: dict[str, Any]) -> dict[str, Any]:
    return {k: rec[k] for k in ("sentence", "option1", "option2", "answer")}


def _arc(rec: dict[str, Any]) -> dict[str, Any]:
    q = rec["question"]
    return {"question": q["stem"], "choices": {"text": [c["text"] for c in q["choices"]],
                                               "label": [c["label"] for c in q["choices"]]},
            "answerKey": rec["answerKey"]}


@dataclass(frozen=True)
class EvalSet:
    """One harness task's local data: the official file, the split the task evaluates, and
    the conversion of one record to the harness's fields."""

    file: str
    split: str
    convert: Callable[[dict[str, Any]], dict[str, Any]]


EVAL_SETS: dict[str, EvalSet] = {
    "boolq": EvalSet("boolq.dev.jsonl", "validation", _boolq),
    "winogrande": EvalSet("winogrande.dev.jsonl", "validation", _winogrande),
    "arc_easy": EvalSet("arc-easy.test.jsonl", "test", _arc),
    "arc_challenge": EvalSet("arc-challenge.test.jsonl", "test", _arc),
}


def missing_files(tasks: Iterable[str], data_dir: str | Path) -> dict[str, str]:
    """``{task: why}`` for each task that cannot read its data from ``data_dir``: the file
    looked for and not found, or a task without a known local format."""
    out = {}
    for task in tasks:
        spec = EVAL_SETS.get(task)
        if spec is None:
            out[task] = (f"no local format known for this task (local data: "
                         f"{', '.join(sorted(EVAL_SETS))})")
        elif not (Path(data_dir) / spec.file).is_file():
            out[task] = (f"no file {Path(data_dir) / spec.file} (the official {spec.split} split, "
                         f"see dmscale.data.eval_sets)")
    return out


def convert_task_data(task: str, data_dir: str | Path, out_dir: str | Path) -> Path:
    """Write ``task``'s records from ``data_dir`` (official format) to ``out_dir`` as JSON
    Lines in the harness's fields; returns the file written.

    Raises:
        DataError: a record that is not JSON or lacks a field, naming the file and line.
    """
    spec = EVAL_SETS[task]
    src = Path(data_dir) / spec.file
    out = Path(out_dir) / f"{task}.{spec.split}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    with open(src, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                lines.append(json.dumps(spec.convert(json.loads(line))))
            except (ValueError, KeyError, TypeError) as err:
                raise DataError(f"{src}, line {n}: not a {task} record in the official format "
                                 f"({type(err).__name__}: {err})") from None
    out.write_text("".join(x + "\n" for x in lines), encoding="utf-8")
    return out


def text_rows(path: str | Path) -> list[str]:
    """The rows of a perplexity text file as its dataset's loader makes them (module docs)."""
    p = Path(path)
    with open(p, encoding="utf-8", newline="") as fh:
        lines = fh.read().splitlines(keepends=True)
    if p.name.startswith("wiki") and p.suffix == ".raw":
        return [line if line.strip() else "" for line in lines]
    return [line.strip() for line in lines]


def perplexity_name(path: str | Path) -> str:
    """The metric name of a perplexity file: ``wikitext2``, ``ptb`` or the file's stem."""
    name = Path(path).name.lower()
    if name.startswith("wiki") and "103" not in name:
        return "wikitext2"
    if name.startswith("ptb"):
        return "ptb"
    return Path(path).stem
