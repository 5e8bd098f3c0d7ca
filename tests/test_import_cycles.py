"""No import circle in the repository: the module-level imports of ``src/``, ``bench/`` and
``scripts/`` (read with :mod:`ast`, nothing imported) form a graph without a strongly connected
component of more than one module, and a module does not import itself.

An import inside a function is not followed (it runs when called, after every module has
loaded); one under ``if TYPE_CHECKING:`` is, as import-linter counts it. ``from a import b``
points at the module ``a.b`` when there is one, else at ``a``. ``scripts/`` are run as files
(``python scripts/x.py``), so they import each other by bare name.
"""

from __future__ import annotations

import ast
from pathlib import Path

from import_graph import cycles

ROOT = Path(__file__).resolve().parents[1]
# (folder, the module-name prefix of the files under it)
TREES = ((ROOT / "src", ""), (ROOT, "bench."), (ROOT / "scripts", ""))


def modules(folder: Path, prefix: str) -> dict[str, Path]:
    """``{dotted name: file}`` of the Python files under ``folder`` (``prefix``: ``bench.`` for
    the bench, whose files are read from the repository root's ``bench/``)."""
    base = folder / prefix.rstrip(".") if prefix else folder
    found = {}
    for path in sorted(base.rglob("*.py")):
        if "__pycache__" in path.parts or {"runs", "_baseline"} & set(path.relative_to(base).parts):
            continue
        parts = list(path.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        name = ".".join([prefix.rstrip(".")] * bool(prefix) + parts)
        if name:
            found[name] = path
    return found


def _top_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The import statements outside every function and class body."""
    out: list[ast.Import | ast.ImportFrom] = []
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            todo += list(ast.iter_child_nodes(node))
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``name`` (the file ``path``) imports at module level."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in _top_level_imports(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)] if package else []
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for target in targets:
            while target and target not in known:  # ``import a.b.c`` of a name inside a.b
                target = target.rpartition(".")[0]
            if target:
                out.add(target)
    return out


def graph(trees: tuple[tuple[Path, str], ...] = TREES) -> dict[str, set[str]]:
    files = {n: p for folder, prefix in trees for n, p in modules(folder, prefix).items()}
    return {n: imports_of(n, p, set(files)) for n, p in files.items()}


def test_no_import_cycle_in_src_bench_or_scripts() -> None:
    edges = graph()
    assert {"dmscale", "bench.lib.benchlib", "bench.__main__"} <= set(edges), sorted(edges)[:5]
    found = cycles(edges)
    assert not found, "import cycles (move the shared code into a module both import):\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_a_planted_cycle_is_found(tmp_path: Path) -> None:
    pkg = tmp_path / "bench"
    (pkg / "lib").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "lib" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from bench.lib import b\n")
    (pkg / "lib" / "b.py").write_text("import os\n\ndef f():\n    import bench.a  # in a function: not followed\n")
    (pkg / "lib" / "c.py").write_text("from . import d\n")
    (pkg / "lib" / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import x\n")
    edges = graph(((tmp_path, "bench."),))
    assert edges["bench.a"] == {"bench.lib.b"} and edges["bench.lib.b"] == set()
    assert cycles(edges) == [["bench.lib.c", "bench.lib.d"]]
    (pkg / "lib" / "b.py").write_text("import bench.a\n")
    assert cycles(graph(((tmp_path, "bench."),))) == [["bench.a", "bench.lib.b"], ["bench.lib.c", "bench.lib.d"]]
