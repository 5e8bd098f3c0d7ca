"""The bench's one entry point, run from the repository root:

    python -m bench list                  # every table: name, script, cache, outputs, question
    python -m bench table NAME [--check]  # rewrite NAME's md (and plot) from its cache, running nothing
    python -m bench check [NAME ...]      # table --check of every table with a cache (or those named), in one process
    python -m bench run NAME [ARGS...]    # run NAME's script with ARGS (its own flags: --quick, --seeds ...)

``table --check`` rewrites the outputs, compares them with what was there, puts the old files
back and exits 1 naming the first differing line: whether the committed table is what its
cache gives. The tables and their scripts are listed in :mod:`bench.lib.tables`.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import importlib
import importlib.util
import sys
from pathlib import Path

from bench.lib.tables import TABLES, Table, table

__all__ = ["main"]

RESULTS = Path(__file__).resolve().parent / "results"
_TEST_HELPERS = {"zoo", "transformer_zoo", "image_folders"}  # modules of tests/ some scripts build models with


def _list() -> int:
    for t in TABLES.values():
        cache = ", ".join(t.caches) or "no cache"
        print(f"{t.name:22} python -m {t.module}  [{cache}] -> {', '.join(t.outputs)}\n{'':22} {t.question}")
    return 0


def _files(results: Path, t: Table) -> dict[Path, bytes | None]:
    return {results / o: ((results / o).read_bytes() if (results / o).is_file() else None) for o in t.outputs}


def _first_difference(path: Path, old: bytes | None) -> str:
    if old is None:
        return f"{path.name}: did not exist before"
    new = path.read_bytes() if path.is_file() else b""
    if path.suffix != ".md":
        return f"{path.name}: {len(old)} bytes committed, {len(new)} generated"
    diff = difflib.unified_diff(old.decode().splitlines(), new.decode().splitlines(), "committed", "generated",
                                n=0, lineterm="")
    return f"{path.name}:\n" + "\n".join(list(diff)[:12])


def _table(name: str, check: bool) -> int:
    t = table(name)
    if t.rebuild is None:
        sys.exit(f"{name} has no cache to rebuild from: rerun it (python -m bench run {name} ...)")
    before = _files(RESULTS, t)
    try:
        module = importlib.import_module(t.module)
    except ModuleNotFoundError as err:
        if err.name not in _TEST_HELPERS:
            raise
        sys.exit(f"{t.module} imports {err.name} from tests/: run it as PYTHONPATH=src:tests python -m bench table {name}")
    module.main(list(t.rebuild))
    if not check:
        return 0
    changed = [p for p, old in before.items() if p.suffix == ".md" and (p.read_bytes() if p.is_file() else None) != old]
    for p, old in before.items():  # --check leaves the committed files as they were
        if old is not None:
            p.write_bytes(old)
    for p in changed:
        print(f"{t.name}: {_first_difference(p, before[p])}", file=sys.stderr)
    return 1 if changed else 0


def _check_all(names: list[str]) -> int:
    """``table NAME --check`` for every table with a cache (or each of ``names``); 1 when any
    committed md differs."""
    unknown = [n for n in names if n not in TABLES]
    if unknown:
        sys.exit(f"no table {', '.join(unknown)}; python -m bench list shows every one")
    chosen = names or [n for n, t in TABLES.items() if t.rebuild is not None]
    bad = []
    for name in chosen:
        with contextlib.redirect_stdout(io.StringIO()):  # the scripts say what they wrote
            if _table(name, check=True):
                bad.append(name)
    print(f"{len(bad)} of {len(chosen)} tables differ from their "
          f"cache{': ' + ', '.join(bad) if bad else ''}")
    return 1 if bad else 0


def _results(argv: list[str]) -> int:
    if importlib.util.find_spec("bench.lib.results_doc") is None:
        sys.exit("no bench/lib/results_doc.py: bench/RESULTS.md has no generator in this checkout")
    return importlib.import_module("bench.lib.results_doc").main(argv) or 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="every table, its script, cache and outputs")
    cp = sub.add_parser("check", help="exit 1 when any table with a cache is not what its cache gives")
    cp.add_argument("names", nargs="*", metavar="NAME", help="only these tables (default: every one with a cache)")
    tp = sub.add_parser("table", help="rewrite a table from its cache (runs nothing)")
    tp.add_argument("name", choices=list(TABLES), metavar="NAME")
    tp.add_argument("--check", action="store_true", help="exit 1 when the rewritten md differs; keep the old files")
    rp = sub.add_parser("run", help="run a table's script with its own arguments")
    rp.add_argument("name", choices=list(TABLES), metavar="NAME")
    rp.add_argument("args", nargs=argparse.REMAINDER)
    sub.add_parser("results", help="bench/RESULTS.md from the caches (bench.lib.results_doc)", add_help=False)
    args, rest = p.parse_known_args(argv)
    if args.command == "results":
        return _results(rest)
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "list":
        return _list()
    if args.command == "check":
        return _check_all(args.names)
    if args.command == "table":
        return _table(args.name, args.check)
    importlib.import_module(table(args.name).module).main(args.args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
