"""The package's layers hold: ``lint-imports`` keeps every contract of pyproject.toml, the
contracts name every layer, an upward import is reported, no module imports another in a
circle, and no module is longer than the house limit."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import grimp
import pytest

from import_graph import cycles

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PACKAGE = SRC / "dmscale"
MAX_LINES = 400


def _lint(root: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` with ``root``'s pyproject.toml and ``root/src`` on the path."""
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    return subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports; "
                           "raise SystemExit(lint_imports(no_cache=True))"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)


def _contracts() -> dict[str, dict]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return {c["id"]: c for c in config["contracts"]}


def test_lint_imports_keeps_every_contract():
    done = _lint(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


def test_layers_contract_names_every_subpackage():
    layers = _contracts()["layers"]
    named = {part.strip() for layer in layers["layers"] for part in layer.split("|")}
    children = {p.stem if p.suffix == ".py" else p.name for p in PACKAGE.iterdir()
                if p.suffix == ".py" and p.name != "__init__.py" or (p / "__init__.py").exists()}
    assert layers["exhaustive"] is True
    assert named | set(layers["exhaustive_ignores"]) == children
    # the facades re-export, they hold no code of their own
    for facade in layers["exhaustive_ignores"]:
        if facade != "__main__":
            body = (PACKAGE / f"{facade}.py").read_text()
            assert "def " not in body and "class " not in body, facade


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """A copy of the package and its pyproject.toml to break on purpose."""
    root = tmp_path_factory.mktemp("layers")
    shutil.copytree(PACKAGE, root / "src" / "dmscale", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "bench", root / "bench", ignore=lambda d, names: [  # its modules, not its results
        n for n in names if n in ("__pycache__", "results", "runs", "_baseline") or n.endswith((".md", ".yaml"))])
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    return root


@pytest.mark.parametrize("module, line, reported", [
    # the core reaching for the search: an upward import across four layers
    ("core/topk.py", "from dmscale.search.searcher import Searcher  # noqa", "dmscale.core.topk -> dmscale.search.searcher"),
    # an import only for type hints counts too
    ("cost/polyfit.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dmscale.run.report import write_report",
     "dmscale.cost.polyfit -> dmscale.run.report"),
    # siblings of one layer are independent
    ("export/verify.py", "import dmscale.cost.resources", "dmscale.export.verify -> dmscale.cost.resources"),
    # a handler importing the tracer that imports it
    ("trace/handlers/norms.py", "from dmscale.trace.tracer import Tracer", "dmscale.trace.handlers.norms -> dmscale.trace.tracer"),
    # the registry importing a task
    ("tasks/registry.py", "import dmscale.tasks.image", "dmscale.tasks.registry -> dmscale.tasks.image"),
    # the package reaching for the bench
    ("export/verify.py", "import bench.lib.benchlib", "dmscale.export.verify -> bench.lib.benchlib"),
    # a bench script importing another script (shared code goes to bench/lib)
    ("../../bench/table16.py", "from bench import np_uniform", "bench.table16 -> bench.np_uniform"),
    # the bench's shared lib importing a script
    ("../../bench/lib/benchlib.py", "import bench.peers", "bench.lib.benchlib -> bench.peers"),
])
def test_a_forbidden_import_is_reported(scratch: Path, module: str, line: str, reported: str):
    path = scratch / "src" / "dmscale" / module
    original = path.read_text()
    path.write_text(original + "\n" + line + "\n")
    try:
        done = _lint(scratch)
    finally:
        path.write_text(original)
    assert done.returncode != 0
    assert reported in done.stdout, done.stdout


def _edges(graph: grimp.ImportGraph, modules: set[str]) -> dict[str, set[str]]:
    """Each module's direct imports among ``modules``."""
    return {m: graph.find_modules_directly_imported_by(m) & modules for m in modules}


def test_no_import_cycles():
    sys.path.insert(0, str(SRC))
    try:
        graph = grimp.build_graph("dmscale", cache_dir=None)
    finally:
        sys.path.remove(str(SRC))
    modules = set(graph.modules)
    assert len(modules) > 60
    assert cycles(_edges(graph, modules)) == []
    # the check itself: a circle is found
    graph.add_import(importer="dmscale.core.errors", imported="dmscale.trace.tracer")
    assert any("dmscale.core.errors" in c for c in cycles(_edges(graph, modules)))



HARD_LINES = 600  # no module is longer
# modules allowed past MAX_LINES (400), each with its reason: past 400 lines a module is a prompt
# to look for a second job inside it, not a reason to cut a class in two
LONG_MODULES = {
    "dmscale/config/options.py": "the one table of the run's options: a declared field per option, no logic",
}


def test_no_module_longer_than_the_limit():
    lines = {str(p.relative_to(SRC)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    too_long = {m: n for m, n in lines.items() if n > HARD_LINES}
    assert too_long == {}, f"split by job: modules over {HARD_LINES} lines: {too_long}"
    unlisted = {m: n for m, n in lines.items() if n > MAX_LINES and m not in LONG_MODULES}
    assert unlisted == {}, (f"modules over {MAX_LINES} lines: {unlisted}; split them by job, or list "
                            "them in LONG_MODULES with the reason they hold one job")
    stale = [m for m in LONG_MODULES if lines.get(m, 0) <= MAX_LINES]
    assert stale == [], f"LONG_MODULES lists modules no longer over {MAX_LINES} lines: {stale}"
