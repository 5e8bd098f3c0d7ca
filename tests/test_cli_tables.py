"""The option tables of docs/cli.md are the options' declarations: ``scripts/cli_tables.py``
finds no stale table in the committed document, a help text changed in a declaration makes
its group's table stale (file, line, group) until ``--write`` puts the new text in, and every
help group has exactly one table."""

from __future__ import annotations

import dataclasses
import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

from dmscale.config.options import GROUP_TITLES, OPTIONS

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ct():
    spec = importlib.util.spec_from_file_location("cli_tables", ROOT / "scripts" / "cli_tables.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["cli_tables"] = module
    spec.loader.exec_module(module)
    return module


def _altered(name: str, help_text: str) -> tuple:
    return tuple(dataclasses.replace(o, help=help_text) if o.name == name else o for o in OPTIONS)


def test_the_document_shows_the_declared_options(ct) -> None:
    bad = ct.check()
    assert not bad, "docs/cli.md's option tables are stale (python scripts/cli_tables.py --write):\n" + \
        "\n".join(map(str, bad))
    found = ct.spans(ct.DOCUMENT.read_text(encoding="utf-8"))
    assert [g for g, _, _ in found] == list(GROUP_TITLES)
    rows = [line for _, table, _ in found for line in table.splitlines()]
    for opt in OPTIONS:  # every option, every subcommand that takes it
        row = next(line for line in rows if line.startswith(f"| {ct.flag_text(opt)} |"))
        assert f"| {', '.join(opt.commands)} |" in row, opt.name


def test_a_changed_help_text_is_reported_and_written_back(ct, tmp_path: Path) -> None:
    doc = tmp_path / "cli.md"
    shutil.copy(ct.DOCUMENT, doc)
    original = doc.read_text(encoding="utf-8")
    changed = _altered("seq_len", "characters or tokens per sequence, a <changed> | help * text")
    bad = ct.check(doc, changed)
    line = original.count("\n", 0, original.index("<!-- options:data -->")) + 1
    assert [(p.file, p.line, p.group) for p in bad] == [("cli.md", line, "data")]
    assert str(bad[0]) == f"cli.md:{line}: options:data: stale: run scripts/cli_tables.py --write"
    assert ct.write(doc, changed) is True
    rewritten = doc.read_text(encoding="utf-8")
    assert "a &lt;changed&gt; \\| help \\* text |" in rewritten
    assert ct.check(doc, changed) == [] and [p.group for p in ct.check(doc)] == ["data"]
    assert ct.write(doc) is True and doc.read_text(encoding="utf-8") == original
    assert ct.write(doc) is False


def _block(text: str, group: str) -> str:
    start = text.index(f"<!-- options:{group} -->")
    return text[start:text.index("<!-- /options -->", start) + len("<!-- /options -->")]


def test_a_group_without_its_table_or_with_two_is_reported(ct, tmp_path: Path) -> None:
    doc = tmp_path / "cli.md"
    text = ct.DOCUMENT.read_text(encoding="utf-8")
    watch, run = _block(text, "watch"), _block(text, "run")
    doc.write_text(text.replace(watch, watch.replace("options:watch", "options:nowhere")) + "\n" + run + "\n",
                   encoding="utf-8")
    got = sorted((p.group, p.what) for p in ct.check(doc))
    assert [g for g, _ in got] == ["nowhere", "run", "watch"]
    assert got[0][1].startswith("a table of no help group (known: data, model, ")
    assert got[1][1].startswith("2 tables, expected one") and got[2][1].startswith("0 tables, expected one")


def test_the_command_line_checks_and_writes(ct, capsys) -> None:
    assert ct.main([]) == 0
    assert ct.main(["--write"]) == 0 and "up to date" in capsys.readouterr().out
