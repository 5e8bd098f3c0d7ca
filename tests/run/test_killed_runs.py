"""A killed search resumes to the result of an uninterrupted one (issue 12).

Each test runs ``python -m dmscale search`` on the tiny digits config (1 thread, seed 0) in
a subprocess and interrupts it in the middle of its first search epoch (4 steps per epoch,
a checkpoint every 2 steps):

* SIGKILL right after the first checkpoint appears: ``--resume`` continues from it;
* SIGKILL *while a checkpoint is being written* (``torch.save`` patched in the child to write
  half the file, then kill its own process): the previous checkpoint survives and
  ``--resume`` continues from it;
* SIGTERM / SIGINT: the run writes a checkpoint at the next step, says how to resume on one
  stderr line, and exits with 128 + the signal's number.

Either way the resumed run ends with the structure and weights of an uninterrupted run, and
no ``checkpoint.pt.tmp`` is left behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dmscale.cli import main

__all__: list[str] = []

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["search", "--task", "digits", "--model", "smallcnn", "--model-args", "width=4,blocks=2",
        "--train-limit", "256", "--test-limit", "64", "--batch-size", "64", "--threads", "1", "--quiet",
        "--structure-lr", "0.05", "--epochs", "3", "--retrain-epochs", "1", "--checkpoint-every", "2",
        "--seed", "0"]


def _start(out: Path, prelude: str | None = None) -> subprocess.Popen[str]:
    """``python -m dmscale ARGS --out OUT``; with ``prelude``, that code runs first in the
    child and the command line is then run by ``dmscale.cli.main`` (what ``-m dmscale`` calls)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    head = ["-m", "dmscale"] if prelude is None else [
        "-c", prelude + "\nimport sys\nfrom dmscale.cli import main\nsys.exit(main(sys.argv[1:]))"]
    return subprocess.Popen([sys.executable, *head, *ARGS, "--out", str(out)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# In the child: the second checkpoint write puts half its bytes on disk, then the process
# SIGKILLs itself, i.e. a kill lands in the middle of writing the checkpoint.
_KILL_MID_WRITE = textwrap.dedent("""
    import io, os, signal, torch
    _real_save, _writes = torch.save, []

    def _save(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)) and os.path.basename(f).startswith("checkpoint.pt"):
            _writes.append(f)
            if len(_writes) == 2:
                buf = io.BytesIO()
                _real_save(obj, buf, *args, **kwargs)
                with open(f, "wb") as fh:
                    fh.write(buf.getvalue()[: len(buf.getvalue()) // 2])
                    fh.flush()
                    os.fsync(fh.fileno())
                os.kill(os.getpid(), signal.SIGKILL)
        return _real_save(obj, f, *args, **kwargs)

    torch.save = _save
""")


def _wait_for(path: Path, proc: subprocess.Popen[str], timeout: float = 240.0) -> None:
    t0 = time.time()
    while not path.exists():
        assert proc.poll() is None, f"the run ended before {path.name} appeared: {proc.communicate()}"
        assert time.time() - t0 < timeout, f"no {path.name} after {timeout} s"
        time.sleep(0.01)


def _result(run: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    s = json.loads((run / "structure.json").read_text())
    return {k: s[k] for k in ("width", "depth", "layers")}, load_file(str(run / "model.safetensors"))


def _assert_same_result(a: Path, b: Path) -> None:
    (sa, wa), (sb, wb) = _result(a), _result(b)
    assert sa == sb, "the resumed run found another structure"
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), "weights differ"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("whole") / "run"
    assert main([*ARGS, "--out", str(out)]) == 0
    return out


def test_sigkill_mid_epoch_then_resume(uninterrupted: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = _start(out)
    _wait_for(out / "checkpoint.pt", proc)
    proc.kill()  # SIGKILL: no handler runs
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    state = json.loads((out / "state.json").read_text())
    assert state["status"] == "running" and not (out / "structure.json").exists()
    assert main(["search", "--resume", str(out), "--quiet"]) == 0
    assert not (out / "checkpoint.pt.tmp").exists()
    _assert_same_result(out, uninterrupted)


def test_sigkill_during_a_checkpoint_write_keeps_the_previous_one(uninterrupted: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = _start(out, _KILL_MID_WRITE)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, err
    partial = [p.name for p in out.iterdir() if p.name.startswith("checkpoint.pt.")]
    assert partial, "the kill did not land during a checkpoint write"
    state = torch.load(out / "checkpoint.pt", weights_only=False)  # the first one, whole
    assert state["global_step"] == 2
    assert json.loads((out / "state.json").read_text())["status"] == "running"
    # resumed without --checkpoint-every (it is per invocation), so no later write replaces the
    # half file: the end of the run removes it with the checkpoint
    assert main(["search", "--resume", str(out), "--quiet"]) == 0
    assert not [p.name for p in out.iterdir() if p.name.startswith("checkpoint.pt")]
    _assert_same_result(out, uninterrupted)


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)])  # one handler
def test_sigterm_and_sigint_stop_with_a_checkpoint(sig: int, uninterrupted: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = _start(out)
    _wait_for(out / "checkpoint.pt", proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=240)
    lines = err.strip().splitlines()
    assert proc.returncode == 128 + sig, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert signal.Signals(sig).name in lines[0] and f"--resume {out}" in lines[0], lines[0]
    state = json.loads((out / "state.json").read_text())
    assert state["status"] == "stopped" and state["global_step"] >= 2
    assert main(["search", "--resume", str(out), "--quiet"]) == 0
    _assert_same_result(out, uninterrupted)
