"""Run the coverage suite (issue 8) and write docs/coverage.md.

Each model is classified in its own child process with a time limit (see
``tests/coverage_suite.py`` for the checks and the verdicts). Results are cached per model in
``docs/coverage_results.json``: a run re-classifies only the models it is asked for (all of the
selection unless ``--resume``, which skips models already in the cache), and the markdown is
always regenerated from the whole cache.

Examples::

    python scripts/coverage.py                         # the whole sweep, 2 jobs
    python scripts/coverage.py --only hf --jobs 2      # one registry
    python scripts/coverage.py --models gemma,yolov8n  # named models (any registry)
    python scripts/coverage.py --resume                # only models not in the cache yet
    python scripts/coverage.py --report                # regenerate docs/coverage.md only
    python scripts/coverage.py --regen timm            # re-pick the timm models (tests/coverage_lists.py)
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures as cf
import json
import os
import platform
import pprint
import re
import subprocess
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "src")]

import torch  # noqa: E402

import coverage_suite as cs  # noqa: E402

CACHE = os.path.join(ROOT, "docs", "coverage_results.json")
REPORT = os.path.join(ROOT, "docs", "coverage.md")
LISTS = os.path.join(ROOT, "tests", "coverage_lists.py")
HEAVY_PARAMS = cs.HEAVY_PARAMS


# --------------------------------------------------------------------------- cache
def load_cache() -> dict[str, Any]:
    if os.path.exists(CACHE):
        with open(CACHE) as f:
            return json.load(f)
    return {"meta": {}, "results": {}}


def save_cache(cache: dict[str, Any]) -> None:
    tmp = CACHE + ".tmp"
    with open(tmp, "w") as f:
        json.dump(cache, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, CACHE)


def _key(registry: str, name: str) -> str:
    return f"{registry}/{name}"


# --------------------------------------------------------------------------- sweep
def select(only: list[str] | None, models: list[str] | None) -> list[cs.Entry]:
    chosen = []
    for reg in cs.REGISTRIES:
        if only and reg not in only:
            continue
        try:
            es = cs.entries(reg)
        except ImportError as err:
            print(f"[{reg}] skipped: {err}", flush=True)
            continue
        chosen += [e for e in es if not models or e.name in models]
    if models:
        missing = set(models) - {e.name for e in chosen}
        if missing:
            raise SystemExit(f"unknown models: {sorted(missing)}")
    return chosen


def _heavy(entry: cs.Entry) -> bool:
    return entry.note == "heavy"


def sweep(selection: list[cs.Entry], jobs: int, timeout: float | None, cache: dict[str, Any]) -> float:
    start = time.perf_counter()
    normal = [e for e in selection if not _heavy(e)]
    heavy = [e for e in selection if _heavy(e)]
    done = 0
    total = len(selection)

    def record(entry: cs.Entry, v: cs.Verdict) -> None:
        nonlocal done
        done += 1
        cache["results"][_key(entry.registry, entry.name)] = v.to_json()
        save_cache(cache)
        extra = v.detail[:160] if v.verdict != "exact" else f"macs x{v.macs_ratio}"
        print(f"[{done}/{total}] {entry.registry}/{entry.name}: {v.verdict} ({v.seconds:.1f} s) {extra}",
              flush=True)

    for group, n in ((normal, jobs), (heavy, 1)):
        if not group:
            continue
        with cf.ThreadPoolExecutor(max_workers=n) as pool:
            futures = {pool.submit(cs.run_isolated, e.registry, e.name, timeout or e.timeout): e for e in group}
            for fut in cf.as_completed(futures):
                record(futures[fut], fut.result())
    return time.perf_counter() - start


# --------------------------------------------------------------------------- report
def _git_commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def cause(v: cs.Verdict) -> str:
    """What a non-exact verdict has in common with others: the verdict and the error with
    quoted names, numbers and shapes left out (a missing handler keeps its class name), or
    the list of failed checks."""
    d = v.detail
    if v.verdict == "wrong":
        checks = []
        for part in d.split("; "):
            part = part.split(": ")[0] if not part.startswith("export raised") else part
            part = re.sub(r"\s*\(diff [^)]*\)", "", part)
            part = re.sub(r"-?\d[\d.e+-]*", "N", part)
            if part.startswith("then "):
                part = "then " + re.sub(r"'[^']*'", "'...'", part[5:])
            checks.append(part)
        return "wrong: " + "; ".join(checks)
    m = re.search(r"has weights \[.*?\] but dmscale has no handler for (\w+)", d)
    if m:
        return f"{v.verdict}: UnsupportedLayerError: no handler for {m.group(1)}"
    d = re.sub(r"'[^']*'", "'...'", d)
    d = re.sub(r"\([^()]*\)", lambda mm: mm.group(0) if re.fullmatch(r"\(\w+\)", mm.group(0)) else "(...)", d)
    d = re.sub(r"\d+", "N", d)
    d = re.sub(r"\[raised at .*?\]|raised at [^;\]]*", "", d)
    return f"{v.verdict}: {d.strip()}"[:300]


def write_report(cache: dict[str, Any]) -> None:
    results = [cs.Verdict.from_json(v) for v in cache["results"].values()]
    meta = cache.get("meta", {})
    order = {r: i for i, r in enumerate(cs.REGISTRIES)}
    results.sort(key=lambda v: (order.get(v.registry, 99), v.name))
    lines = ["# Coverage over real model registries (issue 8)", ""]
    lines += [
        f"- command: `{meta.get('command', 'python scripts/coverage.py')}`",
        f"- commit: `{meta.get('commit', '?')}` (the last sweep's; per-model results are cached in "
        f"`docs/coverage_results.json`, each with the commit it ran on)",
        f"- machine: {meta.get('machine', '?')}",
        f"- wall time of the last sweep: {meta.get('wall_s', '?')} s ({meta.get('jobs', '?')} jobs)",
        "",
        "Verdicts (see `tests/coverage_suite.py`): **exact** = open masks reproduce the model, the "
        "export of a random hard structure equals the hardened supernet, the cost at hard masks is the "
        "exact MACs and parameter count of the export, and the export is smaller; **refused** = "
        "`prepare` raised a `DMScaleError`; **wrong** = a check failed (or `export` raised a "
        "`VerificationError`); **crash** = any other exception; **timeout** = over the per-model limit; "
        f"**skipped** = the model does not build or run here without dmscale (not counted). "
        f"Tolerance: max abs diff <= {cs.TOL:g} * (1 + max abs of the reference), per output tensor. "
        "Config: `SearchConfig(resource='macs', target=1.0)`, random structure seed "
        f"{cs.STRUCTURE_SEED}, eval mode, BatchNorm statistics randomised.",
        "",
        "## Summary",
        "",
        "| registry | models | " + " | ".join(cs.VERDICTS[:-1]) + " | skipped | % exact |",
        "| --- | ---: | " + " | ".join("---:" for _ in cs.VERDICTS) + " | ---: |",
    ]
    regs = [r for r in cs.REGISTRIES if any(v.registry == r for v in results)]
    for reg in regs + ["all"]:
        vs = [v for v in results if reg == "all" or v.registry == reg]
        c = collections.Counter(v.verdict for v in vs)
        counted = len(vs) - c["skipped"]
        pct = 100.0 * c["exact"] / counted if counted else 0.0
        name = f"**{reg}**" if reg == "all" else reg
        lines.append(f"| {name} | {counted} | " + " | ".join(str(c[k]) for k in cs.VERDICTS)
                     + f" | {pct:.1f} |")
    groups: dict[str, list[cs.Verdict]] = collections.defaultdict(list)
    for v in results:
        if v.verdict not in ("exact", "skipped"):
            groups[cause(v)].append(v)
    if groups:
        lines += ["", "## Non-exact models by cause", "",
                  "Most common first; the cause is the error with names and numbers left out, or the "
                  "checks that failed.", "",
                  "| cause | n | models |", "| --- | ---: | --- |"]
        for c, vs in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            names = ", ".join(f"{v.registry}/{v.name}" for v in vs)
            lines.append(f"| {_cell(c)} | {len(vs)} | {names} |")
    lines += ["", "## Models", "",
              "| registry | model | verdict | error, or MACs / params ratio of the export | seconds |",
              "| --- | --- | --- | --- | ---: |"]
    for v in results:
        if v.verdict == "exact":
            what = f"MACs x{v.macs_ratio}, params x{v.params_ratio}"
        else:
            what = _cell(v.detail)
        lines.append(f"| {v.registry} | {v.name} | {v.verdict} | {what} | {v.seconds:.1f} |")
    with open(REPORT, "w") as f:
        f.write("\n".join(lines) + "\n")


# --------------------------------------------------------------------------- model lists
def _probe_forward(build, size: int) -> tuple[float, int]:
    """(seconds to build and run the model once, its parameter count)."""
    start = time.perf_counter()
    torch.manual_seed(0)
    model = build().eval()
    with torch.no_grad():
        model(torch.randn(2, 3, size, size))
    return time.perf_counter() - start, sum(p.numel() for p in model.parameters())


def _timeout_for(probe_s: float, params: int) -> float:
    # the checks run about ten forwards, a trace, two counts and a deepcopy
    if params > HEAVY_PARAMS or probe_s > 4:
        return 600.0
    if probe_s > 1:
        return 300.0
    return cs.DEFAULT_TIMEOUT


def regen_timm(families_only: set[str] | None = None) -> list[dict[str, Any]]:
    """One model per timm family (registry module): the smallest by parameter count (built on
    the meta device) that builds and runs on CPU at the smallest of a few input sizes.

    Each candidate is built once at its default size and run at growing inputs; when the
    smallest input it runs at is above 32, smaller ``img_size`` builds are tried too (ViTs,
    window attention: models whose input size is fixed at build time)."""
    cs._vision_imports()
    import timm
    from timm.models._registry import model_entrypoint

    sizes = (32, 64, 96, 128, 160, 224, 256)
    families: dict[str, list[str]] = collections.defaultdict(list)
    for n in timm.list_models():
        families[model_entrypoint(n).__module__.rsplit(".", 1)[-1]].append(n)
    chosen = []
    for fam in sorted(families):
        if families_only is not None and fam not in families_only:
            continue
        sized = []
        for n in families[fam]:
            try:
                with torch.device("meta"):
                    m = timm.create_model(n, pretrained=False, num_classes=10)
                sized.append((sum(p.numel() for p in m.parameters()), n))
            except Exception:  # noqa: BLE001
                continue
        sized.sort()
        pick = None
        for params, n in sized[:4]:
            try:
                torch.manual_seed(0)
                start = time.perf_counter()
                model = timm.create_model(n, pretrained=False, num_classes=10).eval()
                build_s = time.perf_counter() - start
            except Exception:  # noqa: BLE001
                continue
            native = None
            for size in sizes:
                try:
                    start = time.perf_counter()
                    with torch.no_grad():
                        model(torch.randn(2, 3, size, size))
                    native = (size, build_s + time.perf_counter() - start)
                    break
                except Exception:  # noqa: BLE001
                    continue
            for size in [s for s in sizes if native is None or s < native[0]]:
                try:
                    t, _ = _probe_forward(cs._timm_builder(n, size), size)
                except TypeError:
                    break  # no img_size argument
                except Exception:  # noqa: BLE001
                    continue
                pick = dict(name=n, family=fam, input=size, img_size=size, params=params,
                            probe_s=round(t, 2), timeout=_timeout_for(t, params))
                break
            if pick is None and native is not None:
                pick = dict(name=n, family=fam, input=native[0], img_size=None, params=params,
                            probe_s=round(native[1], 2), timeout=_timeout_for(native[1], params))
            if pick:
                break
        print(f"timm {fam}: {pick}", flush=True)
        if pick:
            chosen.append(pick)
    return chosen


def regen_torchvision() -> list[dict[str, Any]]:
    """Every torchvision classification model at the smallest of a few input sizes."""
    cs._vision_imports()
    import torchvision

    chosen = []
    for n in torchvision.models.list_models(module=torchvision.models):
        pick = None
        for size in ((28,) if n.startswith("vit_") else ()) + (32, 64, 96, 128, 160, 224):
            kwargs: dict[str, Any] = {"num_classes": 10}
            if n.startswith("vit_"):  # image_size: a multiple of the patch size
                patch = int(n.rsplit("_", 1)[-1])
                if size % patch:
                    continue
                kwargs["image_size"] = size
            try:
                t, params = _probe_forward(cs._tv_builder(n, kwargs), size)
            except Exception:  # noqa: BLE001
                continue
            pick = dict(name=n, input=size, kwargs=kwargs, params=params, probe_s=round(t, 2),
                        timeout=_timeout_for(t, params), heavy=params > HEAVY_PARAMS)
            break
        print(f"torchvision {n}: {pick}", flush=True)
        if pick:
            chosen.append(pick)
    return chosen


def write_lists(timm_list: list | None, tv_list: list | None) -> None:
    old: dict[str, Any] = {}
    if os.path.exists(LISTS):
        with open(LISTS) as f:
            exec(compile(f.read(), LISTS, "exec"), old)  # noqa: S102  (our own generated file)
    timm_list = timm_list if timm_list is not None else old.get("TIMM", [])
    tv_list = tv_list if tv_list is not None else old.get("TORCHVISION", [])
    with open(LISTS, "w") as f:
        f.write('"""Models of the coverage suite, generated by `python scripts/coverage.py --regen timm|torchvision`.\n\n'
                "TIMM: one model per timm family (registry module), the smallest by parameter count that\n"
                "builds and runs on CPU at the smallest input size tried (32, 64, ... 256); ``img_size`` is\n"
                "passed to ``timm.create_model`` when not None. TORCHVISION: every classification model\n"
                "of ``torchvision.models.list_models`` at the smallest input it accepts. ``timeout`` is the\n"
                "per-model limit in seconds (from the probe's build + forward time), ``probe_s`` that time.\n"
                'Edit by hand only to override a choice; regenerating overwrites the file.\n"""\n\n')
        f.write("TIMM = " + pprint.pformat(timm_list, width=110, sort_dicts=False) + "\n\n")
        f.write("TORCHVISION = " + pprint.pformat(tv_list, width=110, sort_dicts=False) + "\n")


# --------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", help="comma-separated registries: " + ",".join(cs.REGISTRIES))
    p.add_argument("--models", help="comma-separated model names")
    p.add_argument("--jobs", type=int, default=2, help="child processes at once (default 2)")
    p.add_argument("--timeout", type=float, help="per-model limit in s (default: each model's own)")
    p.add_argument("--resume", action="store_true", help="skip models already in the cache")
    p.add_argument("--report", action="store_true", help="only regenerate docs/coverage.md from the cache")
    p.add_argument("--regen", help="re-pick the model lists: timm, torchvision or timm,torchvision")
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    if args.regen:
        which = args.regen.split(",")
        write_lists(regen_timm() if "timm" in which else None,
                    regen_torchvision() if "torchvision" in which else None)
        print(f"wrote {os.path.relpath(LISTS, ROOT)}")
        return 0

    cache = load_cache()
    if not args.report:
        only = args.only.split(",") if args.only else None
        models = args.models.split(",") if args.models else None
        selection = select(only, models)
        if args.resume:
            selection = [e for e in selection if _key(e.registry, e.name) not in cache["results"]]
        print(f"classifying {len(selection)} models with {args.jobs} jobs", flush=True)
        wall = sweep(selection, args.jobs, args.timeout, cache)
        commit = _git_commit()
        for e in selection:
            cache["results"][_key(e.registry, e.name)]["commit"] = commit
        cache["meta"] = dict(
            command="python scripts/coverage.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            commit=commit, wall_s=round(wall), jobs=args.jobs,
            machine=f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), "
                    f"torch {torch.__version__}, 1 torch thread per model, Python {platform.python_version()}",
        )
        save_cache(cache)
        print(f"done in {wall:.0f} s", flush=True)
    write_report(cache)
    print(f"wrote {os.path.relpath(REPORT, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
