"""Run one chain of documentation code blocks (tests/test_doc_blocks.py writes it as JSON):
``python doc_block_runner.py CHAIN.json``, in the chain's own empty directory.

The steps run in order: Python blocks and preludes in one shared namespace (``__main__``),
shell blocks with ``bash -e``, file blocks written where the block says. A Python block is
compiled under its page's name with its lines where they stand in the page, so a traceback
points at ``docs/library.md``, line 20, and shows that line.
"""

from __future__ import annotations

import json
import linecache
import subprocess
import sys
import traceback
from pathlib import Path


def _fix_torchvision() -> None:
    """This checkout's torchvision is a CUDA build whose C++ ops do not load next to the CPU
    torch, so ``import torchvision`` (and transformers, ultralytics) fails in a process that
    has not imported dmscale. Declare the two operator schemas torchvision needs at import,
    as tests/hf_fresh.py does: an environment fix, not dmscale's, so the blocks run as a
    reader runs them, without importing dmscale first."""
    import glob
    import importlib.util
    import os

    import torch

    spec = importlib.util.find_spec("torchvision")
    if spec is None:
        return
    try:  # a torchvision whose ops load (declaring them beside it would register them twice)
        torch.ops.load_library(glob.glob(os.path.join(list(spec.submodule_search_locations)[0], "_C*.so"))[0])
    except (IndexError, OSError, RuntimeError):
        lib = torch.library.Library("torchvision", "DEF")
        lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _fix_torchvision.lib = lib  # keep the library (and its definitions) alive


_PAGES: dict[str, str] = {}


def _show_pages() -> None:
    """Put the pages' lines in linecache, where tracebacks look them up (again: a library
    may have cleared it)."""
    for name, text in _PAGES.items():
        linecache.cache[name] = (len(text), None, text.splitlines(keepends=True), name)


def _run_python(namespace: dict, name: str, source: str, first_line: int, page_text: str | None) -> None:
    if page_text is not None:
        _PAGES[name] = page_text
        _show_pages()
    code = compile("\n" * (first_line - 1) + source, name, "exec")
    exec(code, namespace)


def main(chain_file: str) -> None:
    chain = json.loads(Path(chain_file).read_text())
    _fix_torchvision()
    namespace: dict = {"__name__": "__main__", "__builtins__": __builtins__}
    for step in chain["steps"]:
        kind = step["kind"]
        print(f"--- {step['where']}: {kind}", flush=True)
        if kind == "python":
            _run_python(namespace, step["name"], step["code"], step["line"], step.get("page_text"))
        elif kind == "shell":
            done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", step["code"]])
            if done.returncode != 0:
                sys.exit(f"{step['where']}: the shell block exited with status {done.returncode}")
        elif kind == "file":
            path = Path(step["path"])
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(step["code"])
        else:
            raise ValueError(f"unknown step kind {kind!r}")
    _leave_process_group(namespace)


def _leave_process_group(namespace: dict) -> None:
    """A torchrun block leaves its process group cleanly: the blocks' objects (a DDP wrapper
    among them) are dropped while the group lives, the ranks meet, then the group is destroyed.
    A DDP reducer still alive at interpreter exit aborts the process ("terminate called without
    an active exception")."""
    from torchrun_util import leave_process_group

    namespace.clear()
    leave_process_group()


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except BaseException as e:  # print through traceback, which reads the pages' lines from linecache
        if isinstance(e, SystemExit):
            raise
        _show_pages()
        traceback.print_exc()
        sys.exit(1)
