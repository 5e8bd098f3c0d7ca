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

from .errors import MissingFileError, StructureError
from .export import apply_structure

__all__ = ["save", "load", "save_weights", "load_weights", "STRUCTURE_FILE", "WEIGHTS_FILE"]

STRUCTURE_FILE = "structure.json"
WEIGHTS_FILE = "model.safetensors"


def save_weights(model: nn.Module, path: str | os.PathLike[str]) -> None:
    """Write ``model``'s weights as safetensors, atomically (tied tensors stored once)."""
    from safetensors.torch import save_model

    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    save_model(model, str(tmp), force_contiguous=True)
    os.replace(tmp, p)


def load_weights(model: nn.Module, path: str | os.PathLike[str]) -> nn.Module:
    """Load safetensors weights into ``model`` (strict); a clear error when they do not fit."""
    from safetensors.torch import load_model

    p = Path(path)
    if not p.is_file():
        raise MissingFileError(f"no weights file {p}: expected model.safetensors written by dmscale.save")
    try:
        load_model(model, str(p), strict=True)
    except RuntimeError as err:
        lines = str(err).strip().splitlines()
        raise StructureError(f"weights in {p} do not fit the model: "
                         f"{' '.join(s.strip() for s in lines[:3])[:300]}") from None
    return model


def save(model: nn.Module, structure: dict[str, Any], directory: str | os.PathLike[str]) -> None:
    """Write ``structure.json`` and ``model.safetensors`` of an exported model."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (STRUCTURE_FILE + ".tmp")
    tmp.write_text(json.dumps(structure, indent=1))
    os.replace(tmp, out / STRUCTURE_FILE)
    save_weights(model, out / WEIGHTS_FILE)


def load(model: nn.Module, directory: str | os.PathLike[str]) -> nn.Module:
    """Shrink ``model`` (built like the original supernet) to the saved structure and load
    the saved weights; returns ``model``."""
    src = Path(directory)
    for name in (STRUCTURE_FILE, WEIGHTS_FILE):
        if not (src / name).is_file():
            raise MissingFileError(f"{src / name} is missing: expected a directory written by dmscale.save")
    try:
        structure = json.loads((src / STRUCTURE_FILE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise StructureError(f"{src / STRUCTURE_FILE} is not valid JSON ({err}): save the model "
                             "again with dmscale.save") from None
    apply_structure(model, structure)
    return load_weights(model, src / WEIGHTS_FILE)
