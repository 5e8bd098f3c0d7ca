"""The LLM pruning baselines' runs (``python -m bench.llm_baselines``): a pipeline configured as
the DMS arm's, each method's pruning at a parameter target, and one arm's prune, evaluation and
finetune. ``llm_table5`` and ``llm_table7`` reuse them."""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

from dmscale.run.supernets import pretrained_supernet
from dmscale.run.training import cosine_schedule, train, weight_optimizer
from bench.lib import llm_baselines_lib as lib
from bench.lib import llm_minitron
from bench.lib.benchlib import git_commit
from bench.lib.smollm2_runs import protocol, smollm2_path

__all__ = ["METHODS", "BASELINES", "DEFAULT_FT", "DEFAULT_STEPS", "DMS_CACHE", "LABEL", "make_pipeline", "prune",
           "run"]

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
DMS_CACHE = RESULTS / "smollm2_prune"
METHODS = ("taylor", "tp_taylor", "tp_hidden", "minitron", "minitron_keep_heads", "magnitude", "shortgpt",
           "original")
BASELINES = METHODS[:-1]  # the pruning methods; "original" is the reference line
DEFAULT_FT = 0.00145  # the DMS arm's --retrain-epochs
DEFAULT_STEPS = 4  # what DEFAULT_FT is at batch 4 x 128 (1,407,001 training tokens)
CALIB_SEED = 97  # train batches for calibration; the finetune uses seed * 10 + 4


def make_pipeline(args: argparse.Namespace, out: Path) -> Any:
    """A pipeline configured exactly as the DMS run's (its retrain settings are what matter)."""
    from dmscale.config.run_config import RunConfig
    from dmscale.run.pipeline import Pipeline

    cfg = RunConfig(command="search", task="text", model=f"hf:{smollm2_path()}", pipeline="p",
                    resource="params", target=args.target, exclude=["lm.model.embed_tokens"],
                    seq_len=args.seq_len, batch_size=args.batch_size, epochs=0.0018,
                    retrain_epochs=args.retrain_epochs, test_limit=args.test_limit,
                    optimizer="adamw", threads=args.threads, quiet=True, out=str(out),
                    settle=0.0,  # the cached rows' protocol (before the settle phase)
                    seed=getattr(args, "seed", 0), **protocol(args))
    pipe = Pipeline(cfg)
    assert pipe.ctx.cfg.teacher == "supernet" and (pipe.ctx.cfg.distills or not pipe.ctx.cfg.distill_weight), pipe.ctx.cfg
    pipe.ctx.rd.path.mkdir(parents=True, exist_ok=True)
    return pipe


def _taylor(model: Any, pipe: Any, calib: list[Any]) -> lib.Scores:
    """LLM-Pruner's Taylor scores from the task loss summed over ``calib``; gradients cleared after."""
    lib.accumulate_grads(model, calib, lambda logits, y: pipe.ctx.task.task_loss(logits, y))
    scores = lib.taylor_scores(model)
    model.zero_grad(set_to_none=True)
    return scores


def prune(method: str, model: Any, pipe: Any, target: int, n_calib: int,
          widths: dict[str, list[int]] | None = None) -> dict[str, Any]:
    """Prune ``model`` in place with ``method``; returns what was chosen. ``per_layer_taylor``
    keeps the given per-layer ``widths`` (``{"kv_groups": [...], "ffn": [...]}``, one entry per
    layer; ``target`` is then unused), the units chosen by the same Taylor importance."""
    calib = [pipe.ctx.task.train_batch(i, pipe.ctx.cfg.batch_size, CALIB_SEED) for i in range(n_calib)]
    if method == "per_layer_taylor":
        if widths is None:
            raise ValueError("per_layer_taylor needs the per-layer widths to keep")
        n = len(lib.decoder(model).model.layers)
        lib.prune_structure(model, _taylor(model, pipe, calib), widths.get("kept_layers", list(range(n))),
                            widths["kv_groups"], widths["ffn"])
        return {**widths, "calib_batches": n_calib}
    if method in ("taylor", "magnitude"):
        kv, ffn = lib.solve_uniform(model, target)
        scores = _taylor(model, pipe, calib) if method == "taylor" else lib.magnitude_scores(model)
        lib.prune_uniform(model, scores, kv, ffn)
        return {"kv_groups": kv, "ffn": ffn, "calib_batches": n_calib if method == "taylor" else 0}
    if method == "tp_taylor":
        chosen = lib.tp_taylor_prune(model, calib, lambda logits, y: pipe.ctx.task.task_loss(logits, y),
                                     lib.ffn_keep_for_target(model, target))
        return {**chosen, "calib_batches": n_calib}
    if method == "tp_hidden":
        chosen = lib.tp_hidden_prune(model, calib, lambda logits, y: pipe.ctx.task.task_loss(logits, y),
                                     lib.tp_hidden_ratio_for_target(model, target))
        return {**chosen, "calib_batches": n_calib, "save_pretrained": _config_saves(model)}
    if method in ("minitron", "minitron_keep_heads"):
        scores = llm_minitron.activation_scores(model, [x for x, _ in calib])
        widths = llm_minitron.minitron_widths(model, target, keep_heads=method == "minitron_keep_heads")
        llm_minitron.minitron_prune(model, scores, **widths)
        return {**llm_minitron.kept_widths(model), **widths, "calib_batches": n_calib,
                "save_pretrained": _config_saves(model)}
    if method == "shortgpt":
        bi = lib.block_influence(model, [x for x, _ in calib])
        drop = lib.layers_for_target(model, bi, target)
        lib.remove_layers(model, drop)
        return {"block_influence": [round(float(b), 5) for b in bi], "removed": drop,
                "calib_batches": n_calib}
    return {}


def _config_saves(model: Any) -> str:
    """Whether the pruned model's config passes transformers' ``save_pretrained`` validation
    ("ok", or the error's first line): a hidden size that is no multiple of the query heads does
    not, so such a model cannot be saved for ``from_pretrained``."""
    try:
        with tempfile.TemporaryDirectory() as d:
            lib.decoder(model).config.save_pretrained(d)
    except Exception as err:  # noqa: BLE001 - recorded, the arm's finetune goes on
        return f"{type(err).__name__}: {str(err).strip().splitlines()[-1].strip()[:200]}"
    return "ok"


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import dmscale as dms
    from dmscale.run.saved_runs import load_teacher

    t0 = time.perf_counter()
    pipe = make_pipeline(args, Path(args.out or tempfile.mkdtemp(prefix="llmb-")) / f"{args.method}{args.target}")
    torch.manual_seed(pipe.ctx.cfg.seed * 10 + 4)
    original, _ = pretrained_supernet(pipe.ctx)
    full = dms.count(original, pipe.ctx.example)["params"]
    target = int(round(args.target * full)) if args.method != "original" else full
    teacher = load_teacher("supernet", pipe.ctx.device, supernet=original)  # a frozen copy
    if getattr(args, "quick", False):  # the original's evaluation that the table reads (the DMS arm's, otherwise)
        path = DMS_CACHE / f"original_seq{args.seq_len}_test{args.test_limit}.json"
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(pipe.ctx.task.evaluate(teacher), indent=1), encoding="utf-8")
    model = original
    tp0 = time.perf_counter()
    chosen = prune(getattr(args, "prune", args.method), model, pipe, target, args.calib_batches,
                   getattr(args, "widths", None))
    prune_s = time.perf_counter() - tp0
    params = dms.count(model, pipe.ctx.example)["params"]
    with torch.no_grad():
        assert pipe.ctx.task.forward(model, pipe.ctx.example).shape[-1] == pipe.ctx.task.info["vocab_size"]
    before = pipe.ctx.evaluate("search", model, None, 0) if args.method != "original" else _original_eval(args)
    total = pipe.ctx.steps(pipe.ctx.cfg.retrain_epochs)
    opt = weight_optimizer(pipe.ctx.cfg, list(model.parameters()))
    train(pipe.ctx, "retrain", model, total, [opt], [cosine_schedule(pipe.ctx.cfg, opt, total)], teacher=teacher)
    after = pipe.ctx.evaluate("retrain", model, None, total)
    # json: --workdir, relative to the checkout when inside it (no machine's paths in the results)
    plain = {k: _shown(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    return {"method": args.method, "target": args.target, "args": plain, "commit": git_commit(ROOT),
            "machine": platform.platform(), "cpus": os.cpu_count(), "params": params,
            "supernet": full, "target_params": target, "chosen": chosen, "before": before,
            "after": after, "finetune_steps": total, "prune_s": prune_s,
            "wall_s": time.perf_counter() - t0, "task": pipe.ctx.task.describe(),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _shown(path: Path) -> str:
    """``path`` relative to the checkout when it lies inside it, else as given."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def _original_eval(args: argparse.Namespace) -> dict[str, float]:
    path = DMS_CACHE / f"original_seq{args.seq_len}_test{args.test_limit}.json"
    return json.loads(path.read_text())


LABEL = {"dms": "DMS_p + distillation (per-layer widths)",
         "taylor": "LLM-Pruner Taylor, uniform (hand-written)",
         "tp_taylor": "Torch-Pruning Taylor, uniform (FFN only)",
         "tp_hidden": "Torch-Pruning Taylor, uniform (hidden size + FFN, its LLM example's scope)",
         "minitron": "Minitron activation importance, uniform (hidden + heads + FFN)",
         "minitron_keep_heads": "Minitron activation importance, uniform, every head kept (hidden + FFN)",
         "magnitude": "L2 magnitude, uniform", "shortgpt": "ShortGPT block influence (layers)",
         "original": "original, finetuned (reference)"}
