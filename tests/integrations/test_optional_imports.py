"""The trainer integrations import without their frameworks; using one names the extra."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import dmscale as dms

_SCRIPT = r'''
import importlib.abc, sys

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("transformers", "lightning", "pytorch_lightning", "accelerate"):
            raise ImportError(f"{name} is blocked in this process")

sys.meta_path.insert(0, Block())
from dmscale.integrations import hf_trainer, lightning
from dmscale.core.errors import MissingDependencyError
for module, name, extra in ((hf_trainer, "DMSTrainer", "hf"), (lightning, "DMSCallback", "lightning")):
    try:
        getattr(module, name)
    except MissingDependencyError as err:
        assert f"pip install 'dmscale[{extra}]'" in str(err), str(err)
    else:
        raise AssertionError(f"{name} built without its framework")
print("ok")
'''


def test_integrations_import_without_frameworks_and_name_the_extra():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(dms.__file__).parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]
