"""Ultralytics YOLO: supernets from yaml, deployable checkpoints, finetuning at the pruned size.

Three facts of Ultralytics 8.4 shape this module:

* ``YOLO(path)`` unpickles the checkpoint's ``DetectionModel``; with ``ULTRALYTICS_SAFE_LOAD``
  it allows only torch and Ultralytics classes. :func:`save_yolo_checkpoint` therefore writes
  a model made of those classes alone (a removed residual block becomes ``nn.Identity``) and
  checks the written file for any other global.
* ``YOLO(path).train()`` rebuilds the network from ``model.yaml`` and copies the weights whose
  shapes match, so a pruned model silently returns to full size.
  :class:`PrunedDetectionTrainer` keeps the loaded module instead.
* Ultralytics' ``predict``/``val`` call ``torchvision.ops.nms``; where torchvision's compiled
  extension does not load (this project's CPU environment), :func:`ensure_nms` registers a
  pure-torch CPU kernel for it.

Example:
    >>> import torch, dmscale as dms
    >>> model = build_yolo("yolov8n.yaml", nc=10, expand={"width": 1.5, "depth": 1.0})
    >>> model.model[0].conv.out_channels   # yolov8n's 16 stem channels, widened 1.5x
    24
    >>> model.yaml["scales"]["n"][:2]
    [0.33, 0.375]
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import io
import logging
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn

from dmscale.core._compat import ensure_torchvision
from dmscale.core.errors import (
    ConfigError,
    DataError,
    StandaloneError,
    StructureError,
    UnsupportedLayerError,
    VerificationError,
)

__all__ = [
    "build_yolo",
    "ensure_nms",
    "load_yolo_checkpoint",
    "nms_reference",
    "quiet",
    "PrunedDetectionTrainer",
    "save_yolo_checkpoint",
    "to_ultralytics_module",
]

_NMS_LIB: torch.library.Library | None = None


def _import_ultralytics() -> None:
    """Import Ultralytics without keeping the global numpy/torch print options its import sets
    (a user's printed arrays and tensors look as before)."""
    from torch._tensor_str import PRINT_OPTS

    np_options, torch_options = np.get_printoptions(), copy.copy(vars(PRINT_OPTS))
    ensure_torchvision()
    try:
        import ultralytics  # noqa: F401
    finally:
        np.set_printoptions(**np_options)
        vars(PRINT_OPTS).update(torch_options)


_import_ultralytics()


def nms_reference(boxes: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    """Greedy non-maximum suppression with ``torchvision.ops.nms``'s contract: indices of the
    kept ``xyxy`` boxes, by decreasing score; a box is dropped when its IoU with a kept box
    is above ``iou_threshold``.

    Example:
        >>> b = torch.tensor([[0., 0, 10, 10], [1, 1, 10, 10], [20, 20, 30, 30]])
        >>> nms_reference(b, torch.tensor([0.9, 0.8, 0.7]), 0.5).tolist()
        [0, 2]
    """
    if boxes.numel() == 0:
        return torch.empty(0, dtype=torch.long, device=boxes.device)
    order = scores.argsort(descending=True, stable=True)
    b = boxes[order].float()
    area = (b[:, 2] - b[:, 0]).clamp(min=0) * (b[:, 3] - b[:, 1]).clamp(min=0)
    lt = torch.maximum(b[:, None, :2], b[None, :, :2])
    rb = torch.minimum(b[:, None, 2:], b[None, :, 2:])
    inter = (rb - lt).clamp(min=0).prod(-1)
    iou = inter / (area[:, None] + area[None, :] - inter).clamp(min=1e-12)
    # the greedy pass in numpy: Ultralytics' NMS has a time limit per batch, past which it
    # drops the remaining images' detections, so a slow kernel would change the metric
    over = (iou > iou_threshold).cpu().numpy()
    suppressed = np.zeros(len(b), dtype=bool)
    keep = []
    for i in range(len(b)):
        if suppressed[i]:
            continue
        keep.append(i)
        suppressed |= over[i]
    return order[torch.tensor(keep, dtype=torch.long, device=order.device)]


def ensure_nms() -> bool:
    """Give ``torchvision::nms`` a CPU kernel when torchvision's extension did not load.

    Returns True when a kernel was registered now, False when one already existed (or
    torchvision is not installed). Only ``nms`` is provided; other compiled torchvision ops
    (``roi_align`` ...) stay unavailable.
    """
    global _NMS_LIB
    if not ensure_torchvision():
        return False
    if torch._C._dispatch_has_kernel_for_dispatch_key("torchvision::nms", "CPU"):
        return False
    import torchvision.ops.boxes as tv_boxes

    _NMS_LIB = torch.library.Library("torchvision", "IMPL", "CPU")
    _NMS_LIB.impl("nms", nms_reference)
    # torchvision's Python nms() first asserts that its extension loaded; the kernel is there now
    tv_boxes._assert_has_ops = lambda: None
    return True


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence Ultralytics' info logging and prints (dataset scans, "Overriding nc" ...)."""
    logger = logging.getLogger("ultralytics")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logger.setLevel(level)


def build_yolo(spec: str, nc: int, expand: dict[str, float] | None = None,
               names: dict[int, str] | None = None) -> nn.Module:
    """A YOLO ``DetectionModel`` from an Ultralytics model yaml (``yolov8n.yaml``,
    ``yolo11n.yaml``, or a yaml file of your own) or a checkpoint (``.pt``), for ``nc`` classes.

    ``expand`` multiplies the yaml's width and depth multiples (the supernet of the paper's
    DMS_np, e.g. ``{"width": 1.5, "depth": 1.5}``); a checkpoint cannot be expanded. The model
    gets Ultralytics' default hyper-parameters as ``model.args`` (the loss reads them) and
    ``model.names``.

    Raises:
        ConfigError: an unknown yaml, ``expand`` on a checkpoint, or a checkpoint whose
            number of classes differs from ``nc``.
    """
    ensure_torchvision()
    from ultralytics.cfg import get_cfg
    from ultralytics.nn.tasks import DetectionModel, yaml_model_load

    if spec.endswith(".pt"):
        if expand and (expand.get("width", 1.0) != 1.0 or expand.get("depth", 1.0) != 1.0):
            raise ConfigError(f"--expand needs a model yaml, not the checkpoint {spec}: search the "
                              "checkpoint as it is, or start from its yaml (random weights)")
        model = load_yolo_checkpoint(spec)
        if int(model.model[-1].nc) != nc:
            raise ConfigError(f"{spec} detects {model.model[-1].nc} classes, the dataset has {nc}: give a "
                              "checkpoint trained on this dataset, or the yaml (e.g. yolov8n.yaml)")
    else:
        try:
            cfg = yaml_model_load(spec)
        except (FileNotFoundError, OSError) as err:
            raise ConfigError(f"no Ultralytics model yaml {spec!r} ({err}); try yolov8n.yaml or "
                              "yolo11n.yaml") from None
        scale = cfg.get("scale") or next(iter(cfg.get("scales") or {"": None}))
        if expand:
            if "scales" in cfg and scale in cfg["scales"]:
                depth, width, *rest = cfg["scales"][scale]
                cfg["scales"][scale] = [depth * expand.get("depth", 1.0), width * expand.get("width", 1.0), *rest]
            else:
                cfg["depth_multiple"] = cfg.get("depth_multiple", 1.0) * expand.get("depth", 1.0)
                cfg["width_multiple"] = cfg.get("width_multiple", 1.0) * expand.get("width", 1.0)
        with quiet():
            model = DetectionModel(cfg, ch=3, nc=nc, verbose=False)
    model.args = get_cfg()
    model.names = dict(names) if names is not None else {i: str(i) for i in range(nc)}
    return model


def load_yolo_checkpoint(path: str | Path) -> nn.Module:
    """The ``DetectionModel`` of an Ultralytics checkpoint (its EMA when it has one), float32."""
    ensure_torchvision()
    from ultralytics.nn.tasks import torch_safe_load

    with quiet():
        ckpt, _ = torch_safe_load(str(path))
    model = ckpt.get("ema") or ckpt.get("model")
    if not isinstance(model, nn.Module) or not hasattr(model, "model"):
        raise DataError(f"{path} holds no Ultralytics model (keys: {sorted(ckpt)})")
    return model.float()


def to_ultralytics_module(model: nn.Module) -> nn.Module:
    """``model`` (changed in place and returned) with every dmscale module replaced by its
    torch equivalent: a removed residual block (``SkipBlock``) becomes ``nn.Identity`` (or
    its post-add activation).

    Raises:
        UnsupportedLayerError: a dmscale module with no torch equivalent, naming it.
        StandaloneError: a dmscale module is left in the model.
    """
    from dmscale.export.shrink import SkipBlock

    for name, child in list(model.named_modules()):
        for attr, sub in list(child.named_children()):
            if not isinstance(sub, SkipBlock):
                continue
            if sub.output is not None:
                raise UnsupportedLayerError(f"{name + '.' if name else ''}{attr}: a removed block that packs its "
                                            "output has no torch equivalent; keep it (--exclude) to deploy")
            setattr(child, attr, nn.Identity() if sub.post is None else sub.post)
    _sync_split_widths(model)
    foreign = sorted({type(m).__module__ + "." + type(m).__qualname__ for m in model.modules()
                      if type(m).__module__.split(".")[0] == "dmscale"})
    if foreign:
        raise StandaloneError(f"the model still holds dmscale modules {foreign}: it would not load "
                              "without dmscale")
    return model


def _sync_split_widths(model: nn.Module) -> None:
    """Ultralytics' exporter runs ``C2f``-family blocks through ``forward_split``, which splits
    ``cv1``'s output at ``self.c`` (the unpruned half width); set it to the pruned half and
    check that both forward paths of the whole model agree."""
    from ultralytics.nn.modules.block import C2f

    blocks = [(n, m) for n, m in model.named_modules() if isinstance(m, C2f)]
    for name, m in blocks:
        width = m.cv1.conv.out_channels
        if width % 2:
            raise StructureError(f"{name}: cv1 keeps {width} channels, which C2f cannot split in two halves")
        m.c = width // 2
    if not blocks:
        return
    x = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    was = model.training
    model.eval()
    with torch.no_grad():
        ref = model(x)[0]
        for _, m in blocks:
            m.forward = m.forward_split
        try:
            other = model(x)[0]
        finally:
            for _, m in blocks:
                del m.forward
    model.train(was)
    if not torch.allclose(ref, other, rtol=1e-4, atol=1e-4):
        raise VerificationError("the pruned model's C2f blocks compute differently through forward_split "
                                f"(max difference {float((ref - other).abs().max()):.3g})")


def save_yolo_checkpoint(model: nn.Module, path: str | Path, train_args: dict[str, Any] | None = None) -> Path:
    """Write ``model`` (a pruned ``DetectionModel``, left unchanged) as an Ultralytics checkpoint
    that ``ultralytics.YOLO(path)`` loads without dmscale.

    Raises:
        StandaloneError: the model holds a class from outside torch and Ultralytics.
    """
    small = to_ultralytics_module(copy.deepcopy(model)).float().eval()
    for m in small.modules():
        m._forward_hooks.clear()
        m._forward_pre_hooks.clear()
    if hasattr(small, "args"):
        small.args = dict(vars(small.args)) if not isinstance(small.args, dict) else dict(small.args)
    if hasattr(small, "criterion"):
        small.criterion = None
    for p in small.parameters():
        p.requires_grad_(False)
    import ultralytics

    ckpt = {
        "date": datetime.datetime.now().isoformat(),
        "version": ultralytics.__version__,
        "license": "AGPL-3.0 License (https://ultralytics.com/license)",
        "docs": "https://docs.ultralytics.com",
        "epoch": -1, "best_fitness": None, "model": small, "ema": None, "updates": None,
        "optimizer": None, "train_args": dict(train_args or {}),
    }
    out = Path(path)
    tmp = out.with_name(out.name + ".tmp")
    torch.save(ckpt, tmp)
    others = [g for g in torch.serialization.get_unsafe_globals_in_checkpoint(str(tmp))
              if not g.startswith(("torch.", "ultralytics.", "collections.", "builtins.", "numpy."))]
    if others:
        tmp.unlink()
        raise StandaloneError(f"{out.name} would need classes from outside torch and Ultralytics: {others}")
    tmp.replace(out)
    return out


def _trainer_base() -> type:
    ensure_torchvision()
    from ultralytics.models.yolo.detect import DetectionTrainer

    return DetectionTrainer


class PrunedDetectionTrainer(_trainer_base()):  # type: ignore[misc]
    """Ultralytics' ``DetectionTrainer`` that trains the loaded (pruned) model as it is,
    instead of rebuilding the full-size network from its yaml.

    Example (not run here: it trains):
        >>> from ultralytics import YOLO                                        # doctest: +SKIP
        >>> from dmscale.integrations.ultralytics import PrunedDetectionTrainer  # doctest: +SKIP
        >>> YOLO("runs/yolo/yolo.pt").train(data="data.yaml", epochs=10, imgsz=64,
        ...                                 trainer=PrunedDetectionTrainer)       # doctest: +SKIP

    Raises:
        ConfigError: no model was loaded (``YOLO("x.yaml")``), or the model's number of
            classes differs from the dataset's.
    """

    def get_model(self, cfg: Any = None, weights: nn.Module | None = None, verbose: bool = True) -> nn.Module:
        if not isinstance(weights, nn.Module):
            raise ConfigError("PrunedDetectionTrainer finetunes a loaded model: use "
                              "YOLO('RUN/yolo.pt').train(..., trainer=PrunedDetectionTrainer)")
        model = copy.deepcopy(weights).float()
        nc = int(self.data["nc"])
        if int(model.model[-1].nc) != nc:
            raise ConfigError(f"the pruned model detects {model.model[-1].nc} classes, the dataset {nc}: "
                              "finetune on the dataset it was searched on")
        for p in model.parameters():
            p.requires_grad_(True)
        if verbose:
            n = sum(p.numel() for p in model.parameters())
            print(f"PrunedDetectionTrainer: finetuning the loaded model as it is ({n:,} parameters)")
        return model
