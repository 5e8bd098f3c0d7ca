"""Import fix-ups for the pinned CPU environment.

torchvision 0.28.0 (the only build matching torch 2.13.0) ships a compiled extension that
cannot load on a CPU-only torch; its Python code then fails at import with
"operator torchvision::nms does not exist". :func:`ensure_torchvision` loads the extension
when it can and otherwise declares the schemas of the two operators that torchvision
registers fake kernels for at import, so models, transforms and datasets import and work
(only the C++ detection ops such as ``nms`` stay unavailable).

``import dmscale`` installs :func:`install_torchvision_fix`: an import hook that runs
:func:`ensure_torchvision` once, right before torchvision is first imported. On an install
whose torchvision loads, that only loads its extension a moment earlier than torchvision
would; nothing here is public API.

Example:
    >>> from dmscale.core._compat import ensure_torchvision
    >>> ensure_torchvision()
    True
"""

from __future__ import annotations

import glob
import importlib.abc
import importlib.util
import os
import sys

import torch

__all__ = ["ensure_torchvision", "install_torchvision_fix"]

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


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    """Runs :func:`ensure_torchvision` when ``torchvision`` is about to be imported, then
    steps aside (it finds nothing itself; the normal finders import the package)."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
        if fullname == "torchvision":
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            ensure_torchvision()
        return None


def install_torchvision_fix() -> None:
    """Make the next ``import torchvision`` work in an environment whose extension cannot
    load (see the module docstring); nothing when torchvision is imported already."""
    if "torchvision" in sys.modules or any(isinstance(f, _BeforeTorchvision) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _BeforeTorchvision())
