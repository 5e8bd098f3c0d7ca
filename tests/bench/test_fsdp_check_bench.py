"""bench/fsdp_check.py (the FSDP2 check meant for 2 GPUs) in its CPU smoke form: two gloo
ranks under torchrun, a tiny Llama, every check passing, the one-process reference included."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from torchrun_util import run_group

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a torchrun launch of 2 ranks (~45 s on 2 cores)
def test_fsdp_check_quick_on_cpu(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)  # the script puts the checkout's src first itself
    proc = run_group([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                      "bench/fsdp_check.py", "--quick", "--device", "cpu", "--fp32", "--reference",
                      "--out", str(tmp_path)], cwd=ROOT, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "fsdp_check.json").read_text())
    assert result["ok"] and result["world"] == 2 and len(result["checks"]) == 8, result
