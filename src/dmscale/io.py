"""Save a pruned model as safetensors weights plus its structure, and load it back.

The directory holds ``structure.json`` (what :func:`dmscale.apply_structure` needs) and
``model.safetensors`` (tied weights stored once). Loading rebuilds the shapes on a model
built from the *original* architecture (e.g. the same Hugging Face config) and then loads
the weights strictly. Files are written to a temporary name and renamed, so an interrupted
save never leaves a half-written file.

Example:
    >>> import tempfile, torch
    >>> from torch import nn
    >>> import dmscale as dms
    >>> net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    >>> searcher = dms.prepare(net, torch.randn(1, 8), dms.SearchConfig(resource="params", target=0.5))
    >>> _ = searcher.meet_target()
    >>> small, structure = searcher.export(), searcher.structure()
    >>> d = tempfile.mkdtemp()
    >>> dms.save(small, structure, d)
    >>> again = dms.load(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)), d)
    >>> torch.equal(again[0].weight, small[0].weight)
    True
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from torch import nn

from .export import apply_structure

__all__ = ["save", "load", "STRUCTURE_FILE", "WEIGHTS_FILE"]

STRUCTURE_FILE = "structure.json"
WEIGHTS_FILE = "model.safetensors"


def save(model: nn.Module, structure: dict[str, Any], directory: str | os.PathLike[str]) -> None:
    """Write ``structure.json`` and ``model.safetensors`` of an exported model."""
    from safetensors.torch import save_model

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (STRUCTURE_FILE + ".tmp")
    tmp.write_text(json.dumps(structure, indent=1))
    os.replace(tmp, out / STRUCTURE_FILE)
    tmp = out / (WEIGHTS_FILE + ".tmp")
    save_model(model, str(tmp))
    os.replace(tmp, out / WEIGHTS_FILE)


def load(model: nn.Module, directory: str | os.PathLike[str]) -> nn.Module:
    """Shrink ``model`` (built like the original supernet) to the saved structure and load
    the saved weights; returns ``model``."""
    from safetensors.torch import load_model

    src = Path(directory)
    for name in (STRUCTURE_FILE, WEIGHTS_FILE):
        if not (src / name).is_file():
            raise FileNotFoundError(f"{src / name} is missing: expected a directory written by dmscale.save")
    structure = json.loads((src / STRUCTURE_FILE).read_text())
    apply_structure(model, structure)
    load_model(model, str(src / WEIGHTS_FILE), strict=True)
    return model
