"""The LLM evaluation of an ``hf:`` run: ``--lm-eval`` / ``--ppl`` at the end of a search or
retrain, and ``dmscale eval RUN --lm-eval ...`` (:func:`dmscale.evaluate_lm` on the found
model and on the original).

The original model -- the pretrained model the run started from, as loaded -- is evaluated
the same way once: its numbers are kept in the run's ``state.json`` under ``lm_eval`` with
the settings they were measured under, and reused while the settings (tasks, data, limits,
perplexity files and protocol) stay the same. ``summary.json`` and ``report.md`` show
original -> found for every metric.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch

from dmscale.config.run_config import ConfigError, RunConfig, load_run_config
from dmscale.engine.rundir import RunDir
from dmscale.integrations.lm_eval import check_lm_eval, evaluate_lm
from dmscale.run.report import write_report
from dmscale.run.report_text import lm_eval_lines
from dmscale.run.saved_runs import load_run_model, new_supernet
from dmscale.tasks.hf_model import is_hf_model, load_hf_tokenizer, parse_hf_spec

__all__ = ["lm_eval_settings", "check_lm_eval_run", "run_lm_eval", "lm_eval_config", "evaluate_run_lm",
           "LM_OPTIONS"]

# the options of `dmscale eval` that ask for an LLM evaluation
LM_OPTIONS = ("lm_eval", "lm_eval_data", "lm_eval_limit", "ppl", "ppl_protocol", "ppl_limit")


def lm_eval_settings(cfg: RunConfig) -> dict[str, Any] | None:
    """What ``cfg`` asks to evaluate (None: nothing): the tasks, the data directory, the
    limits, the perplexity files (absolute paths) and protocol."""
    if not cfg.lm_eval and not cfg.ppl:
        return None
    return {"tasks": list(cfg.lm_eval or []),
            "data": str(Path(cfg.lm_eval_data).resolve()) if cfg.lm_eval_data else None,
            "limit": cfg.lm_eval_limit, "ppl": [str(Path(p).resolve()) for p in cfg.ppl or []],
            "ppl_protocol": cfg.ppl_protocol, "ppl_limit": cfg.ppl_limit}


def check_lm_eval_run(cfg: RunConfig) -> None:
    """Refuse, before any model is loaded, an evaluation ``cfg`` asks for that cannot run.

    Raises:
        ConfigError: ``--lm-eval`` / ``--ppl`` for a model that is not ``hf:PATH``, or what
            :func:`dmscale.integrations.lm_eval.check_lm_eval` refuses.
    """
    settings = lm_eval_settings(cfg)
    if settings is None:
        return
    if not is_hf_model(cfg.model):
        raise ConfigError(f"--lm-eval / --ppl evaluate a causal LM with its tokenizer: the run's model is "
                          f"{cfg.model}, give --model hf:PATH (or use dmscale.evaluate_lm from Python)")
    check_lm_eval(settings["tasks"], settings["data"], settings["ppl"], settings["ppl_protocol"])


def run_lm_eval(cfg: RunConfig, run_dir: str | Path, tokenizer: Any, state: dict[str, Any],
                device: torch.device | str = "cpu", batch_size: int = 8,
                log: Callable[[str], None] = lambda _: None) -> dict[str, Any] | None:
    """Evaluate the found model of the run at ``run_dir`` (and the original, the model
    ``cfg.model`` as loaded, unless ``state`` holds its numbers for the same settings) as
    ``cfg`` asks; stores and returns ``{"settings", "original", "found"}`` in
    ``state["lm_eval"]`` (None when nothing is asked or the run has no found model)."""
    settings = lm_eval_settings(cfg)
    if settings is None or not (Path(run_dir) / "model.safetensors").is_file():
        return None

    def measure(model: torch.nn.Module) -> dict[str, Any]:
        return evaluate_lm(model, tokenizer, settings["tasks"], settings["data"], settings["limit"],
                           settings["ppl"], settings["ppl_protocol"], settings["ppl_limit"],
                           batch_size=batch_size, device=device)

    before = state.get("lm_eval") or {}
    record: dict[str, Any] = {"settings": settings}
    if before.get("settings") == settings and before.get("original"):
        record["original"] = before["original"]
        log("original model: LLM evaluation kept from the run (same settings)")
    else:
        log("evaluating the original model (lm-evaluation-harness / perplexity) ...")
        with torch.random.fork_rng(devices=[]):
            model = new_supernet(cfg, cfg.task_info, cfg.seed)[0].to(device)
        record["original"] = measure(model)
        del model
    log("evaluating the found model (lm-evaluation-harness / perplexity) ...")
    record["found"] = measure(load_run_model(run_dir, device=device)[0])
    state["lm_eval"] = record
    return record


def lm_eval_config(run_dir: str | Path, options: dict[str, Any]) -> RunConfig | None:
    """The saved run's configuration with ``options`` (:data:`LM_OPTIONS` given to
    ``dmscale eval``), checked before any model is loaded; None when they ask for nothing.

    Raises:
        ConfigError: see :func:`check_lm_eval_run`.
    """
    given = {k: v for k, v in options.items() if k in LM_OPTIONS and v is not None}
    if not given:
        return None
    cfg = replace(load_run_config(run_dir), **given)
    check_lm_eval_run(cfg)
    return cfg if lm_eval_settings(cfg) is not None else None


def evaluate_run_lm(run_dir: str | Path, cfg: RunConfig, device: torch.device | str = "cpu",
                    batch_size: int = 8) -> tuple[dict[str, Any], str]:
    """``dmscale eval RUN --lm-eval ...``: the run's found model and its original evaluated
    (:func:`run_lm_eval`), kept in the run's ``state.json`` and ``summary.json``, its report
    rewritten; returns ``(record, text)``."""
    rd = RunDir(run_dir)
    state = rd.read_json("state.json", {})
    record = run_lm_eval(cfg, rd.path, load_hf_tokenizer(parse_hf_spec(cfg.model)), state, device,
                         batch_size=batch_size, log=lambda m: print(m, file=sys.stderr, flush=True))
    if record is None:
        raise ConfigError(f"{rd.path} has no found model (model.safetensors) to evaluate")
    rd.write_json("state.json", state)
    summary = rd.read_json("summary.json")
    if summary is not None:
        rd.write_json("summary.json", {**summary, "lm_eval": record})
        write_report(rd.path)
    text = "\n".join([f"{rd.path}: LLM evaluation, original -> found",
                      *(f"  {line}" for line in lm_eval_lines(record))])
    return record, text
