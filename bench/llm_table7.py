"""The paper's Table 7 at this machine's scale: SmolLM2-135M pruned to 81 % and 50 % of its
parameters, finetuned on Alpaca with the original as teacher, scored as the field scores
pruned LLMs: WikiText-2 and PTB perplexity (LLM-Pruner's protocol) and zero-shot BoolQ,
WinoGrande, ARC-e, ARC-c through lm-evaluation-harness (issue 55).

    python -m bench.llm_table7 --method dms_p --target 0.81 --seed 0
    python -m bench.llm_table7 --method taylor --target 0.81 --seed 0
    python -m bench.llm_table7 --table     # rewrite the table from the cache
    python -m bench.llm_table7 --quick     # smoke run of dms_p, under bench/runs/

One arm per invocation, cached as ``bench/results/llm_table7/{method}_t{target}_s{seed}.json``.

Protocol (every arm alike; the paper's Section 4.4 where a CPU allows):

* data: the 5,000 Alpaca records of ``shared/data/llm/alpaca_5000.json`` (``--task text``
  instruction records: Alpaca's prompt template, the loss on the response tokens, LLM-Pruner's
  default), examples cut at ``--seq-len`` (128) tokens, batches of 4 records;
* teacher: a frozen copy of the original distils every arm (logits KL, weight 1) during DMS's
  search and during every finetune;
* weight steps: ``--search-steps`` + ``--finetune-steps`` for every arm: DMS searches (weights
  and structure) then finetunes the export; each baseline prunes the original in one shot
  (calibration: 2 training batches) and finetunes for all of those steps; ``original`` is the
  unpruned model finetuned as long;
* arms: ``dms_p`` as the paper ran it (heads and FFN units only, ``--search-dims width``:
  no layer removed, distillation in search and finetune), ``dms`` (the project's default
  search space: heads, FFN units and depth), the baselines of table 5 (``taylor``:
  LLM-Pruner-style Taylor, uniform widths; ``minitron``: Minitron-style activation importance;
  ``shortgpt``: block-influence layer removal; ``tp_taylor``: the Torch-Pruning package's
  Taylor pruner) and ``original``;
* evaluation (:func:`dmscale.evaluate_lm`): the first ``--lm-eval-limit`` examples of each
  task's split (the same for every arm), 0-shot, the harness's prompts and metrics (acc; ARC
  also acc_norm), and the perplexity of the first ``--ppl-limit`` tokens of WikiText-2 test and
  of PTB test by LLM-Pruner's protocol (rows joined with two newlines, 128-token windows); the
  original as loaded (no finetune) is evaluated once the same way;
* served: each DMS arm also writes ``model.gguf`` (``--export gguf``) and, where llama.cpp is
  built (``scripts/build_llamacpp.sh``), ``llama-perplexity -f wiki.test.raw -c 128`` is run
  on it beside transformers' perplexity of the same tokens by llama.cpp's protocol
  (``--ppl-protocol llama.cpp``: the second half of each 128-token chunk scored).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
from dmscale.run.supernets import pretrained_supernet
from dmscale.run.training import cosine_schedule, train, weight_optimizer
from bench.lib.benchlib import (add_quick_flags, git_commit, hand_reading, paired_ci, quick_mode, save_cache,  # noqa: E402
                      write_md)
from bench.lib.smollm2_runs import smollm2_path  # noqa: E402

RESULTS = ROOT / "bench" / "results"
CACHE = RESULTS / "llm_table7"
DATA = Path(os.environ.get("DMSCALE_LLM_DATA") or ROOT.parent / "shared" / "data" / "llm")
TASKS = ("boolq", "winogrande", "arc_easy", "arc_challenge")
PPL = ("wiki.test.raw", "ptb.test.txt")
DMS = ("dms_p", "dms")
BASELINES = ("taylor", "minitron", "shortgpt", "tp_taylor")
METHODS = (*DMS, *BASELINES, "original")
LABEL = {"dms_p": "DMS_p (heads + FFN, as the paper)", "dms": "DMS_p, default space (heads + FFN + depth)",
         "taylor": "LLM-Pruner-style Taylor (uniform)", "minitron": "Minitron-style (activations)",
         "shortgpt": "ShortGPT (layer removal)", "tp_taylor": "Torch-Pruning Taylor (FFN)",
         "original": "original, finetuned the same way", "loaded": "original as loaded (no finetune)"}
# the paper's Table 7 (Llama-7B; LLM-Pruner's protocol, its finetune on the 52k Alpaca records)
PAPER = [("Llama-7B original", "6.74B", 12.62, 22.14, 76.5, 67.01, 72.8, 41.38),
         ("LLM-Pruner", "5.47B", 17.39, 30.2, 66.79, 64.96, 64.06, 37.88),
         ("DMS_p", "5.47B", 17.13, 27.98, 75.23, 65.35, 71.46, 39.59)]


def _epochs(steps: int, args: argparse.Namespace) -> float:
    """The epoch fraction that becomes exactly ``steps`` steps (``ceil(epochs * spe)``)."""
    return (steps - 0.5) / args.steps_per_epoch


def _config(args: argparse.Namespace, out: Path, **extra: Any) -> Any:
    from dmscale.config.run_config import RunConfig

    return RunConfig(command="search", task="text", model=f"hf:{smollm2_path()}", pipeline="p",
                     data=str(DATA / "alpaca_5000.json"), prompt_format="alpaca", loss_on="response",
                     resource="params", target=min(args.target, 0.99), exclude=["lm.model.embed_tokens"],
                     seq_len=args.seq_len, batch_size=args.batch_size, optimizer="adamw",
                     test_limit=getattr(args, "test_limit", None),  # the run's own held-out records
                     threads=args.threads, seed=args.seed, quiet=True, out=str(out), **extra)


def _evaluate(model: Any, tok: Any, args: argparse.Namespace) -> dict[str, Any]:
    import dmscale as dms

    t0 = time.perf_counter()
    out = dms.evaluate_lm(model, tok, TASKS, DATA, limit=args.lm_eval_limit, ppl=[DATA / p for p in PPL],
                          ppl_limit=args.ppl_limit, batch_size=8)
    out["seconds"] = time.perf_counter() - t0
    return out


def _loaded(args: argparse.Namespace) -> dict[str, Any]:
    """The original as loaded, evaluated once per (limit, ppl limit)."""
    path = args.cache / f"loaded_n{args.lm_eval_limit}_m{args.ppl_limit}.json"
    if path.is_file():
        return json.loads(path.read_text())
    from dmscale.tasks.hf_model import load_hf_model, load_hf_tokenizer

    ev = _evaluate(load_hf_model(str(smollm2_path())), load_hf_tokenizer(str(smollm2_path())), args)
    save_cache(path, ev, sort_keys=False)
    return ev


def _dms(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    from dmscale.run.pipeline import Pipeline
    from dmscale.run.saved_runs import load_run_model

    cfg = _config(args, out, search_dims="width" if args.method == "dms_p" else "both",
                  epochs=_epochs(args.search_steps, args), retrain_epochs=_epochs(args.finetune_steps, args),
                  structure_lr=0.1, resource_weight=50.0, export="gguf")
    pipe = Pipeline(cfg)
    summary = pipe.run()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = {ph: max((r["step"] for r in records if r.get("phase") == ph and "step" in r), default=0)
             for ph in ("search", "finish", "retrain")}
    model = load_run_model(out)[0]
    res = {"after": _evaluate(model, pipe.ctx.task.tokenizer, args), "phase_steps": steps,
           "weight_steps": steps["search"] + steps["retrain"], "params": summary["counts"]["found"]["params"],
           "supernet": summary["counts"]["supernet"]["params"], "cost": summary["resources"],
           "structure": _structure(json.loads((out / "structure.json").read_text())),
           "task": pipe.ctx.task.describe().replace(str(DATA) + os.sep, "")}
    res["served"] = _served(model, pipe.ctx.task.tokenizer, out / "model.gguf", args)
    return res


def _structure(s: dict[str, Any]) -> dict[str, Any]:
    kept = {n for d in s.get("depth", []) for n in d["kept"]}
    layer = lambda w: w["name"].split(".self_attn")[0].split(".mlp")[0]  # noqa: E731
    alive = [w for w in s["width"] if not s.get("depth") or layer(w) in kept]
    return {"layers": sum(len(d["kept"]) for d in s.get("depth", [])) if s.get("depth") else 30,
            "kv_groups": [w["kept"] for w in alive if w["name"].endswith("heads")],
            "ffn": [w["kept"] for w in alive if ".mlp." in w["name"]]}


def _baseline(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    import torch

    import dmscale as dms
    from bench.lib import llm_baselines_runs as llm_baselines
    from dmscale.run.pipeline import Pipeline
    from dmscale.run.saved_runs import load_teacher

    steps = args.search_steps + args.finetune_steps
    pipe = Pipeline(_config(args, out, epochs=_epochs(1, args), retrain_epochs=_epochs(steps, args)))
    pipe.ctx.rd.path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed * 10 + 4)
    model, _ = pretrained_supernet(pipe.ctx)
    full = dms.count(model, pipe.ctx.example)["params"]
    teacher = load_teacher("supernet", pipe.ctx.device, supernet=model)  # a frozen copy of the original
    chosen = {}
    if args.method != "original":
        chosen = llm_baselines.prune(args.method, model, pipe, int(round(args.target * full)), 2)
    total = pipe.ctx.steps(pipe.ctx.cfg.retrain_epochs)
    opt = weight_optimizer(pipe.ctx.cfg, list(model.parameters()))
    train(pipe.ctx, "retrain", model, total, [opt], [cosine_schedule(pipe.ctx.cfg, opt, total)], teacher=teacher)
    return {"after": _evaluate(model, pipe.ctx.task.tokenizer, args), "weight_steps": total,
            "params": dms.count(model, pipe.ctx.example)["params"], "supernet": full,
            "chosen": {k: v for k, v in chosen.items() if k != "block_influence"},
            "task": pipe.ctx.task.describe().replace(str(DATA) + os.sep, "")}


def _llamacpp() -> Path | None:
    root = Path(os.environ.get("DMSCALE_LLAMACPP_DIR", Path.home() / ".cache" / "dmscale" / "llama.cpp"))
    binary = root / "build" / "bin" / "llama-perplexity"
    return binary if binary.is_file() else None


def _served(model: Any, tok: Any, gguf: Path, args: argparse.Namespace) -> dict[str, Any] | None:
    """llama.cpp's ``llama-perplexity`` on the GGUF against transformers' on the same tokens
    and chunks (llama.cpp's protocol); None where llama.cpp is not built."""
    from dmscale.engine.perplexity import llamacpp_perplexity

    binary = _llamacpp()
    if binary is None or not gguf.is_file():
        return None
    chunks = args.ppl_limit // 128
    t0 = time.perf_counter()
    log = gguf.with_suffix(".perplexity.log")  # a file, not a pipe: piped, llama.cpp's log can lose its end
    with open(log, "w", encoding="utf-8") as fh:
        run = subprocess.run([str(binary), "-m", str(gguf), "-f", str(DATA / "wiki.test.raw"), "-c", "128", "-b",
                              "128", "--chunks", str(chunks), "-t", str(args.threads)], stdout=fh,
                             stderr=subprocess.STDOUT)
    printed = log.read_text(encoding="utf-8", errors="replace")
    found = re.findall(r"Final estimate: PPL = ([0-9.]+)", printed)
    if run.returncode != 0 or not found:
        return {"error": printed[-400:]}
    add_bos, bos = _gguf_bos(gguf)
    ids = tok((DATA / "wiki.test.raw").read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    ids = ([bos] if add_bos else []) + list(ids)  # as llama.cpp tokenises the file (common_tokenize)
    ours = llamacpp_perplexity(model, ids, 128, chunks, bos=bos if add_bos else None)
    return {"llamacpp_ppl": float(found[-1]), "transformers_ppl": ours["ppl"], "chunks": chunks, "ctx": 128,
            "rel_diff": float(found[-1]) / ours["ppl"] - 1, "seconds": time.perf_counter() - t0}


def _gguf_bos(path: Path) -> tuple[bool, int | None]:
    """Whether llama.cpp adds the BOS token for the GGUF's vocabulary, and its id."""
    import gguf

    fields = gguf.GGUFReader(path).fields
    add = fields.get("tokenizer.ggml.add_bos_token")
    bos = fields.get("tokenizer.ggml.bos_token_id")
    return (bool(add.contents()) if add is not None else False), (int(bos.contents()) if bos is not None else None)


def run_arm(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out or tempfile.mkdtemp(prefix="table7-")) / f"{args.method}_t{args.target}_s{args.seed}"
    t0 = time.perf_counter()
    res = _dms(args, out) if args.method in DMS else _baseline(args, out)
    shown = lambda v: str(v).replace(str(ROOT) + os.sep, "").replace(str(DATA.parent.parent), "shared")  # noqa: E731
    plain = {k: shown(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in ("out", "cache")}
    res.update(method=args.method, target=args.target, seed=args.seed, args=plain, commit=git_commit(ROOT),
               machine=platform.platform(), cpus=os.cpu_count(), wall_s=time.perf_counter() - t0,
               peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return res


def _path(method: str, target: float, seed: int, cache: Path) -> Path:
    return cache / f"{method}_t{target}_s{seed}.json"


def _records(cache: Path) -> list[dict[str, Any]]:
    return [json.loads(f.read_text()) for f in sorted(cache.glob("*_t*_s*.json"))]


def _values(ev: dict[str, Any]) -> dict[str, float]:
    """The table's columns of one evaluation: perplexities, accuracies in %, their mean."""
    acc = {t: 100 * ev[t]["acc"] for t in TASKS}
    return {"wikitext2": ev["wikitext2"]["ppl"], "ptb": ev["ptb"]["ppl"], **acc,
            "mean_acc": statistics.mean(acc.values())}


COLUMNS = ("wikitext2", "ptb", *TASKS, "mean_acc")


def _row(label: str, rs: list[dict[str, Any]], params: str) -> str:
    vals = [_values(r["after"]) for r in rs]
    cells = []
    for c in COLUMNS:
        xs = [v[c] for v in vals]
        m = statistics.mean(xs)
        spread = f" ± {statistics.stdev(xs):.2f}" if len(xs) > 1 else ""
        cells.append(f"{m:.2f}{spread}")
    return f"| {label} | {len(rs)} | {params} | " + " | ".join(cells) + " |"


def _by_seed(recs: list[dict[str, Any]], method: str, target: float, col: str) -> dict[int, float]:
    return {r["seed"]: _values(r["after"])[col] for r in recs if r["method"] == method and r["target"] == target}


def _best_baseline(recs: list[dict[str, Any]], target: float) -> str | None:
    arms = [(m, _by_seed(recs, m, target, "wikitext2")) for m in BASELINES]
    arms = [(m, b) for m, b in arms if b]
    return min(arms, key=lambda mb: statistics.mean(mb[1].values()))[0] if arms else None


def _paired(recs: list[dict[str, Any]], target: float, a: str, b: str) -> list[str]:
    """``a`` against ``b`` at ``target``, paired by seed, per column: the difference in b's
    disfavour (perplexity: b - a; accuracy: a - b), with its 95 % t-interval over >= 2 seeds."""
    out = []
    for col in ("wikitext2", "ptb", "mean_acc"):
        x, y = _by_seed(recs, a, target, col), _by_seed(recs, b, target, col)
        seeds = sorted(set(x) & set(y))
        if not seeds:
            continue
        d = [(y[s] - x[s]) if col != "mean_acc" else (x[s] - y[s]) for s in seeds]
        text = f"{statistics.mean(d):+.2f}"
        if len(d) > 1:
            _, lo, hi, _ = paired_ci(d)
            text += f" [{lo:+.2f}, {hi:+.2f}]"
        what = {"wikitext2": "WikiText-2 perplexity lower by", "ptb": "PTB perplexity lower by",
                "mean_acc": "mean zero-shot accuracy higher by (pt)"}[col]
        out.append(f"{what} {text} over seeds {', '.join(map(str, seeds))}")
    return out


def write_markdown(cache: Path = CACHE, out: Path = RESULTS, name: str = "llm_table7") -> Path:
    recs = [r for r in _records(cache)]
    if not recs:
        sys.exit(f"no cached arm in {cache}")
    r0 = recs[0]
    a = r0["args"]
    loaded = _loaded(argparse.Namespace(**{**a, "cache": cache}))
    cmds = sorted({f"    PYTHONPATH=src python bench/llm_table7.py --method {r['method']} --target {r['target']} "
                   f"--seed {r['seed']}" for r in recs})
    lines = [f"# The paper's Table 7 at CPU scale: SmolLM2-135M, Alpaca finetune, WikiText-2 / PTB / zero-shot",
             "", "Written by `bench/llm_table7.py` (protocol in its docstring); `--table` rewrites it from "
             f"`bench/results/{cache.name}/`. Commands:", "", *cmds, "",
             f"Commits: {', '.join(sorted({'`' + r['commit'] + '`' for r in recs}))}; machine: {r0['machine']}, "
             f"{r0['cpus']} CPU cores, {a['threads']} torch thread per arm (two arms side by side), float32, no GPU.",
             "", f"Data: {r0['task'].replace(str(DATA) + os.sep, '')}. Every arm: {a['search_steps'] + a['finetune_steps']} weight steps of "
             f"{a['batch_size']} records (DMS: {a['search_steps']} search + {a['finetune_steps']} finetune), AdamW "
             "lr 1e-4 cosine, logits-KL distillation from a frozen copy of the original in every finetune and in "
             f"DMS's search. Evaluation: the first {a['lm_eval_limit']} examples of each task (BoolQ dev, "
             "WinoGrande dev, ARC-Easy / ARC-Challenge test; lm-evaluation-harness 0-shot, acc), the first "
             f"{a['ppl_limit']:,} tokens of WikiText-2 test and PTB test (LLM-Pruner's protocol: rows joined "
             "with two newlines, 128-token windows); the same subsets for every arm. Mean ± std over seeds.", "",
             "| method | seeds | parameters | WikiText-2 ↓ | PTB ↓ | BoolQ | WinoGrande | ARC-e | ARC-c | mean acc |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    sup = r0["supernet"]
    lines.append(_row(LABEL["loaded"], [{"after": loaded}], f"{sup / 1e6:.1f}M (100 %)"))
    order = {m: i for i, m in enumerate(METHODS)}
    for t in sorted({r["target"] for r in recs}, reverse=True):
        for m in sorted({r["method"] for r in recs if r["target"] == t}, key=order.get):
            rs = sorted((r for r in recs if r["target"] == t and r["method"] == m), key=lambda r: r["seed"])
            p = statistics.mean(r["params"] for r in rs)
            budget = "100 %" if m == "original" else f"{t:.0%}"
            lines.append(_row(f"{budget}: {LABEL[m]}", rs, f"{p / 1e6:.1f}M ({p / sup:.1%})"))
    lines += ["", "The paper's rows (Llama-7B, its Table 7; the full splits, the 52k Alpaca records):", "",
              "| model | parameters | WikiText-2 | PTB | BoolQ | WinoGrande | ARC-e | ARC-c |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {m} | {p} | " + " | ".join(f"{v:g}" for v in vals) + " |" for m, p, *vals in PAPER]
    lines += ["", "## DMS against the best baseline, paired by seed", ""]
    for t in sorted({r["target"] for r in recs}, reverse=True):
        best = _best_baseline(recs, t)
        for d in DMS:
            if best is None or not _by_seed(recs, d, t, "wikitext2"):
                continue
            parts = _paired(recs, t, d, best)
            lines.append(f"- {t:.0%}, {LABEL[d]} vs {LABEL[best]} (the baseline of lowest WikiText-2 "
                         f"perplexity): " + "; ".join(parts) + ".")
        orig = _by_seed(recs, "original", 1.0, "wikitext2") or _by_seed(recs, "original", t, "wikitext2")
        dms = _by_seed(recs, "dms_p", t, "wikitext2")
        if orig and dms:
            o = statistics.mean(orig.values())
            paper = "; the paper's: 1.36x at 81 %, the issue's goal 1.3x" if t > 0.8 else ""
            lines.append(f"- {t:.0%}: DMS_p's WikiText-2 perplexity is {statistics.mean(dms.values()) / o:.2f}x the "
                         f"finetuned original's ({o:.2f}){paper}.")
    served = [r for r in recs if r.get("served")]
    if served:
        lines += ["", "## Served: llama.cpp's perplexity of the GGUF beside transformers'", "",
                  "`llama-perplexity -m RUN/model.gguf -f wiki.test.raw -c 128 --chunks K` against the "
                  "same tokens, chunks and scoring in transformers (`--ppl-protocol llama.cpp`: the second half "
                  "of each 128-token chunk):", "",
                  "| arm | chunks | llama.cpp | transformers | difference |", "| --- | ---: | ---: | ---: | ---: |"]
        for r in sorted(served, key=lambda r: (-r["target"], r["method"], r["seed"])):
            s = r["served"]
            if "error" in s:
                lines.append(f"| {r['method']} {r['target']:.0%} s{r['seed']} | - | failed: {s['error'][:80]} | | |")
                continue
            lines.append(f"| {r['method']} {r['target']:.0%} s{r['seed']} | {s['chunks']} | {s['llamacpp_ppl']:.3f} | "
                         f"{s['transformers_ppl']:.3f} | {100 * s['rel_diff']:+.2f} % |")
    lines += ["", "What DMS kept:", ""]
    for r in sorted((r for r in recs if r["method"] in DMS), key=lambda r: (-r["target"], r["method"], r["seed"])):
        s = r["structure"]
        lines.append(f"- {r['method']} {r['target']:.0%} seed {r['seed']}: {s['layers']}/30 layers, KV groups "
                     f"{sum(s['kv_groups'])}/90, FFN units {sum(s['ffn']):,}/46,080 (per layer "
                     f"{min(s['ffn'])}-{max(s['ffn'])})")
    notes = hand_reading(RESULTS / f"{name}_notes.md", strip=False)
    if notes is not None:
        lines += ["", notes]
    md = write_md(out / f"{name}.md", lines)
    keep = ("method", "target", "seed", "params", "supernet", "weight_steps", "after", "served")
    save_cache(out / f"{name}.json", [{k: r.get(k) for k in keep} for r in recs], sort_keys=False)
    return md


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--method", choices=METHODS, default="dms_p")
    p.add_argument("--target", type=float, default=0.81)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--search-steps", type=int, default=16)
    p.add_argument("--finetune-steps", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lm-eval-limit", type=int, default=50)
    p.add_argument("--ppl-limit", type=int, default=8192)
    p.add_argument("--test-limit", type=int, default=50,
                   help="held-out Alpaca records of the run's own evaluations (not the table's metrics)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="scratch run directories (default: a temp dir)")
    p.add_argument("--table", action="store_true", help="only rewrite the table from the cache")
    add_quick_flags(p, "llm_table7", "smoke run of dms_p: 2 + 1 steps of 2 records of 32 tokens, 4 examples "
                    "per task, 512 tokens of text, under WORKDIR/quick", "runs, cache and table")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    global RESULTS
    RESULTS = quick_mode(args, RESULTS, search_steps=2, finetune_steps=1, seq_len=64, batch_size=2,
                         lm_eval_limit=4, ppl_limit=512)
    args.cache = RESULTS / "llm_table7"
    args.cache.mkdir(parents=True, exist_ok=True)
    args.steps_per_epoch = 4500 // args.batch_size  # the training records (5,000 less 10 % held out) per batch
    if args.quick:
        args.out = str(RESULTS / "runs")
    if not args.table:
        _loaded(args)
        if args.method == "original":
            args.target = 1.0
        res = run_arm(args)
        save_cache(_path(args.method, args.target, args.seed, args.cache), res, sort_keys=False)
        print(json.dumps({k: res[k] for k in ("method", "target", "seed", "params", "weight_steps")}))
    print(write_markdown(args.cache, RESULTS).read_text())


if __name__ == "__main__":
    main()
