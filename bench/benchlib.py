"""What every benchmark writes next to its numbers: the commit it ran on, and mean ± std.

Example:
    >>> from pathlib import Path
    >>> isinstance(git_commit(Path(".")), str)
    True
    >>> spread([0.5, 0.7, 0.6], digits=2)
    '0.60 ± 0.10 [0.50, 0.70]'
"""

from __future__ import annotations

import statistics
import subprocess
from pathlib import Path

__all__ = ["git_commit", "spread"]


def git_commit(root: Path) -> str:
    """The short hash of ``root``'s checked-out commit, or "?" outside a git checkout."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def spread(values: list[float], digits: int = 3) -> str:
    """``mean ± std [min, max]`` of several runs (the value alone for one run)."""
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return (f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f} "
            f"[{min(values):.{digits}f}, {max(values):.{digits}f}]")
