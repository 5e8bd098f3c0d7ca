"""``import dmscale`` makes a later ``import torchvision`` work by itself (src/dmscale/core/_compat.py),
without importing torchvision at ``import dmscale`` and without public API."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})


def test_import_torchvision_after_dmscale_works_and_the_hook_steps_aside():
    done = _run("import sys, dmscale\n"
                "assert 'torchvision' not in sys.modules\n"
                "import torchvision\n"
                "torchvision.models.resnet18()\n"
                "from dmscale.core._compat import _BeforeTorchvision\n"
                "assert not any(isinstance(f, _BeforeTorchvision) for f in sys.meta_path)\n"
                "assert 'ensure_torchvision' not in dmscale.__all__\n"
                "print('ok')")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
