"""Run a worker on N gloo ranks in spawned processes and collect what each rank saved.

The worker is called as ``worker(rank, world, store, out, *extra)`` and writes
``out/rank{r}.pt``; a run that does not finish within ``deadline_s`` fails the test (a hang in
a collective) and its processes are terminated.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.multiprocessing as mp

__all__ = ["spawn_ranks"]


def spawn_ranks(worker: Callable[..., None], world: int, tmp_path: Path, *extra: Any,
                deadline_s: float) -> list[Any]:
    """``torch.load`` of every rank's ``rank{r}.pt`` after ``worker`` ran on ``world`` ranks."""
    ctx = mp.spawn(worker, args=(world, str(tmp_path / "store"), str(tmp_path), *extra),
                   nprocs=world, join=False)
    deadline = time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"the {world} ranks did not finish in {deadline_s:.0f} s (a hang in a collective?)")
    except mp.ProcessExitedException as err:  # say whether the rank died in its work or at exit
        wrote = [r for r in range(world) if (tmp_path / f"rank{r}.pt").exists()]
        raise AssertionError(f"{err}; ranks that saved their results before: {wrote or 'none'} (a rank "
                             "that saved them died at exit: leave the process group first, "
                             "torchrun_util.leave_process_group)") from err
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
                p.join(5)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
