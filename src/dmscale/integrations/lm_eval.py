"""Evaluate a causal LM in memory as users evaluate LLMs: zero-shot accuracy through
lm-evaluation-harness and WikiText-2 / PTB perplexity (:mod:`dmscale.engine.perplexity`).

:func:`evaluate_lm` wraps the model and its tokenizer in the harness's own ``HFLM`` and runs
``lm_eval.simple_evaluate`` with the harness's task definitions, prompts and metrics (``acc``,
``acc_norm`` and their standard errors), zero-shot. With ``data_dir`` (``--lm-eval-data``)
each task reads its split from a local file in the dataset's official format
(:mod:`dmscale.data.eval_sets`) instead of the hub: the records are converted to the fields
the harness's task expects, and a task YAML that ``include``\\ s the harness's own one and
changes only where the data comes from is written to a temporary directory. Nothing is
downloaded then (``HF_DATASETS_OFFLINE=1`` while it runs). Without ``data_dir`` the harness
loads its datasets itself (hub access needed).

Needs the ``eval`` extra (``pip install 'dmscale[eval]'``: ``lm_eval``).

Example (not run: it evaluates a model):
    >>> import dmscale as dms                                        # doctest: +SKIP
    >>> dms.evaluate_lm(model, tok, tasks=["arc_easy"], data_dir="data/llm", limit=100,
    ...                 ppl=["data/llm/wiki.test.raw"])              # doctest: +SKIP
    {'arc_easy': {'acc': 0.43, 'acc_stderr': 0.05, 'acc_norm': 0.41, ...}, 'wikitext2': {'ppl': ...}}
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from dmscale.core.errors import ConfigError
from dmscale.data.eval_sets import EVAL_SETS, convert_task_data, missing_files, perplexity_name, text_rows
from dmscale.engine.perplexity import PROTOCOLS, window_perplexity

__all__ = ["evaluate_lm", "check_lm_eval", "harness_model", "task_dir", "perplexity", "protocol_ids", "METRICS"]

METRICS = ("acc", "acc_norm")  # what a multiple-choice task of the harness reports (with *_stderr)


def check_lm_eval(tasks: Sequence[str], data_dir: str | Path | None = None,
                  ppl: Sequence[str | Path] = (), ppl_protocol: str = "llm-pruner") -> None:
    """Refuse, before any model is loaded, an evaluation that could not run.

    Raises:
        ConfigError: ``lm_eval`` missing (with tasks), a task without its file in
            ``data_dir`` (naming the file looked for), a missing perplexity file, an unknown
            protocol.
    """
    if tasks and importlib.util.find_spec("lm_eval") is None:
        raise ConfigError("--lm-eval needs lm-evaluation-harness: pip install 'dmscale[eval]'")
    if data_dir is not None:
        if not Path(data_dir).is_dir():
            raise ConfigError(f"--lm-eval-data {data_dir}: no such directory")
        missing = missing_files(tasks, data_dir)
        if missing:
            raise ConfigError(f"--lm-eval-data {data_dir}: " + "; ".join(
                f"task {t}: {why}" for t, why in missing.items()))
    for p in ppl:
        if not Path(p).is_file():
            raise ConfigError(f"--ppl {p}: no such file (a WikiText-2 wiki.test.raw or PTB test text)")
    if ppl_protocol not in PROTOCOLS:
        raise ConfigError(f"--ppl-protocol {ppl_protocol}: expected one of {', '.join(PROTOCOLS)}")


def protocol_ids(tokenizer: Any, path: str | Path, limit: int | None = None) -> list[int]:
    """The token ids a perplexity protocol scores (:mod:`dmscale.engine.perplexity`): the
    file's rows (:func:`~dmscale.data.eval_sets.text_rows`) joined with ``"\\n\\n"``,
    tokenised once as ``tokenizer(text)`` does (``limit``: the first ``limit`` of them)."""
    text = "\n\n".join(text_rows(path))
    ids = list(tokenizer(text)["input_ids"])
    return ids[:limit] if limit is not None else ids


def perplexity(model: nn.Module, tokenizer: Any, path: str | Path, protocol: str = "llm-pruner",
               limit: int | None = None, batch_size: int = 8, device: torch.device | str = "cpu",
               ids: Sequence[int] | None = None) -> dict[str, Any]:
    """The perplexity of ``model`` on the text file ``path`` by ``protocol``
    (:data:`~dmscale.engine.perplexity.PROTOCOLS`); ``ids``: the file's tokens when already
    tokenised (:func:`protocol_ids`).

    Raises:
        ConfigError: an unknown protocol; DataError: a text shorter than one window.
    """
    if protocol not in PROTOCOLS:
        raise ConfigError(f"unknown perplexity protocol {protocol!r}: expected one of {', '.join(PROTOCOLS)}")
    if ids is None:
        ids = protocol_ids(tokenizer, path, limit)
    out = window_perplexity(model, ids, PROTOCOLS[protocol], batch_size=batch_size, device=device)
    return {**out, "protocol": protocol, "file": Path(path).name}


def _harness_yaml(task: str) -> Path:
    """The harness's own YAML that defines ``task``."""
    import lm_eval.tasks

    root = Path(lm_eval.tasks.__file__).parent
    for path in root.rglob("*.yaml"):
        text = path.read_text(encoding="utf-8", errors="replace")
        if any(line.strip() == f"task: {task}" for line in text.splitlines()):
            return path
    raise ConfigError(f"lm-evaluation-harness has no task {task!r}")


def task_dir(tasks: Sequence[str], data_dir: str | Path, out: str | Path) -> Path:
    """Write, under ``out``, each task's converted data and a YAML that includes the
    harness's definition of the task with only its data source changed; returns the
    directory to give ``TaskManager(include_path=...)``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for task in tasks:
        spec = EVAL_SETS[task]
        data = convert_task_data(task, data_dir, out / "data")
        splits = {"training_split": None, "validation_split": None, "test_split": None}
        splits[f"{spec.split}_split"] = spec.split
        lines = [f"include: {_harness_yaml(task)}", f"task: {task}", "dataset_path: json",
                 "dataset_name: null", "dataset_kwargs:", "  data_files:", f"    {spec.split}: {data}",
                 *(f"{k}: {'null' if v is None else v}" for k, v in splits.items())]
        (out / f"{task}.yaml").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return out


def harness_model(model: nn.Module, tokenizer: Any, batch_size: int = 8,
                  device: torch.device | str = "cpu") -> Any:
    """The harness's ``HFLM`` around ``model`` (a Hugging Face causal LM, or a wrapper holding
    one, such as the text task's) and its tokenizer."""
    from dmscale.core._compat import ensure_torchvision
    from dmscale.export.hf_sizes import find_hf_model

    ensure_torchvision()
    from lm_eval.models.huggingface import HFLM

    lm = find_hf_model(model)
    lm.eval()
    return HFLM(pretrained=lm, tokenizer=tokenizer, batch_size=batch_size, device=str(device))


@contextlib.contextmanager
def _offline(on: bool) -> Iterator[None]:
    keys = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
    old = {k: os.environ.get(k) for k in keys}
    if on:
        os.environ.update({k: "1" for k in keys})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _task_metrics(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """``{task: {"acc", "acc_stderr", "acc_norm", ...}}`` from the harness's results."""
    out = {}
    for task, values in results["results"].items():
        row = {}
        for key, v in values.items():
            name, _, _filter = key.partition(",")  # "acc,none", "acc_stderr,none"
            if isinstance(v, (int, float)) and name.removesuffix("_stderr") in METRICS:
                row[name] = float(v)
        out[task] = row
    for task, n in (results.get("n-samples") or {}).items():
        if task in out:
            out[task]["examples"] = int(n.get("effective", n.get("original", 0)))
    return out


def evaluate_lm(model: nn.Module, tokenizer: Any, tasks: Sequence[str] = (), data_dir: str | Path | None = None,
                limit: int | None = None, ppl: Sequence[str | Path] = (), ppl_protocol: str = "llm-pruner",
                ppl_limit: int | None = None, batch_size: int = 8,
                device: torch.device | str = "cpu") -> dict[str, dict[str, Any]]:
    """Zero-shot accuracy (lm-evaluation-harness) and perplexity of a causal LM in memory.

    Args:
        model: a Hugging Face causal LM (e.g. ``searcher.export()``), or a wrapper holding one.
        tokenizer: its tokenizer.
        tasks: harness task names (``boolq``, ``winogrande``, ``arc_easy``, ``arc_challenge``,
            or any harness task when ``data_dir`` is None).
        data_dir: a directory of the official files (:mod:`dmscale.data.eval_sets`); None: the
            harness loads the datasets from the hub.
        limit: the first ``limit`` examples of each task (None: the whole split).
        ppl: text files whose perplexity is computed (WikiText-2 ``wiki.test.raw``, PTB test).
        ppl_protocol: ``llm-pruner`` (128-token windows) or ``gptq`` (2,048).
        ppl_limit: the first ``ppl_limit`` tokens of each text (None: all).
        batch_size: sequences per forward.

    Returns ``{task: {"acc", "acc_stderr", ["acc_norm", "acc_norm_stderr"], "examples"},
    "wikitext2" | "ptb" | stem: {"ppl", "loss", "tokens", "windows", "window", "protocol"}}``.

    Raises:
        ConfigError: see :func:`check_lm_eval`.
    """
    tasks = list(tasks)
    check_lm_eval(tasks, data_dir, ppl, ppl_protocol)
    out: dict[str, dict[str, Any]] = {}
    was = model.training
    try:
        if tasks:
            out.update(_harness(model, tokenizer, tasks, data_dir, limit, batch_size, device))
        for path in ppl:
            out[perplexity_name(path)] = perplexity(model, tokenizer, path, ppl_protocol, ppl_limit,
                                                    batch_size=batch_size, device=device)
    finally:
        model.train(was)
    return out


def _harness(model: nn.Module, tokenizer: Any, tasks: list[str], data_dir: str | Path | None,
             limit: int | None, batch_size: int, device: torch.device | str) -> dict[str, dict[str, Any]]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    lm = harness_model(model, tokenizer, batch_size, device)
    with tempfile.TemporaryDirectory() as tmp, _offline(data_dir is not None):
        manager = (TaskManager(include_path=str(task_dir(tasks, data_dir, tmp)), include_defaults=False)
                   if data_dir is not None else TaskManager())
        results = simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit, num_fewshot=0,
                                  bootstrap_iters=1000, log_samples=False)
    return _task_metrics(results)
