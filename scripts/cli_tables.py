"""The option tables of docs/cli.md, generated from the command's option declarations.

    PYTHONPATH=src python scripts/cli_tables.py            # --check: exit 1 when a table is stale
    PYTHONPATH=src python scripts/cli_tables.py --write    # rewrite every table from the options

Each help group of ``dmscale COMMAND --help`` (``dmscale.config.options.GROUP_TITLES``) has one
table in docs/cli.md, between markers (HTML comments, invisible on GitHub and in the site; blank
lines inside, so the table stays a table)::

    <!-- options:data -->

    | flag | default | commands | what |
    | ... |

    <!-- /options -->

The table of resources (``<!-- resources -->`` ... ``<!-- /resources -->``) has a row per
resource of ``dmscale.cost.registry`` (the choices of ``--resource``): its name, unit and
description.

A row per option of the group, in the order of ``--help``: the flag as ``--help`` spells it,
its default on the command line, the subcommands that take it and its help text; all of it from
``dmscale.config.options.OPTIONS``, the table the declarations on ``RunConfig``'s and
``SearchConfig``'s fields make. ``--check`` names every table that differs from what the options
give, every group without a table and every table of no group, and exits 1; ``--write`` puts
the options' tables in. ``tests/test_cli_tables.py`` runs the check on the committed document.
"""

from __future__ import annotations

import argparse
import html
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

from dmscale.config.options import GROUP_TITLES, OPTIONS, Option  # noqa: E402
from dmscale.core.values import boolean  # noqa: E402
from dmscale.cost.registry import Resource, resources  # noqa: E402

__all__ = ["DOCUMENT", "SPAN", "RESOURCE_SPAN", "Problem", "flag_text", "default_text", "table",
           "resource_table", "spans", "check", "write", "main"]

DOCUMENT = ROOT / "docs" / "cli.md"
SPAN = re.compile(r"<!-- options:(?P<group>[\w-]+) -->\n(?P<text>.*?)<!-- /options -->", re.S)
RESOURCE_SPAN = re.compile(r"<!-- resources -->\n(?P<text>.*?)<!-- /resources -->", re.S)


@dataclass(frozen=True)
class Problem:
    """A table of the document that is not what the options give (or a group with none)."""

    file: str
    line: int
    group: str
    what: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: options:{self.group}: {self.what}"


def _cell(text: str) -> str:
    """``text`` safe in a cell of a markdown table: argparse's ``%%`` as ``%``, pipes, HTML
    and emphasis escaped."""
    return (text.replace("%%", "%").replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
            .replace("*", "\\*"))


def _code(text: str) -> str:
    """``text`` as code in a cell; with a pipe as ``<code>`` and ``&#124;`` (in backticks, a
    table needs ``\\|`` on GitHub and then shows the backslash on the site)."""
    if "|" not in text:
        return f"`{text}`"
    return "<code>" + html.escape(text, quote=False).replace("|", "&#124;") + "</code>"


def flag_text(opt: Option) -> str:
    """The option as ``--help`` shows it: ``--x``, ``--no-x`` for an on/off option, the choices
    or the metavar after the flag of the others."""
    if opt.flag_kind == "flag" or opt.convert is boolean:
        return f"`{opt.flag}`, `--no-{opt.flag[2:]}`"
    value = "{" + ",".join(opt.choices) + "}" if opt.choices else opt.metavar or opt.name.upper()
    return _code(f"{opt.flag} {value}")


def default_text(opt: Option) -> str:
    """The option's default on the command line (empty where the run chooses it: None)."""
    if opt.default is None:
        return ""
    if isinstance(opt.default, bool):
        return "on" if opt.default else "off"
    if isinstance(opt.default, (tuple, list)):
        return _code(",".join(map(str, opt.default)))
    return _code(str(opt.default))


def table(group: str, options: Sequence[Option] = OPTIONS) -> str:
    """The markdown table of the options of help group ``group``, in the order of ``--help``."""
    rows = ["| flag | default | commands | what |", "|---|---|---|---|"]
    rows += [f"| {flag_text(o)} | {default_text(o)} | {', '.join(o.commands)} | {_cell(o.help)} |"
             for o in options if o.group == group]
    return "\n" + "\n".join(rows) + "\n\n"


def resource_table(registered: Sequence[Resource] | None = None) -> str:
    """The markdown table of the registered resources (``--resource``'s choices)."""
    rows = ["| resource | unit | what |", "|---|---|---|"]
    rows += [f"| `{r.name}` | {_cell(r.unit)} | {_cell(r.description)} |"
             for r in (resources() if registered is None else registered)]
    return "\n" + "\n".join(rows) + "\n\n"


def spans(text: str) -> list[tuple[str, str, int]]:
    """``(group, text, line)`` of every marked table of ``text``."""
    return [(m["group"], m["text"], text.count("\n", 0, m.start()) + 1) for m in SPAN.finditer(text)]


def check(path: Path = DOCUMENT, options: Sequence[Option] = OPTIONS) -> list[Problem]:
    """Every table of ``path`` that differs from ``options``', every group with no table or
    with two, and every table of a group no option has."""
    text = path.read_text(encoding="utf-8")
    name = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
    groups = [g for g in GROUP_TITLES if any(o.group == g for o in options)]
    found = spans(text)
    problems = [Problem(name, line, g, "a table of no help group (known: " + ", ".join(groups) + ")")
                for g, _, line in found if g not in groups]
    for group in groups:
        mine = [(t, line) for g, t, line in found if g == group]
        if len(mine) != 1:
            problems.append(Problem(name, mine[1][1] if mine else 1, group,
                                    f"{len(mine)} tables, expected one (<!-- options:{group} --> ... "
                                    "<!-- /options -->)"))
        elif mine[0][0] != table(group, options):
            problems.append(Problem(name, mine[0][1], group, "stale: run scripts/cli_tables.py --write"))
    res = list(RESOURCE_SPAN.finditer(text))
    if len(res) != 1:
        problems.append(Problem(name, 1, "resources", f"{len(res)} tables of resources, expected one "
                                "(<!-- resources --> ... <!-- /resources -->)"))
    elif res[0]["text"] != resource_table():
        problems.append(Problem(name, text.count("\n", 0, res[0].start()) + 1, "resources",
                                "stale: run scripts/cli_tables.py --write"))
    return problems


def write(path: Path = DOCUMENT, options: Sequence[Option] = OPTIONS) -> bool:
    """Put ``options``' table in every marked table of ``path``; whether the file changed."""
    text = path.read_text(encoding="utf-8")
    new = SPAN.sub(lambda m: f"<!-- options:{m['group']} -->\n{table(m['group'], options)}<!-- /options -->", text)
    new = RESOURCE_SPAN.sub(lambda m: f"<!-- resources -->\n{resource_table()}<!-- /resources -->", new)
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the tables (default: check them)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a table is stale (the default)")
    args = parser.parse_args(argv)
    if args.write:
        print(f"{DOCUMENT.relative_to(ROOT)}: " + ("tables rewritten" if write() else "up to date"))
    problems = check()
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
