"""The files of a run directory, its checkpoint, the RNG state, stop signals and progress.

What a resumable run needs besides the step loop itself (:mod:`dmscale.engine.loop`):

* :class:`RunDir`: ``config.yaml``, ``state.json``, ``metrics.jsonl`` and ``checkpoint.pt``
  of one run, JSON written atomically, the checkpoint written to a temporary file first;
* :func:`read_checkpoint`: a checkpoint back, with an error that says how to go on when it
  is damaged or of another version;
* :func:`rng_state` / :func:`set_rng_state`: torch, numpy, Python (and CUDA) generators;
* :class:`StopOnSignals` and :class:`Stopped`: SIGINT / SIGTERM become "checkpoint, then
  stop", and ``--resume`` continues;
* :class:`Progress`: a tqdm bar on a terminal, a log line every 10 % otherwise.

Example:
    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     rd = RunDir(tmp)
    ...     rd.write_json("state.json", {"step": 3})
    ...     rd.append_metrics({"loss": 0.5})
    ...     rd.save_checkpoint({"version": CHECKPOINT_VERSION, "step": 3})
    ...     rd.read_json("state.json"), read_checkpoint(rd.checkpoint)["step"], rd.metrics_size()
    ({'step': 3}, 3, 14)
    >>> fmt_count(12_345_678), fmt_time(3725)
    ('12.35M', '1h02m05s')
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dmscale.core.errors import ConfigError, WriteError
from dmscale.cost.registry import format_value

__all__ = [
    "CHECKPOINT_VERSION",
    "Progress",
    "RunDir",
    "StopOnSignals",
    "Stopped",
    "atomic_write_text",
    "fmt_count",
    "fmt_time",
    "read_checkpoint",
    "rng_state",
    "set_rng_state",
]

CHECKPOINT_VERSION = 1


class Stopped(Exception):
    """The run stopped with a checkpoint (at ``--stop-after``, or on SIGINT/SIGTERM: then
    ``signal`` is the signal's number); ``--resume`` continues it."""

    def __init__(self, run_dir: Path, global_step: int, signal: int | None = None) -> None:
        super().__init__(f"stopped after {global_step} steps")
        self.run_dir = run_dir
        self.global_step = global_step
        self.signal = signal


class StopOnSignals:
    """While active, SIGINT and SIGTERM only set :attr:`received`; the step loop then writes
    a checkpoint and stops. A second signal of the same kind interrupts at once (as before).
    Does nothing outside the main thread, where handlers cannot be installed."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is not None:  # asked twice: stop now
            raise KeyboardInterrupt
        self.received = signum

    def __enter__(self) -> "StopOnSignals":
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        import signal

        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


# ----------------------------------------------------------------------------- files
def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, then move it into place."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating,)):
        return float(obj)
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON-able: {type(obj).__name__}")


class RunDir:
    """The files of one run directory.

    ``writes=False`` (every rank but 0 under torchrun): reads work, writes do nothing.
    """

    def __init__(self, path: str | Path, writes: bool = True) -> None:
        self.path = Path(path)
        self.writes = writes

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    @property
    def config(self) -> Path:
        return self.path / "config.yaml"

    @property
    def checkpoint(self) -> Path:
        return self.path / "checkpoint.pt"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    def read_json(self, name: str, default: Any = None) -> Any:
        p = self.path / name
        if not p.is_file():
            return default
        return json.loads(p.read_text(encoding="utf-8"))

    def write_json(self, name: str, obj: Any) -> None:
        if not self.writes:
            return
        atomic_write_text(self.path / name, json.dumps(obj, indent=1, default=_jsonable) + "\n")

    def append_metrics(self, record: dict[str, Any]) -> None:
        if not self.writes:
            return
        with open(self.metrics, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, default=_jsonable) + "\n")

    def metrics_size(self) -> int:
        return self.metrics.stat().st_size if self.metrics.exists() else 0

    def truncate_metrics(self, size: int) -> None:
        if self.writes and self.metrics.exists():
            with open(self.metrics, "r+b") as f:
                f.truncate(size)

    def save_checkpoint(self, state: dict[str, Any]) -> None:
        """Write the checkpoint to a temporary file, then move it into place: a kill or a
        full disk never leaves a broken ``checkpoint.pt``; the previous one survives."""
        if not self.writes:
            return
        tmp = self.checkpoint.with_name("checkpoint.pt.tmp")
        try:
            torch.save(state, tmp)
            os.replace(tmp, self.checkpoint)
        except OSError as err:  # e.g. no space left on device
            tmp.unlink(missing_ok=True)
            kept = (f"the previous checkpoint {self.checkpoint} is intact" if self.checkpoint.exists()
                    else "no earlier checkpoint exists")
            raise WriteError(f"cannot write {self.checkpoint}: {err.strerror or err}; {kept}. Free space "
                             f"in {self.path} and continue with --resume {self.path}") from None


    def discard_checkpoint(self) -> None:
        """Remove the checkpoint (its phase is done) and any half-written one a killed write
        left behind."""
        if self.writes:
            self.checkpoint.unlink(missing_ok=True)
            self.checkpoint.with_name("checkpoint.pt.tmp").unlink(missing_ok=True)


def read_checkpoint(path: Path) -> dict[str, Any]:
    """Load a run's checkpoint; a corrupt, truncated or foreign file is a :class:`ConfigError`
    that says how to go on (the run's other files stay as they are)."""
    fix = (f"delete {path} to restart the run from its beginning, or start a new run with "
           "another --out")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # torch raises many types for a damaged zip or pickle
        first = str(err).splitlines()[0] if str(err) else ""
        raise ConfigError(f"{path} is corrupt or truncated ({type(err).__name__}: {first[:120]}); "
                          f"{fix}") from None
    if not isinstance(ckpt, dict) or ckpt.get("version") != CHECKPOINT_VERSION:
        got = ckpt.get("version") if isinstance(ckpt, dict) else type(ckpt).__name__
        raise ConfigError(f"{path}: expected a dmscale checkpoint of version {CHECKPOINT_VERSION}, "
                          f"got version {got!r}; resume it with the dmscale version that wrote it, or {fix}")
    return ckpt


# ----------------------------------------------------------------------------- RNG
def rng_state() -> dict[str, Any]:
    """The state of every random generator a step may draw from."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ----------------------------------------------------------------------------- progress
class Progress:
    """A tqdm bar on a terminal; otherwise a log line every 10 % of the phase."""

    def __init__(self, phase: str, total: int, initial: int, quiet: bool) -> None:
        self.phase, self.total, self.quiet = phase, total, quiet
        self.tty = sys.stderr.isatty()
        self.start, self.initial = time.time(), initial
        self.next_line = initial + max(1, total // 10)
        self.bar = None
        self.text = ""
        if not quiet and self.tty:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=f"{phase:>8}", unit="step",
                            dynamic_ncols=True, leave=True, file=sys.stderr)

    def update(self, step: int, text: str) -> None:
        self.text = text
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(step - self.bar.n)
        elif not self.quiet and (step >= self.next_line or step == self.total):
            self.next_line = step + max(1, self.total // 10)
            rate = (time.time() - self.start) / max(1, step - self.initial)
            eta = rate * (self.total - step)
            print(f"{self.phase:>8} {step}/{self.total} | {text} | ETA {fmt_time(eta)}",
                  file=sys.stderr, flush=True)

    def finish_early(self, done: int) -> None:
        """The phase ended before ``total`` (its stop condition held): the bar ends there."""
        if self.bar is not None:
            self.bar.total = done

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def fmt_time(seconds: float) -> str:
    """3725 -> '1h02m05s'."""
    seconds = int(round(seconds))
    m, s = divmod(seconds, 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


# 12_345_678 -> '12.35M': the resources' display of a count
fmt_count = format_value
