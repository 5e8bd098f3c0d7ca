"""What every benchmark writes next to its numbers: the commit it ran on.

Example:
    >>> from pathlib import Path
    >>> isinstance(git_commit(Path(".")), str)
    True
"""

from __future__ import annotations

import subprocess
from pathlib import Path

__all__ = ["git_commit"]


def git_commit(root: Path) -> str:
    """The short hash of ``root``'s checked-out commit, or "?" outside a git checkout."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"
