"""GPU check of issue 29: today's code and the new code side by side, on one GPU, in one run.

Make the snapshot of today's code once, where git is (``bench/_baseline/`` is git-ignored),
then run from the repository root (any PYTHONPATH: each worker sets its own):

    python -m bench.gpu_check --make-baseline 340ec91    # -> bench/_baseline/src/dmscale, bench/_baseline/COMMIT
    python -m bench.gpu_check --out OUT --new-commit HASH

``HASH``: the commit of the working tree's ``src`` (git names it when ``.git`` is there; on a
machine without it, pass it, and carry the git-ignored ``bench/_baseline`` along with the
working tree). ``--new-src`` compares another snapshot instead (``--make-baseline BRANCH
--baseline-src DIR/src`` makes one; its ``COMMIT`` file names it). It writes ``OUT/gpu_check.json`` and ``OUT/gpu_check.md``, both rewritten while
it runs (a run stopped at any point keeps what it measured), and ``OUT/workers/`` (each
worker's spec, json and log). The default run should take 4-6 minutes on an H100 (an
estimate from CPU timings of the same code; the run says what it took):
``--budget-s`` (default 340) is the time after which no measurement starts (the rest is
listed as skipped), and a running one is stopped ``--grace-s`` (30) later.

Two tables, each model measured once with each implementation, each (implementation, model)
in a fresh process whose PYTHONPATH is that implementation's ``src`` only (the two packages
never share a process; GPU memory peaks start clean); see bench/lib/gpu_check_lib.py for what is
measured:

1. training step, bf16 autocast: plain vs DMS (``dms.prepare(model.cuda(), example,
   SearchConfig(resource="macs", target=0.5))``, 0.8 for the LLM; SGD on
   ``searcher.model_parameters()``, Adam on ``searcher.structure_parameters()``, loss = task +
   ``searcher.resource_loss(0.5)``): median step ms, DMS / plain, peak memory, CUDA kernels per
   step. ``--compile`` adds the new code under ``torch.compile``: ``model.forward`` compiled, as
   dmscale's own ``--compile`` does it, and ``torch.compile(model)`` (off by default: minutes;
   ``--compile module_cudagraphs``: ``mode="reduce-overhead"``, CUDA graphs, whose replay
   launches each compiled graph with one host call; ``--compile-today``: today's code compiled
   too, for a snapshot that compiles).
2. export latency, bf16, eval: ``randomize_importance(0); meet_target(); export()`` at 0.5 x MACs
   (0.8 for the LLM; on the CPU unless ``--export-device cuda``), exported over original, at the training batch and batch 1: today's code,
   the new code with ``SearchConfig(align=1)`` and ``align=8`` (where SearchConfig has no
   ``align``: the default configuration, marked †, and n/a); the searched widths that are
   multiples of 8; how many timm attention modules of the export keep ``fused_attn``.

Models: torchvision ResNet-50 (224 px, batch 64), timm ViT-B/16 (batch 64), a Llama of
SmolLM2-135M's shape (random init, batch 16 x 512 tokens); YOLOv8n in table 2 only where
``ultralytics`` imports (else n/a); ``--models`` picks some, in the order to measure them.
``--quick``: tiny versions of each, batch 2, on CPU, two rounds (a smoke run of every code
path, 45-80 s on 2 shared cores; OUT defaults to bench/runs/gpu_check/quick).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
from bench.lib.benchlib import RUNS, command_line, git_commit  # noqa: E402
from bench.lib.gpu_check_lib import SPECS  # noqa: E402

__all__ = ["IMPLS", "make_baseline", "plan", "run_job", "render", "main"]

IMPLS = ("today", "new")
BASELINE = ROOT / "bench" / "_baseline" / "src"
TRAIN_MODELS = ("resnet50", "vit_b16", "llama_135m")
EXPORT_MODELS = ("resnet50", "vit_b16", "llama_135m", "yolov8n")
COMPILE_LABELS = {"forward": "model.forward = torch.compile(model.forward)", "module": "torch.compile(model)",
                  "module_cudagraphs": "torch.compile(model, mode=\"reduce-overhead\")"}


# ----------------------------------------------------------------------------- the snapshot
def make_baseline(commit: str, src: Path) -> str:
    """Extract ``commit``'s src/dmscale into ``src.parent`` (``git archive``) and write the
    full hash to ``src.parent / "COMMIT"``; returns it."""
    full = subprocess.run(["git", "rev-parse", "--verify", f"{commit}^{{commit}}"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout.strip()
    dest = src.parent
    shutil.rmtree(src, ignore_errors=True)
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "archive", full, "src/dmscale"], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    (dest / "COMMIT").write_text(full + "\n")
    return full


def src_digest(src: Path) -> str:
    """sha256 (first 12 hex digits) of every .py file under ``src/dmscale``, path and content:
    which code ran, also where there is no git to name a commit."""
    h = hashlib.sha256()
    for f in sorted((src / "dmscale").rglob("*.py")):
        h.update(str(f.relative_to(src)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def _impl_info(src: Path, commit: str | None) -> dict[str, Any]:
    """Where an implementation is, whether it is there, its commit and digest. The commit:
    ``commit`` if given, else a snapshot's ``COMMIT`` file beside ``src``, else git's for this
    checkout's own src (``+ uncommitted changes`` when src differs from it), else "?"."""
    ok = (src / "dmscale" / "__init__.py").is_file()
    stamp = src.parent / "COMMIT"
    if commit is None and stamp.is_file():
        commit = stamp.read_text().strip()[:7]
    if commit is None and src == (ROOT / "src").resolve():
        commit = git_commit(ROOT)
        dirty = commit != "?" and subprocess.run(["git", "status", "--porcelain", "--", str(src)], cwd=ROOT,
                                                 capture_output=True, text=True).stdout.strip()
        commit += " + uncommitted changes" if dirty else ""
    return {"src": str(src), "present": ok, "commit": commit or "?", "digest": src_digest(src) if ok else None}


# ----------------------------------------------------------------------------- the plan
# the new code with one thing switched off, in table 1: run flag -> (row label, worker setting)
VARIANTS = {
    "eager_norms": ("fuse_norms=False", {"fuse_norms": False}),  # its masked norms eager
    "per_layer_folds": ("per-layer folds", {"fold_batch": False}),  # each layer folding alone
}


def _variant_jobs(args: argparse.Namespace, name: str) -> list[dict[str, Any]]:
    """The table-1 workers of :data:`VARIANTS` ``name``, one per model, where its flag is set."""
    if not getattr(args, name, False):
        return []
    return [{"key": f"new+{name}/{m}", "impl": "new", "model": m, "tasks": ["train"], **VARIANTS[name][1]}
            for m in args.models if m in TRAIN_MODELS]


def plan(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The workers in the order they run: per model, today's code then the new code; the new
    code with its fold batch off (``--per-layer-folds``); the ``torch.compile`` rows; the eager
    norms' rows."""
    jobs = []
    for model in args.models:
        for impl in (i for i in IMPLS if i in getattr(args, "impls", IMPLS)):
            tasks = [t for t, models, table in (("train", TRAIN_MODELS, 1), ("export", EXPORT_MODELS, 2))
                     if model in models and table in args.tables]
            if tasks:
                jobs.append({"key": f"{impl}/{model}", "impl": impl, "model": model, "tasks": tasks})
    if 1 in args.tables:
        jobs += _variant_jobs(args, "per_layer_folds")
        compiled_impls = ("today", "new") if getattr(args, "compile_today", False) else ("new",)
        jobs += [{"key": f"{impl}+compile_{how}/{m}", "impl": impl, "model": m, "tasks": ["train"], "compile": how}
                 for how in args.compile for m in args.models if m in TRAIN_MODELS for impl in compiled_impls]
        jobs += _variant_jobs(args, "eager_norms")
    return jobs



def _configs(impl: str) -> dict[str, dict[str, Any]]:
    """The export configurations of an implementation (the worker drops the align ones where
    SearchConfig has no ``align``)."""
    return {"today": {}} if impl == "today" else {"align1": {"align": 1}, "align8": {"align": 8}}


def _missing(job: dict[str, Any], impls: dict[str, Any]) -> str | None:
    """Why a job cannot run at all (no snapshot, a module the model needs is absent), or None."""
    impl = impls[job["impl"]]
    if not impl["present"]:
        return f"no dmscale under {impl['src']} (make it: python -m bench.gpu_check --make-baseline COMMIT)"
    needs = SPECS[job["model"]].needs
    if needs and importlib.util.find_spec(needs) is None:
        return f"{needs} is not installed"
    return None


# ----------------------------------------------------------------------------- running a worker
def _spec(job: dict[str, Any], args: argparse.Namespace, impls: dict[str, Any], soft: float, out: Path
          ) -> dict[str, Any]:
    configs = _configs(job["impl"])
    return {"model": job["model"], "tasks": job["tasks"], "quick": args.quick, "device": args.device,
            "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "compile": job.get("compile"),
            "fuse_norms": job.get("fuse_norms"), "fold_batch": job.get("fold_batch"),
            "configs": configs, "deadline": soft, "out": str(out), "src": impls[job["impl"]]["src"],
            "threads": args.threads, "batch": args.batch, "export_device": args.export_device}


def _stop(proc: subprocess.Popen) -> None:
    """Stop a worker and whatever it started (torch.compile's compile workers)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()


def run_job(job: dict[str, Any], args: argparse.Namespace, impls: dict[str, Any], state: dict[str, Any],
            hard: float) -> None:
    """Run one worker, re-rendering the tables whenever its json changes; stopped at ``hard``."""
    wdir = args.out / "workers"
    wdir.mkdir(parents=True, exist_ok=True)
    stem = job["key"].replace("/", "__").replace("+", "_")
    out, log = wdir / f"{stem}.json", wdir / f"{stem}.log"
    out.unlink(missing_ok=True)
    spec_path = wdir / f"{stem}.spec.json"
    spec_path.write_text(json.dumps(_spec(job, args, impls, state["soft_deadline"], out), indent=1))
    env = {**os.environ, "PYTHONPATH": impls[job["impl"]]["src"], "PYTHONNOUSERSITE": "1"}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    t0, seen = time.time(), 0.0
    with open(log, "w") as handle:
        proc = subprocess.Popen([sys.executable, "-m", "bench.lib.gpu_check_lib", str(spec_path)],
                                cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while proc.poll() is None:
                if time.time() > hard:
                    state["notes"].append(f"{job['key']}: stopped at the time limit (budget + grace)")
                    break
                time.sleep(0.5)
                seen = _collect(job, out, state, args, seen)
        finally:  # also when this process is stopped (SIGTERM, Ctrl-C): no worker outlives it
            if proc.poll() is None:
                _stop(proc)
    _collect(job, out, state, args, -1.0)
    entry = state["jobs"].setdefault(job["key"], {"impl": job["impl"], "model": job["model"]})
    entry.update(returncode=proc.returncode, wall_s=round(time.time() - t0, 1))
    if proc.returncode:
        entry["log_tail"] = log.read_text(errors="replace")[-2000:]
        if "status" not in entry:  # it died before writing anything
            entry["error"] = f"the worker exited with {proc.returncode} before writing results"
    _save(state, args)


def _collect(job: dict[str, Any], out: Path, state: dict[str, Any], args: argparse.Namespace, seen: float) -> float:
    """Merge the worker's json into the state when it changed since ``seen`` (its mtime)."""
    try:
        mtime = out.stat().st_mtime
        if mtime == seen:
            return seen
        data = json.loads(out.read_text())
    except (OSError, ValueError):
        return seen
    state["jobs"][job["key"]] = {"impl": job["impl"], "model": job["model"], **data}
    _save(state, args)
    return mtime


def _save(state: dict[str, Any], args: argparse.Namespace) -> None:
    state["run"]["elapsed_s"] = round(time.time() - state["run"]["t0"], 1)
    for name, text in (("gpu_check.json", json.dumps(state, indent=1, default=str)), ("gpu_check.md", render(state))):
        tmp = args.out / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(args.out / name)


# ----------------------------------------------------------------------------- markdown
def _get(d: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _num(v: Any, fmt: str = "{:.1f}") -> str:
    return fmt.format(v) if isinstance(v, (int, float)) else "n/a"


def _why(job: dict[str, Any] | None, task: str) -> str:
    """n/a, skipped or error for a missing measurement (details in the notes)."""
    if job is None or "na" in job:
        return "n/a"
    t = job.get(task) or {}
    if "error" in t or "error" in job:
        return "error"
    if "skipped" in t or "skipped" in job:
        return "skipped"
    return "not reached" if job.get("status") == "running" else "n/a"


def _ratio(a: Any, b: Any) -> str:
    return f"{a / b:.2f}" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else "n/a"


def _train_row(model: str, label: str, job: dict[str, Any] | None) -> str:
    t = _get(job, "train") or {}
    p, d = t.get("plain") or {}, t.get("dms") or {}
    if not p and not d:
        why = _why(job, "train")
        return f"| {model} | {label} | {t.get('input', 'n/a')} | " + " | ".join([why] * 9) + " |"
    mem = (f"{_num(p.get('peak_gib'), '{:.2f}')} -> {_num(d.get('peak_gib'), '{:.2f}')}"
           if p.get("peak_gib") is not None else "n/a (CPU)")
    fused = t.get("fused_norms") or {}
    note = (" (masked norms compiled)" if fused.get("compiled") and not fused.get("failure") else
            f" (fused norms failed: {fused['failure'][:80]})" if fused.get("failure") else "")
    return (f"| {model} | {label}{note} | {t.get('input', '?')}, batch {t.get('batch', '?')} | {_num(p.get('median_ms'))} | "
            f"{_num(d.get('median_ms')) if d else _why(job, 'train')} | {_ratio(d.get('median_ms'), p.get('median_ms'))} | "
            f"{mem} | {_ratio(d.get('peak_gib'), p.get('peak_gib'))} | "
            f"{p.get('kernels', 'n/a')} -> {d.get('kernels', 'n/a')} | "
            f"{_ratio(d.get('kernels'), p.get('kernels'))} | {_busy(p)} -> {_busy(d)} | {_num(t.get('prepare_s'))} |")


def _busy(arm: dict[str, Any]) -> str:
    """The kernels' device time in the profiled step (a GPU only), ms."""
    return _num(arm.get("kernel_ms")) if arm.get("kernel_ms") is not None else "n/a"


def _label(state: dict[str, Any], impl: str, how: str | None = None) -> str:
    c = _get(state, "impls", impl, "commit") or "?"
    return f"{'today' if impl == 'today' else 'new'}{' + ' + COMPILE_LABELS[how] if how else ''} (`{c}`)"


def table1(state: dict[str, Any]) -> list[str]:
    jobs = state["jobs"]
    counted = sorted({str(_get(j, "train", a, "counted")) for j in jobs.values() for a in ("plain", "dms")
                      if _get(j, "train", a, "counted")}) or ["kernels"]
    lines = ["## Table 1: training step, plain vs DMS (bf16 autocast)", "",
             f"Median of the timed steps; peak = `torch.cuda.max_memory_allocated` over each arm's steps (weights "
             f"included); per step: {', '.join(counted)} of one profiled step; kernel ms: their device time in "
             "that step (a step whose wall time is far above it is bound by the host, not the GPU).", "",
             "| model | code | input | plain ms | DMS ms | DMS / plain | peak GiB plain -> DMS | peak ratio "
             "| per step plain -> DMS | ratio | kernel ms plain -> DMS | prepare s |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for model in TRAIN_MODELS:
        if model not in state["run"]["models"]:
            continue
        lines.append(_train_row(model, _label(state, "today"), jobs.get(f"today/{model}")))
        lines.append(_train_row(model, _label(state, "new"), jobs.get(f"new/{model}")))
        for how in state["run"].get("compile") or []:
            if state["run"].get("compile_today"):
                lines.append(_train_row(model, _label(state, "today", how), jobs.get(f"today+compile_{how}/{model}")))
            lines.append(_train_row(model, _label(state, "new", how), jobs.get(f"new+compile_{how}/{model}")))
        for name, (label, _) in VARIANTS.items():
            if state["run"].get(name):
                lines.append(_train_row(model, _label(state, "new").replace("new", f"new, {label}", 1),
                                        jobs.get(f"new+{name}/{model}")))
    return lines


def _export_cell(job: dict[str, Any] | None, label: str, batch: str) -> tuple[str, str, str, str]:
    """(ms and x original, MACs ratio, widths multiple of 8, fused attention) of one export."""
    e = _get(job, "export", "exports", label)
    if e is None:
        na = _why(job, "export")
        return na, na, na, na
    if "error" in e or "skipped" in e or "na" in e:
        w = "error" if "error" in e else "skipped" if "skipped" in e else "n/a"
        return w, w, w, w
    lat = _get(job, "export", "latency", batch) or {}
    ms, orig = _get(lat, label, "median_ms"), _get(lat, "original", "median_ms")
    cell = f"{_num(ms, '{:.2f}')} ({_ratio(ms, orig)}x)" if ms is not None else "n/a"
    cell += " †" if e.get("note") else ""
    fused = e.get("fused_attn")
    return (cell, _num(e.get("macs_ratio"), "{:.3f}"), f"{e.get('widths_mult8')}/{e.get('widths')}",
            f"{fused[0]}/{fused[1]}" if fused else "-")


def _export_rows(state: dict[str, Any], model: str) -> list[str]:
    today, new = state["jobs"].get(f"today/{model}"), state["jobs"].get(f"new/{model}")
    batches = list(dict.fromkeys(list(_get(today, "export", "latency") or {}) + list(_get(new, "export", "latency") or {})))
    rows = []
    for b in batches or ["-"]:
        cells = [_export_cell(today, "today", b), _export_cell(new, "align1", b), _export_cell(new, "align8", b)]
        orig = " / ".join(_num(_get(j, "export", "latency", b, "original", "median_ms"), "{:.2f}") for j in (today, new))
        rows.append(f"| {model} | {b} | {orig} | " + " | ".join(c[0] for c in cells) + " | "
                    + " | ".join(" / ".join(c[i] for c in cells) for i in (1, 2, 3)) + " |")
    return rows


def table2(state: dict[str, Any]) -> list[str]:
    lines = ["## Table 2: export latency (bf16 weights, eval, inference mode)", "",
             "Exports from `randomize_importance(0); meet_target(); export()` at the MACs target (0.5, 0.8 for "
             f"the LLM), made on {state['run'].get('export_device', '?')}; ms = median forward on "
             f"{state['run']['device']}, (x orig) = over the original timed in the same process, interleaved. "
             "Original ms: in today's process / in the new code's. Widths %8: searched widths whose kept size is a "
             "multiple of 8. fused attn: attention modules of the export with `fused_attn` True / all.", "",
             "| model | batch | original ms | today ms | new align 1 ms | new align 8 ms | MACs ratio today / a1 / a8 "
             "| widths %8 today / a1 / a8 | fused attn today / a1 / a8 |",
             "|---|---:|---:|---:|---:|---:|---|---|---|"]
    for model in EXPORT_MODELS:
        if model in state["run"]["models"]:
            lines += _export_rows(state, model)
    return lines + ["", "Seconds to prepare + solve (`meet_target`) + export: " + (", ".join(_export_times(state)) or "none")]


def _export_times(state: dict[str, Any]) -> list[str]:
    out = []
    for key, job in state["jobs"].items():
        for label, e in (_get(job, "export", "exports") or {}).items():
            if "prepare_s" in e:
                out.append(f"{key.split('/')[1]} {label} {e['prepare_s']:.1f} + {e['meet_target_s']:.1f} + "
                           f"{e['export_s']:.1f}")
    return out


def _header(state: dict[str, Any]) -> list[str]:
    run = state["run"]
    env = max((j["env"] for j in state["jobs"].values() if j.get("env")), key=len, default={})
    impls = [f"- {k}: commit `{v['commit']}`, src digest `{v['digest']}`, `{v['src']}`"
             + ("" if v["present"] else " (missing)") for k, v in state["impls"].items()]
    align = {k: _get(j, "env", "align_option") for k, j in state["jobs"].items()}
    return [f"# GPU check: today's code vs the new code{' (quick smoke run)' if run['quick'] else ''}", "",
            f"- command: `{run['command']}`; {run['date']}; {run['elapsed_s']} s of a {run['budget_s']} s budget"
            f"{' (running)' if not run.get('finished') else ''}",
            f"- device: {env.get('gpu', run['device'])}"
            + (f" ({env.get('gpu_mem_gib')} GiB, sm {env.get('capability')}, cuDNN {env.get('cudnn')})"
               if env.get("gpu") else "")
            + f"; torch {env.get('torch', '?')}, CUDA {env.get('cuda')}, Python {env.get('python', '?')}"
            + "".join(f", {m} {env[m]}" for m in ("timm", "transformers", "ultralytics") if m in env)
            + f"; host {run['host']}",
            *impls,
            f"- SearchConfig has `align`: {', '.join(f'{k} {v}' for k, v in align.items() if k.startswith('new/'))}",
            ""]


def _notes(state: dict[str, Any]) -> list[str]:
    notes = [f"- {n}" for n in state["notes"]]
    for key, job in state["jobs"].items():
        if "error" in job:
            notes.append(f"- {key}: {job['error']}")
        if job.get("status") not in (None, "done", "running"):
            notes.append(f"- {key}: {job['status']}")
        for task in ("train", "export"):
            t = job.get(task) or {}
            for where, d in [(task, t)] + [(f"{task} {k}", v) for k, v in (t.get("exports") or {}).items()]:
                if "error" in d:
                    notes.append(f"- {key} {where}: error `{d['error'].splitlines()[0]}`")
                if "skipped" in d:
                    notes.append(f"- {key} {where}: skipped ({d['skipped']})")
                if "na" in d:
                    notes.append(f"- {key} {where}: n/a ({d['na']})")
                if "note" in d:
                    notes.append(f"- † {key} {where}: {d['note']}")
        if job.get("returncode"):
            notes.append(f"- {key}: worker exit code {job['returncode']} (log in workers/)")
    walls = [f"{k} {j['wall_s']}" for k, j in state["jobs"].items() if "wall_s" in j]
    return ["## Notes", "", *(notes or ["- none"]), "", "Seconds per worker: " + (", ".join(walls) or "none")]


def render(state: dict[str, Any]) -> str:
    """The markdown of ``gpu_check.md`` from the state (whatever part of it is measured)."""
    return "\n".join(_header(state) + table1(state) + [""] + table2(state) + [""] + _notes(state)) + "\n"


# ----------------------------------------------------------------------------- main
def _gpu_line() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return f"{platform.node()}, {os.cpu_count()} CPUs" + (f", nvidia-smi: {out}" if out else "")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="output directory (default bench/runs/gpu_check[/quick])")
    ap.add_argument("--baseline-src", type=Path, default=BASELINE, help="today's code: a src with dmscale in it")
    ap.add_argument("--new-src", type=Path, default=ROOT / "src", help="the new code: a src with dmscale in it")
    ap.add_argument("--new-commit", help="the new code's commit, where git cannot tell (no .git on the machine)")
    ap.add_argument("--make-baseline", metavar="COMMIT", help="snapshot COMMIT's src/dmscale under --baseline-src's parent, and exit")
    ap.add_argument("--budget-s", type=float, default=340.0, help="no measurement starts after this many seconds")
    ap.add_argument("--grace-s", type=float, default=30.0, help="a running worker is stopped this long after the budget")
    ap.add_argument("--models", nargs="+", choices=EXPORT_MODELS, default=list(EXPORT_MODELS))
    ap.add_argument("--tables", nargs="+", type=int, choices=(1, 2), default=[1, 2])
    ap.add_argument("--compile", nargs="*", choices=tuple(COMPILE_LABELS), default=None,
                    help="add rows of the new code under torch.compile to table 1: model.forward compiled (dmscale's "
                         "own --compile), torch.compile(model), module_cudagraphs: with mode='reduce-overhead' "
                         "(CUDA graphs); alone: forward and module")
    ap.add_argument("--eager-norms", action="store_true",
                    help="add rows of the new code with SearchConfig(fuse_norms=False) to table 1 (what fusing the "
                         "masked norms, the default on a GPU, gains)")
    ap.add_argument("--per-layer-folds", action="store_true",
                    help="add rows of the new code with each layer folding its masks on its own "
                         "(dmscale.core.fold_batch.ENABLED = False) to table 1 (what the eager fold batch gains)")
    ap.add_argument("--device", help="default: cuda when available, else cpu (cpu with --quick)")
    ap.add_argument("--steps", type=int, default=10, help="timed training steps per arm")
    ap.add_argument("--warmup", type=int, default=3, help="warm-up training steps per arm")
    ap.add_argument("--rounds", type=int, default=20, help="timed forwards per net and batch in table 2")
    ap.add_argument("--export-device", default="cpu",
                    help="where table 2 prepares, solves and exports (default cpu; the latency is timed on --device)")
    ap.add_argument("--batch", type=int, help="the training batch of every model (default: 64, 16 for the LLM; 2 quick)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads in the workers (0: torch's default)")
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny models, batch 2, CPU, 2 steps and rounds")
    ap.add_argument("--compile-today", action="store_true",
                    help="the --compile rows for today's code too (a snapshot that compiles, e.g. --make-baseline "
                         "3c16afa: the new code's compiled step against an earlier one's)")
    ap.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS),
                    help="the implementations of the plain rows (default both; '--impls new' with --compile: the "
                         "compiled rows beside the new code's eager ones, without today's)")
    args = ap.parse_args(argv)
    args.compile = [] if args.compile is None else args.compile or ["forward", "module"]
    if args.quick:
        args.steps, args.warmup, args.rounds = 2, 1, 2
        args.device, args.threads = args.device or "cpu", args.threads or 1
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.out = args.out or RUNS / "gpu_check" / ("quick" if args.quick else "")
    args.models = list(dict.fromkeys(args.models))  # the order given is the order measured
    return args


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through run_job's finally: the worker is stopped


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    if args.make_baseline:
        full = make_baseline(args.make_baseline, args.baseline_src.resolve())
        print(f"today's code: {full} under {args.baseline_src}")
        return
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    impls = {"today": _impl_info(args.baseline_src.resolve(), None),
             "new": _impl_info(args.new_src.resolve(), args.new_commit)}
    state: dict[str, Any] = {
        "run": {"command": command_line("-m bench.gpu_check", argv), "date": datetime.datetime.now().isoformat(" ", "seconds"),
                "t0": t0, "budget_s": args.budget_s, "quick": args.quick, "device": args.device, "host": _gpu_line(),
                "models": args.models, "tables": args.tables, "compile": args.compile, "steps": args.steps,
                "eager_norms": args.eager_norms, "per_layer_folds": args.per_layer_folds,
                "compile_today": args.compile_today,
                "warmup": args.warmup, "rounds": args.rounds, "export_device": args.export_device},
        "impls": impls, "jobs": {}, "notes": [], "soft_deadline": t0 + args.budget_s}
    hard = t0 + args.budget_s + args.grace_s
    for job in plan(args):
        why = _missing(job, impls)
        kind = "na"
        if why is None and time.time() >= state["soft_deadline"]:
            why, kind = "time budget spent before it started", "skipped"
        if why:
            state["jobs"][job["key"]] = {"impl": job["impl"], "model": job["model"], kind: why}
            state["notes"].append(f"{job['key']}: {why}")
            _save(state, args)
            continue
        try:
            run_job(job, args, impls, state, hard)
        except Exception as e:  # noqa: BLE001 - the next rows still run
            state["notes"].append(f"{job['key']}: {type(e).__name__}: {e}")
        print(f"{job['key']}: done at {time.time() - t0:.0f} s", flush=True)
    state["run"]["finished"] = True
    _save(state, args)
    print(f"wrote {args.out / 'gpu_check.md'} and {args.out / 'gpu_check.json'}")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _terminate)
    main()
