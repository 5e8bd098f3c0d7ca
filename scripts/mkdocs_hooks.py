"""mkdocs hooks: the benchmark plots of ``bench/results`` are part of the site.

The benchmarks page shows the plots that ``bench/results_plots.py`` writes next to their
tables; they live outside ``docs/`` so that they are written once. :func:`on_files` adds every
``bench/results/*.png`` to the site under the same path, so ``![...](bench/results/x.png)``
resolves in the built site and ``--strict`` checks it like any other link.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

__all__ = ["on_files"]

ROOT = Path(__file__).resolve().parents[1]


def on_files(files: Files, config: Any) -> Files:
    """Add the plots of ``bench/results`` to the site's files."""
    for png in sorted((ROOT / "bench" / "results").glob("*.png")):
        uri = png.relative_to(ROOT).as_posix()
        files.append(File.generated(config, uri, abs_src_path=str(png)))
    return files
