"""Import fix-ups for the pinned CPU environment.

torchvision 0.28.0 (the only build matching torch 2.13.0) ships a compiled extension that
cannot load on a CPU-only torch; its Python code then fails at import with
"operator torchvision::nms does not exist". :func:`ensure_torchvision` loads the extension
when it can and otherwise declares the schemas of the two operators that torchvision
registers fake kernels for at import, so models, transforms and datasets import and work
(only the C++ detection ops such as ``nms`` stay unavailable).

Example:
    >>> from dmscale.core._compat import ensure_torchvision
    >>> ensure_torchvision()
    True
"""

from __future__ import annotations

import glob
import importlib.util
import os

import torch

__all__ = ["ensure_torchvision"]

_DONE: bool | None = None
_LIB: torch.library.Library | None = None


def _declare_schemas() -> None:
    global _LIB
    _LIB = torch.library.Library("torchvision", "DEF")
    _LIB.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _LIB.define(
        "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"
    )


def ensure_torchvision() -> bool:
    """Make ``import torchvision`` work; returns False when torchvision is not installed."""
    global _DONE
    if _DONE is not None:
        return _DONE
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        _DONE = False
        return False
    try:
        torch.ops.torchvision.nms  # already registered (a working build or an earlier fix)
        _DONE = True
        return True
    except (AttributeError, RuntimeError):
        pass
    root = list(spec.submodule_search_locations)[0]
    libs = glob.glob(os.path.join(root, "_C*.so")) + glob.glob(os.path.join(root, "_C*.pyd"))
    try:
        if not libs:
            raise OSError("no compiled torchvision extension")
        torch.ops.load_library(libs[0])
    except (OSError, RuntimeError):
        _declare_schemas()
    _DONE = True
    return True
