"""Run a launcher and the processes it starts (``torchrun`` and its ranks, their data-loader
workers) as one process group, so that a hang fails the test with every process's stacks
instead of a bare timeout, and leaves nothing running behind it.

Example:
    >>> import sys
    >>> done = run_group([sys.executable, "-c", "print('ok')"], timeout=60)
    >>> done.returncode, done.stdout.strip()
    (0, 'ok')
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

__all__ = ["DUMP_DIR", "leave_process_group", "leaving_process_group", "run_group", "with_hang_dump"]

DUMP_DIR = Path(__file__).resolve().with_name("hang_dump")  # its sitecustomize arms the stack dump


def with_hang_dump(env: dict[str, str]) -> dict[str, str]:
    """``env`` with :data:`DUMP_DIR` first on ``PYTHONPATH``: each Python process started with it
    prints its threads' stacks on SIGUSR1."""
    rest = env.get("PYTHONPATH", "")
    return {**env, "PYTHONPATH": os.pathsep.join([str(DUMP_DIR), rest]) if rest else str(DUMP_DIR)}


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:  # the group has exited
        pass


def run_group(cmd: list[str], *, timeout: float, env: dict[str, str] | None = None,
              **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(cmd, capture_output=True, text=True)`` in a session of its own. When it
    runs past ``timeout`` seconds every process of the session prints its stacks (SIGUSR1,
    :data:`DUMP_DIR`), then all of them are killed and an ``AssertionError`` carries the end of
    their output."""
    env = with_hang_dump(dict(os.environ) if env is None else env)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _signal_group(proc.pid, signal.SIGUSR1)
        time.sleep(3)  # time to write the stacks
        _signal_group(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{' '.join(cmd[:6])} ... did not finish in {timeout:.0f} s; the stacks of its "
                             f"processes at the timeout:\n{err[-12000:]}\nstdout:\n{out[-2000:]}") from None
    finally:
        if proc.poll() is None:
            _signal_group(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def leave_process_group() -> None:
    """What a launched rank does last: drop what it no longer refers to (a DDP or FSDP wrapper
    among it), meet the other ranks, destroy the process group. A reducer or a sharded module
    still alive at interpreter exit aborts the process now and then ("terminate called without
    an active exception", exit -6). Nothing to do outside a process group."""
    import gc

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


@contextmanager
def leaving_process_group() -> Iterator[None]:
    """A spawned rank's work: after it, :func:`leave_process_group`; on an error, the group is
    destroyed without the barrier (another rank may wait in a collective) and the error raised."""
    import torch.distributed as dist

    try:
        yield
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_process_group()
