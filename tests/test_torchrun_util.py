"""The multi-process test runner (tests/torchrun_util.py): a launch that hangs fails with the
stacks of its processes, children included, and leaves none of them running."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from torchrun_util import run_group

__all__: list[str] = []

_HANGS = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time\\ndef child_waits():\\n    time.sleep(600)\\nchild_waits()"])
open(sys.argv[1], "w").write(str(child.pid))
def parent_waits():
    time.sleep(600)
parent_waits()
"""


def test_a_hang_fails_with_every_process_stack_and_kills_them(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    with pytest.raises(AssertionError, match="did not finish in 8 s") as info:
        run_group([sys.executable, "-c", _HANGS, str(pid_file)], timeout=8)
    message = str(info.value)
    assert "parent_waits" in message and "child_waits" in message, message
    assert not _running(int(pid_file.read_text()))  # killed with its group


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (an orphan killed with its group waits
    for whoever adopted it to collect it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_a_finished_run_returns_its_output() -> None:
    done = run_group([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
                     timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")


def test_a_rank_leaves_its_process_group_before_exit() -> None:
    """What the launched scripts do last: the group is gone (a sharded module or DDP reducer
    still alive at interpreter exit aborted a rank of the Lightning FSDP test about 1 run in 3)."""
    import torch.distributed as dist

    from torchrun_util import leave_process_group

    leave_process_group()  # outside a group: nothing to do
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    leave_process_group()
    assert not dist.is_initialized()
