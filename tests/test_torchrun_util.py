"""The multi-process test runner (tests/torchrun_util.py): a launch that hangs fails with the
stacks of its processes, children included, and leaves none of them running; a spawned rank
(tests/spawn_ranks.py) that dies after saving its results is reported as dying at exit."""

from __future__ import annotations

import sys
from contextlib import nullcontext
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


@pytest.mark.slow  # waits out its 8 s timeout
def test_a_hang_fails_with_every_process_stack_and_kills_them(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    with pytest.raises(AssertionError, match="did not finish in 8 s") as info:
        run_group([sys.executable, "-c", _HANGS, str(pid_file)], timeout=8)
    message = str(info.value)
    assert "parent_waits" in message and "child_waits" in message, message
    assert not _running_after(int(pid_file.read_text()), seconds=10)  # killed with its group


def _running_after(pid: int, seconds: float) -> bool:
    """Whether ``pid`` still runs ``seconds`` after the kill: on a loaded machine a SIGKILLed
    process takes a moment to exit."""
    import time

    deadline = time.monotonic() + seconds
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _running(pid)


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



def test_a_rank_s_work_leaves_its_group_after_it_and_on_an_error() -> None:
    import torch.distributed as dist

    from torchrun_util import leaving_process_group

    for fails in (False, True):
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        with pytest.raises(RuntimeError, match="the work failed") if fails else nullcontext():
            with leaving_process_group():
                if fails:
                    raise RuntimeError("the work failed")
        assert not dist.is_initialized()

def _saves_then_aborts(rank: int, world: int, store: str, out: str) -> None:
    """A spawned rank that finishes its work and dies at exit, as a rank did whose gloo group
    was alive at interpreter exit (rank 1 only)."""
    import os
    import time

    import torch

    torch.save(rank, os.path.join(out, f"rank{rank}.pt"))
    if rank == 1:
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(out, "rank0.pt")) and time.monotonic() < deadline:
            time.sleep(0.05)  # (rank 0 saved too: a dead rank makes spawn terminate the others)
        os.abort()


def test_a_rank_that_dies_after_saving_is_named_as_dying_at_exit(tmp_path: Path) -> None:
    from spawn_ranks import spawn_ranks

    with pytest.raises(AssertionError, match=r"SIGABRT; ranks that saved their results before: \[0, 1\]"):
        spawn_ranks(_saves_then_aborts, 2, tmp_path, deadline_s=120)
