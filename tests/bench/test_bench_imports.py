"""The contract of ``bench/``: what the benchmark scripts may import from the package, how long
a bench module may be, and where the helpers they share live.

A benchmark reads the package the way a user would (``import dmscale as dms`` and the public
namespaces) or through one of the internal modules listed in :data:`INTERNAL`, each with the
reason it is needed; never a private name (``_x``) and never a private module. A new internal
import is a decision: it goes into :data:`INTERNAL` with its reason, or becomes public API.

``bench`` is a package: ``bench/`` holds the scripts (one per table, run as ``python -m
bench.NAME`` from the repository root), ``bench/lib/`` the code several of them share, imported
as ``from bench.lib import benchlib``. No file of ``bench/`` or ``tests/bench/`` edits
``sys.path``; no script imports another (import-linter's ``bench-layers`` contract, run by
tests/test_layers.py, checks the imports inside functions too).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
LIB = BENCH / "lib"  # the shared helpers
MAX_LINES = 600  # as for src/ (tests/test_layers.py): over it, split by job

PUBLIC = {"dmscale", "dmscale.deploy", "dmscale.distributed", "dmscale.errors"}

INTERNAL: dict[str, str] = {
    "dmscale.config.run_config": "RunConfig: the CLI's own configuration, to run a pipeline in-process",
    "dmscale.run.pipeline": "Pipeline: the CLI's pipelines, instrumented phase by phase (traced searches)",
    "dmscale.run.supernets": "the pipeline's pretrained supernet, for the LLM tables' own finetune loop",
    "dmscale.run.training": "the retrain phase's optimiser, schedule and step loop, reused by the LLM tables' baselines",
    "dmscale.run.saved_runs": "a run directory's structure, teacher and config, as eval/export read them",
    "dmscale.tasks.registry": "the task's model and data, built as the run builds them",
    "dmscale.tasks.text": "the text task's token stream (equal batches for the LLM baselines)",
    "dmscale.tasks.models": "the built-in ResNet-20 the tables prune",
    "dmscale.tasks.image": "the image task's data (the peers' and FastNAS's loaders)",
    "dmscale.tasks.hf_model": "the Hugging Face causal-LM wrapper the LLM baselines prune",
    "dmscale.engine.perplexity": "llama.cpp's perplexity protocol in transformers, beside llama-perplexity (table 7)",
    "dmscale.tasks.detect": "the detection task (YOLO table 11)",
    "dmscale.integrations.ultralytics": "YOLO through the Ultralytics integration (table 11)",
    "dmscale.export.files": "saving and loading exported models (FSDP and GPU checks)",
    "dmscale.export.deploy": "ONNX / pt2 deployment (deployment latency)",
    "dmscale.cost.latency_profile": "the per-layer latency profile (latency staircase)",
    "dmscale.cost.timing": "the latency timer every latency table uses",
    "dmscale.cost.latency": "the fitted latency model (latency fit)",
    "dmscale.core.topk": "the top-k operator of Eq. 2-4 (gate baselines)",
    "dmscale.core.values": "option value parsing shared with the CLI",
    "dmscale.core.ratios": "the ratio parametrisation (schedule ablation)",
    "dmscale.core.distributed": "process-group helpers (FSDP check)",
    "dmscale.core.fold_batch": "the folded-batch step, timed against the plain one (host time, GPU check)",
    "dmscale.core.fused_norms": "fused norms, timed on the GPU (GPU check)",
    "dmscale.engine.fsdp": "FSDP2 sharding (FSDP check)",
    "dmscale.data": "the bundled datasets (MNIST detection)",
    "dmscale.data.text_files": "reading the text corpus (loader throughput)",
    "dmscale.data.images": "the image-folder loader (loader throughput)",
    "dmscale.trace.handlers.base": "a layer's handler, to prune one layer (latency staircase)",
    "dmscale.search.search_trace": "a search run's trace, read per dimension (issue 56's diagnosis)",
    "dmscale.run.report_plots": "the report's trace plot, drawn for the diagnosis table",
}


def dmscale_imports(source: str) -> list[tuple[int, str, list[str]]]:
    """Every ``dmscale`` import in ``source``, anywhere in it: (line, module, names imported).
    ``from dmscale.core import fold_batch`` counts as the module ``dmscale.core.fold_batch``
    when that is a module of the package (it is listed as such in :data:`INTERNAL`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names if a.name.split(".")[0] == "dmscale"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "dmscale":
            names = [a.name for a in node.names]
            subs = [f"{node.module}.{n}" for n in names if f"{node.module}.{n}" in INTERNAL]
            found += [(node.lineno, s, []) for s in subs]
            rest = [n for n in names if f"{node.module}.{n}" not in INTERNAL]
            if rest or not subs:
                found.append((node.lineno, node.module, rest))
    return found


def violations(source: str, where: str) -> list[str]:
    """What breaks the contract in ``source``: a module neither public nor listed, a private
    module, or a private name."""
    out = []
    for line, module, names in dmscale_imports(source):
        if any(part.startswith("_") for part in module.split(".")):
            out.append(f"{where}:{line}: imports the private module {module}")
        elif module not in PUBLIC and module not in INTERNAL:
            out.append(f"{where}:{line}: imports {module}, neither public nor listed in INTERNAL "
                       "(add it there with the reason, or use the public API)")
        out += [f"{where}:{line}: imports the private name {module}.{n}" for n in names if n.startswith("_")]
    return out


def _bench_files() -> list[Path]:
    return sorted(p for p in BENCH.rglob("*.py") if "__pycache__" not in p.parts and "runs" not in p.parts)


def test_bench_imports_only_the_public_api_or_listed_modules():
    found = [v for p in _bench_files() for v in violations(p.read_text(encoding="utf-8"),
                                                            str(p.relative_to(ROOT)))]
    assert not found, "\n".join(found)


def test_every_listed_internal_module_exists_and_is_used():
    import importlib

    used = {m for p in _bench_files() for _, m, _ in dmscale_imports(p.read_text(encoding="utf-8"))}
    for module in INTERNAL:
        importlib.import_module(module)
    assert not set(INTERNAL) - used, f"listed but no longer imported by bench/: {sorted(set(INTERNAL) - used)}"


def test_no_bench_module_over_the_limit():
    long = {str(p.relative_to(ROOT)): n for p in _bench_files()
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"bench modules over {MAX_LINES} lines (split them by job): {long}"


def test_bench_is_a_package_that_never_edits_sys_path():
    """Every folder of bench/ with code is a package; neither bench/ nor its tests put a folder
    on ``sys.path`` (the scripts run as ``python -m bench.NAME``; the tests import ``bench``)."""
    assert (BENCH / "__init__.py").is_file() and (LIB / "__init__.py").is_file()
    files = _bench_files() + sorted((ROOT / "tests" / "bench").glob("*.py"))
    edits = [f"{p.relative_to(ROOT)}:{n}" for p in files if p.name != "conftest.py"
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if re.search(r"sys\.path\.(insert|append)\(", line) and "re.search" not in line]
    assert not edits, f"sys.path edited (import bench.lib.X instead): {edits}"


def test_every_script_runs_as_a_module_and_is_listed_in_the_layers_contract():
    """A script's docstring runs it as ``python -m bench.NAME``; each script is a layer of the contract."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layers,) = [c for c in config["contracts"] if c["id"] == "bench-layers"]
    scripts = {p.stem for p in BENCH.glob("*.py") if not p.stem.startswith("__")}
    assert {n.strip() for n in layers["layers"][1].split("|")} == scripts
    stale = [p.name for p in sorted(BENCH.glob("*.py"))
             if "python bench/" in (ast.get_docstring(ast.parse(p.read_text(encoding="utf-8"))) or "")]
    assert not stale, f"usage lines that still run a file (python -m bench.NAME): {stale}"


@pytest.mark.parametrize("source, expected", [
    ("from dmscale.cost.latency_profile import _with_channels", "private name"),
    ("def f():\n    from dmscale.core._compat import ensure_torchvision", "private module"),
    ("import dmscale.search.solver", "neither public nor listed"),
    ("from dmscale.search import solver", "neither public nor listed"),
])
def test_the_contract_catches_a_violation(source, expected):
    found = violations(source, "x.py")
    assert found and expected in found[0], found


def test_the_contract_passes_public_and_listed_imports():
    assert violations("import dmscale as dms\nfrom dmscale.errors import ConfigError\n"
                      "from dmscale.core import fold_batch\nfrom dmscale.run.pipeline import Pipeline", "x.py") == []
