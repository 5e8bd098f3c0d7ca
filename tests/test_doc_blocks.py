"""Every code block of README.md and docs/*.md is run here, or says why not.

A block is preceded (blank lines aside) by one HTML comment, which GitHub, PyPI and MkDocs
do not show:

``<!-- run -->``
    run as written, in a fresh process whose working directory is an empty temporary
    directory: a ``python`` block with ``exec``, a shell block (``bash``, or no language)
    with ``bash -e``, where ``dmscale`` is ``python -m dmscale`` of this checkout.
``<!-- run: OPTION; OPTION ... -->``
    the same, with options:

    - ``continue``: the next part of the page's previous run block: same process (Python
      blocks share one namespace), same directory;
    - ``prelude NAME``: first run ``tests/doc_preludes/NAME.py`` in the block's namespace,
      a hidden setup that defines what the page leaves to the reader (``task_loss``,
      ``images``, a model directory ``path``) with tiny data;
    - ``fill NAME``: run ``tests/doc_preludes/NAME.py`` in place of the block's one line
      ``# ...`` (where the page elides the training loop, say);
    - ``file NAME``: the block is a file's content (a YAML configuration): write it to NAME;
    - ``then COMMAND``: a shell command run after the block (``dmscale search --config
      search.yaml``, as the text around the block says);
    - ``torchrun N``: run the chain's Python under ``torchrun --standalone --nproc_per_node N``
      on CPU (gloo);
    - ``slow``: minutes of compute: run by ``test_slow_doc_block`` (``-m slow``) only.
``<!-- not run: REASON -->``
    not runnable here, and why: a GPU, several nodes, a download, the reader's own files, or
    more compute than a test affords.
``<!-- output -->``
    what a command printed, not code.

``test_every_block_is_run_or_says_why_not`` checks that every fenced (and indented) code
block carries one of these, with a reason where it is not run.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from torchrun_util import run_group

ROOT = Path(__file__).resolve().parents[1]
PRELUDES = ROOT / "tests" / "doc_preludes"
RUNNER = ROOT / "tests" / "doc_block_runner.py"
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]

MARKER = re.compile(r"^<!--\s*(run|not run|output)\s*(?::\s*(.*?))?\s*-->$")
FENCE = re.compile(r"^( {0,3})(`{3,}|~{3,})\s*([\w+-]*)")
SHELL = {"", "bash", "sh", "shell", "console"}
OPTIONS = {"continue", "prelude", "fill", "file", "then", "torchrun", "slow"}
TIMEOUT_S = 900
SLOW_TIMEOUT_S = 2400


@dataclass
class Block:
    page: str
    line: int              # of the opening fence (an indented block: of its first line)
    lang: str
    code: str
    code_line: int         # the code's first line in the page
    marker: str | None     # "run", "not run", "output" or None (no marker)
    detail: str = ""       # the marker's text after the colon
    options: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def _options(detail: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in detail.split(";"))):
        name, _, value = part.partition(" ")
        out[name] = value.strip()
    return out


def parse_page(page: str) -> list[Block]:
    """The code blocks of ``page`` (fenced, and indented ones outside lists) with their markers."""
    lines = (ROOT / page).read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []

    def marker_before(i: int) -> tuple[str | None, str]:
        j = i - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        m = MARKER.match(lines[j].strip()) if j >= 0 else None
        return (m.group(1), (m.group(2) or "").strip()) if m else (None, "")

    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m:
            fence = m.group(2)
            j = i + 1
            while j < len(lines) and not re.match(rf"^ {{0,3}}{fence[0]}{{{len(fence)},}}\s*$", lines[j]):
                j += 1
            kind, detail = marker_before(i)
            blocks.append(Block(page, i + 1, m.group(3).lower(), "\n".join(lines[i + 1:j]) + "\n",
                                i + 2, kind, detail))
            i = j + 1
            continue
        prev = lines[i - 1] if i else ""
        if lines[i].startswith(("    ", "\t")) and lines[i].strip() and not prev.strip():
            k = i - 1  # an indented line after a blank one: code, unless it continues a list item
            while k >= 0 and not lines[k].strip():
                k -= 1
            in_list = k >= 0 and re.match(r"^(\s+|[-*+]\s|\d+[.)]\s)", lines[k])
            if not in_list:
                j = i
                while j < len(lines) and (not lines[j].strip() or lines[j].startswith(("    ", "\t"))):
                    j += 1
                kind, detail = marker_before(i)
                code = "\n".join(line[4:] for line in lines[i:j]).rstrip() + "\n"
                blocks.append(Block(page, i + 1, "", code, i + 1, kind, detail))
                i = j
                continue
        i += 1
    for b in blocks:
        if b.marker == "run":
            b.options = _options(b.detail)
    return blocks


def all_blocks() -> list[Block]:
    return [b for page in PAGES for b in parse_page(page)]


@dataclass
class Chain:
    blocks: list[Block]

    @property
    def where(self) -> str:
        return self.blocks[0].where

    @property
    def slow(self) -> bool:
        return any("slow" in b.options for b in self.blocks)

    @property
    def torchrun(self) -> int:
        return max((int(b.options.get("torchrun") or 0) for b in self.blocks), default=0)


def chains() -> list[Chain]:
    """The run blocks, grouped: a block marked ``continue`` joins its page's previous run block."""
    out: list[Chain] = []
    for b in all_blocks():
        if b.marker != "run":
            continue
        if "continue" in b.options and out and out[-1].blocks[-1].page == b.page:
            out[-1].blocks.append(b)
        else:
            out.append(Chain([b]))
    return out


def _problems(b: Block, previous_run: Block | None) -> list[str]:
    if b.marker is None:
        return [f"{b.where}: a {b.lang or 'plain'} code block without a marker: put "
                "<!-- run -->, <!-- not run: REASON --> or <!-- output --> before it"]
    if b.marker == "not run":
        return [] if len(b.detail) >= 10 else [f"{b.where}: 'not run' needs its reason"]
    if b.marker == "output":
        return []
    bad = [f"{b.where}: unknown option {name!r} (known: {sorted(OPTIONS)})"
           for name in b.options if name not in OPTIONS]
    for option in ("prelude", "fill"):
        if option in b.options and not (PRELUDES / f"{b.options[option]}.py").is_file():
            bad.append(f"{b.where}: no {option} tests/doc_preludes/{b.options[option]}.py")
    if "fill" in b.options and len(_elisions(b)) != 1:
        bad.append(f"{b.where}: 'fill' needs exactly one line '# ...' in the block")
    if "continue" in b.options and (previous_run is None or previous_run.page != b.page):
        bad.append(f"{b.where}: 'continue' without an earlier run block on the page")
    if "file" not in b.options and b.lang != "python" and b.lang not in SHELL:
        bad.append(f"{b.where}: a {b.lang} block runs only as a 'file NAME'")
    if "torchrun" in b.options and b.lang != "python":
        bad.append(f"{b.where}: 'torchrun' runs Python blocks only")
    return bad


def test_every_block_is_run_or_says_why_not():
    problems, previous_run = [], None
    blocks = all_blocks()
    for b in blocks:
        problems += _problems(b, previous_run)
        if b.marker == "run":
            previous_run = b
    assert problems == []
    # sanity: the parser sees the pages' blocks
    assert sum(b.marker == "run" for b in blocks) >= 10


def test_no_marker_stands_alone():
    """A marker belongs to the code block right after it (blank lines aside)."""
    stray = []
    for page in PAGES:
        lines = (ROOT / page).read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            if MARKER.match(line.strip()):
                j = i + 1
                while j < len(lines) and not lines[j].strip():
                    j += 1
                nxt = lines[j] if j < len(lines) else ""
                if not (FENCE.match(nxt) or nxt.startswith(("    ", "\t"))):
                    stray.append(f"{page}:{i + 1}")
    assert stray == []


def _environment(tmp: Path) -> dict[str, str]:
    bin_dir = tmp / ".bin"
    bin_dir.mkdir()
    shim = bin_dir / "dmscale"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m dmscale "$@"\n')
    shim.chmod(0o755)
    env = {**os.environ,
           "PATH": f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")]),
           "DMSCALE_CACHE": str(tmp / ".cache"), "YOLO_CONFIG_DIR": str(tmp / ".ultralytics"),
           "MPLBACKEND": "Agg", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    return env


def _elisions(b: Block) -> list[int]:
    return [i for i, line in enumerate(b.code.splitlines()) if line.strip().startswith("# ...")]


def _python_steps(b: Block) -> list[dict]:
    page_text = (ROOT / b.page).read_text(encoding="utf-8")
    lines = b.code.splitlines(keepends=True)
    parts = [(0, len(lines))]
    if "fill" in b.options:
        k = _elisions(b)[0]
        parts = [(0, k), (k + 1, len(lines))]
    steps = []
    for n, (start, stop) in enumerate(parts):
        if n:
            path = PRELUDES / f"{b.options['fill']}.py"
            steps.append({"kind": "python", "where": f"{b.where} fill", "name": str(path),
                          "code": path.read_text(), "line": 1})
        steps.append({"kind": "python", "where": b.where, "name": b.page, "code": "".join(lines[start:stop]),
                      "line": b.code_line + start, "page_text": page_text})
    return steps


def _steps(chain: Chain) -> list[dict]:
    steps = []
    for b in chain.blocks:
        if "prelude" in b.options:
            path = PRELUDES / f"{b.options['prelude']}.py"
            steps.append({"kind": "python", "where": f"{b.where} prelude", "name": str(path),
                          "code": path.read_text(), "line": 1})
        if "file" in b.options:
            steps.append({"kind": "file", "where": b.where, "path": b.options["file"], "code": b.code})
        elif b.lang == "python":
            steps += _python_steps(b)
        else:
            steps.append({"kind": "shell", "where": b.where, "code": b.code})
        if "then" in b.options:
            steps.append({"kind": "shell", "where": f"{b.where} then", "code": b.options["then"]})
    return steps


def run_chain(chain: Chain, tmp: Path, timeout: int) -> None:
    work = tmp / "work"
    work.mkdir()
    chain_file = tmp / "chain.json"
    chain_file.write_text(json.dumps({"steps": _steps(chain)}))
    cmd = [sys.executable, str(RUNNER), str(chain_file)]
    if chain.torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(chain.torchrun), *cmd[1:]]
    done = run_group(cmd, cwd=work, env=_environment(tmp), timeout=timeout)
    assert done.returncode == 0, (
        f"{chain.where} failed (exit {done.returncode}):\n{done.stdout[-6000:]}\n{done.stderr[-10000:]}")


FAST = [c for c in chains() if not c.slow]
SLOW = [c for c in chains() if c.slow]


@pytest.mark.parametrize("chain", FAST, ids=[c.where for c in FAST])
def test_doc_block(chain: Chain, tmp_path: Path):
    run_chain(chain, tmp_path, TIMEOUT_S)


@pytest.mark.slow
@pytest.mark.parametrize("chain", SLOW, ids=[c.where for c in SLOW])
def test_slow_doc_block(chain: Chain, tmp_path: Path):
    run_chain(chain, tmp_path, SLOW_TIMEOUT_S)


_LEAVES = '''
import atexit, os
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
ddp(torch.randn(3, 2)).sum().backward()
rank = dist.get_rank()
atexit.register(lambda d=dist, r=rank: open(f"exit{r}.txt", "w").write(str(d.is_initialized())))
'''


def test_a_torchrun_block_leaves_its_process_group_before_exit(tmp_path: Path):
    """A block that leaves a DDP wrapper and its process group alive must not reach interpreter
    exit with them: the reducer then aborts the rank now and then (seen once in CI)."""
    work = tmp_path / "work"
    work.mkdir()
    chain = tmp_path / "chain.json"
    chain.write_text(json.dumps({"steps": [
        {"kind": "python", "where": "ddp block", "name": "ddp.py", "code": _LEAVES, "line": 1}]}))
    done = run_group([sys.executable, "-m", "torch.distributed.run", "--standalone",
                      "--nproc_per_node", "2", str(RUNNER), str(chain)],
                     cwd=work, env=_environment(tmp_path), timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert [(work / f"exit{r}.txt").read_text() for r in (0, 1)] == ["False", "False"]
