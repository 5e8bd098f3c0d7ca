"""Load a saved Hugging Face directory in a fresh Python process in which dmscale cannot be
imported, and return its logits, greedy tokens and (optionally) tokenizer ids."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any

import torch

_SCRIPT = r'''
import glob, importlib.abc, importlib.util, json, os, sys


class _BlockDMScale(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "dmscale" or name.startswith("dmscale."):
            raise ImportError("dmscale is blocked in this process")
        return None


sys.meta_path.insert(0, _BlockDMScale())
import torch

# the pinned CPU environment's torchvision build cannot load its C++ ops; transformers imports
# torchvision, so load them, or where they cannot load declare the two operator schemas it
# needs at import (an environment fix, not dmscale's; declaring them beside a torchvision that
# loads would register them twice, a crash of torch 2.11 + torchvision 0.26)
_tv = importlib.util.find_spec("torchvision")
if _tv is not None:
    try:
        torch.ops.load_library(glob.glob(os.path.join(list(_tv.submodule_search_locations)[0], "_C*.so"))[0])
    except (IndexError, OSError, RuntimeError):
        _lib = torch.library.Library("torchvision", "DEF")
        _lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
from transformers import AutoModelForCausalLM, AutoTokenizer

jobs, ids_json, new_tokens, text, out = json.loads(sys.argv[1]), *sys.argv[2:6]
ids = torch.tensor(json.loads(ids_json))
results = []
for path, remote in jobs:
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=remote, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        tokens = model.generate(ids, max_new_tokens=int(new_tokens), do_sample=False)
    result = {"logits": logits, "tokens": tokens, "class": type(model).__name__}
    if text:
        result["text_ids"] = AutoTokenizer.from_pretrained(path)(text)["input_ids"]
    results.append(result)
    del model
loaded = any(m == "dmscale" or m.startswith("dmscale.") for m in sys.modules)
torch.save([dict(r, dmscale_loaded=loaded) for r in results], out)
'''


def load_fresh(jobs: list[tuple[str, bool]], ids: torch.Tensor, new_tokens: int = 8,
               text: str = "") -> list[dict[str, Any]]:
    """Load each ``(directory, trust_remote_code)`` in one subprocess without dmscale (and
    without PYTHONPATH); per directory: logits and greedy tokens for ``ids``, and the
    tokenizer's ids of ``text`` when given."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cache = tempfile.mkdtemp(prefix="hf_modules_")
    env.update(HF_MODULES_CACHE=cache, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               TRANSFORMERS_VERBOSITY="error")
    out = os.path.join(cache, "result.pt")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps([[str(p), bool(r)] for p, r in jobs]),
                           json.dumps(ids.tolist()), str(new_tokens), text, out],
                          env=env, capture_output=True, text=True, timeout=600, cwd=cache)
    if proc.returncode != 0:
        raise AssertionError(f"fresh process failed:\n{proc.stderr[-4000:]}")
    return torch.load(out, weights_only=False)
