"""Object detection with Ultralytics YOLO (``--task detect``), on dmscale's pipelines.

Why dmscale's own loop rather than a subclass of Ultralytics' ``DetectionTrainer``: the
pipelines np / p / p- (pretrain, search, finish, retrain phases), resumable checkpoints,
the budget schedule and its finish phase, batch-norm recalibration and the report already
live in :mod:`dmscale.run.pipeline`; a trainer subclass would have to re-create each of them
inside Ultralytics' epoch loop. So this task plugs Ultralytics' *pieces* into that loop:

* data: Ultralytics' ``YOLODataset`` with its training augmentation (mosaic, HSV, flips;
  ``--augment`` sets its hyperparameters, e.g. ``fliplr=0`` for digits, which a mirror changes),
  read from any Ultralytics dataset YAML; batch ``step`` is a pure function of
  ``(seed, step)`` (the augmentation RNG is seeded per batch), so a resumed run sees the
  batches it would have seen;
* loss: Ultralytics' ``v8DetectionLoss`` (box, class and DFL terms, task-aligned assigner);
* metric: Ultralytics' ``DetectionValidator`` computes mAP50-95 on the val split.

The model's training output ``{"boxes", "scores", "feats"}`` travels through the loop as
one tensor ``cat(boxes, scores)`` (shape ``B x (4 reg_max + nc) x anchors``); the targets as
one ``N x 6`` tensor ``(image, class, x, y, w, h)``.

Example:
    >>> import tempfile
    >>> from dmscale.config.run_config import RunConfig
    >>> from dmscale.data import MnistDetectConfig, make_mnist_detect
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     data = make_mnist_detect(tmp, MnistDetectConfig(train=4, val=2))["yaml"]
    ...     task = DetectTask(RunConfig(task="detect", data=data, image_size=64).resolved())
    ...     x, y = task.train_batch(step=0, batch_size=2, seed=0)
    >>> tuple(x.shape), y.shape[1], task.info["nc"]
    ((2, 3, 64, 64), 6, 10)
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dmscale.config.run_config import ConfigError, RunConfig
from dmscale.tasks.registry import Task, _epoch_permutation, register_models, register_task

__all__ = ["DetectTask", "build_detect_model", "DEFAULT_IMGSZ", "AUGMENT_KEYS"]

DEFAULT_IMGSZ = 64
# Ultralytics' training-augmentation hyperparameters (its cfg/default.yaml) that --augment may set
AUGMENT_KEYS = ("hsv_h", "hsv_s", "hsv_v", "degrees", "translate", "scale", "shear", "perspective",
                "flipud", "fliplr", "bgr", "mosaic", "mixup", "cutmix", "copy_paste")
VAL_BATCH = 32  # the val set's rectangular batches are laid out for this batch size


def _ultralytics() -> None:
    try:
        from dmscale.integrations.ultralytics import ensure_nms
    except ModuleNotFoundError as err:
        raise ConfigError(f"--task detect needs Ultralytics ({err}): pip install 'dmscale[yolo]' "
                          "(Ultralytics is AGPL-3.0)") from None
    ensure_nms()


@register_task("detect")
class DetectTask(Task):
    """YOLO detection on an Ultralytics dataset YAML (``--data``); metric mAP50-95."""

    name = "detect"
    kind = "detection"
    metric = "map50_95"

    def __init__(self, cfg: RunConfig) -> None:
        _ultralytics()
        from ultralytics.cfg import get_cfg
        from ultralytics.data import build_yolo_dataset
        from ultralytics.data.utils import check_det_dataset

        if cfg.data is None:
            raise ConfigError("--task detect needs --data DATA.yaml (an Ultralytics dataset YAML); "
                              "make one offline with `dmscale data mnist-detect --out DIR`")
        if cfg.teacher:
            raise ConfigError("--teacher is not supported for --task detect (no detection distillation yet)")
        imgsz = int(cfg.image_size or DEFAULT_IMGSZ)
        if imgsz % 32:
            raise ConfigError(f"--image-size {imgsz}: YOLO needs a multiple of its stride 32; "
                              f"use e.g. --image-size {32 * max(1, round(imgsz / 32))}")
        path = Path(cfg.data)
        if not path.is_file():
            raise ConfigError(f"--data {path}: no such dataset YAML")
        from dmscale.integrations.ultralytics import quiet

        try:
            with quiet():
                self.data = check_det_dataset(str(path), autodownload=False)
        except Exception as err:  # Ultralytics raises FileNotFoundError, SyntaxError, KeyError ...
            raise ConfigError(f"--data {path}: {str(err).strip().splitlines()[0]}") from None
        self.imgsz = imgsz
        augment = _augment_overrides(cfg.augment)
        try:
            self.args = get_cfg(overrides={"imgsz": imgsz, "task": "detect", "data": str(path), "workers": 0,
                                           "plots": False, "verbose": False, "cache": False, **augment})
        except (TypeError, ValueError) as err:  # Ultralytics checks each value's type and range
            raise ConfigError(f"--augment {cfg.augment}: {err}") from None
        with quiet():
            self.train_set = build_yolo_dataset(self.args, self.data["train"], 16, self.data, mode="train")
            self.val_set = build_yolo_dataset(self.args, self.data["val"], VAL_BATCH, self.data, mode="val",
                                              rect=True)  # as Ultralytics validates: rectangular, padded batches
        if cfg.train_limit:
            self.train_set.im_files = self.train_set.im_files[:cfg.train_limit]
            self.train_set.labels = self.train_set.labels[:cfg.train_limit]
            self.train_set.ni = len(self.train_set.labels)
        self.n_train = len(self.train_set)
        _draw_partners_from_all(self.train_set.transforms)
        self.test_limit = cfg.test_limit
        names = {int(k): str(v) for k, v in self.data["names"].items()}
        self.info = {"kind": "detection", "in_channels": 3, "image_size": [imgsz, imgsz],
                     "nc": int(self.data["nc"]), "names": names, "data": str(path.resolve())}
        self._criterion: Any = None
        self._criterion_key: Any = None
        self._shapes: list[tuple[int, int]] | None = None

    # ---------------------------------------------------------------- data
    def example_inputs(self) -> torch.Tensor:
        return torch.zeros(1, 3, self.imgsz, self.imgsz)

    def steps_per_epoch(self, batch_size: int) -> int:
        return max(1, self.n_train // batch_size)

    def train_batch(self, step: int, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        spe = self.steps_per_epoch(batch_size)
        epoch, k = divmod(step, spe)
        perm = _epoch_permutation(self.n_train, epoch, seed)
        idx = perm[k * batch_size:(k + 1) * batch_size]
        if len(idx) < batch_size:  # fewer images than a batch: draw with wrap-around
            idx = perm.repeat(math.ceil(batch_size / self.n_train))[:batch_size]
        py_state, np_state = random.getstate(), np.random.get_state()
        try:  # Ultralytics' augmentation draws from the global python/numpy RNGs
            random.seed(seed * 1_000_003 + step)
            np.random.seed((seed * 1_000_003 + step) % 2**32)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed * 1_000_003 + step)
                items = [self.train_set[int(i)] for i in idx]
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)
        batch = type(self.train_set).collate_fn(items)
        x = batch["img"].float() / 255.0
        y = torch.cat([batch["batch_idx"].view(-1, 1).float(), batch["cls"].view(-1, 1).float(),
                       batch["bboxes"].float()], 1)
        return x, y

    # ---------------------------------------------------------------- model and loss
    def forward(self, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        """``cat(boxes, scores)`` of the model's training output (eval mode: of its second
        element); the feature-map shapes are kept for :meth:`task_loss`."""
        self._set_criterion(model)
        out = model(inputs)
        preds = out[1] if isinstance(out, tuple) else out
        self._shapes = [tuple(f.shape[2:]) for f in preds["feats"]]
        return torch.cat([preds["boxes"], preds["scores"]], 1)

    def _set_criterion(self, model: nn.Module) -> None:
        from ultralytics.utils.loss import v8DetectionLoss

        head = model.model[-1]
        device = next(model.parameters()).device
        key = (int(head.nc), int(head.reg_max), tuple(head.stride.tolist()), str(device))
        if key != self._criterion_key:
            self._criterion, self._criterion_key = v8DetectionLoss(model), key

    def task_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Ultralytics' detection loss (box + class + DFL, gains from its defaults), summed and
        averaged over the batch."""
        crit = self._criterion
        if crit is None or self._shapes is None:
            raise RuntimeError("DetectTask.task_loss needs the outputs of DetectTask.forward")
        boxes, scores = logits.split([4 * crit.reg_max, crit.nc], 1)
        feats = [logits.new_empty((0, 0, h, w)) for h, w in self._shapes]
        batch = {"batch_idx": targets[:, 0], "cls": targets[:, 1:2], "bboxes": targets[:, 2:6]}
        loss, _ = crit.loss({"boxes": boxes, "scores": scores, "feats": feats}, batch)
        return loss.sum() / logits.shape[0]

    def batch_metric(self, logits: torch.Tensor, targets: torch.Tensor) -> float:
        """No per-batch detection metric (mAP needs the whole val split): NaN."""
        return float("nan")

    # ---------------------------------------------------------------- evaluation
    @torch.no_grad()
    def evaluate(self, model: nn.Module, batch_size: int = 256, device: torch.device | str = "cpu",
                 limit: int | None = None) -> dict[str, float]:
        """mAP50-95, mAP50, precision and recall of Ultralytics' ``DetectionValidator`` on the
        val split (the first ``limit`` images, or ``--test-limit``), with the model as it is
        (not fused: a supernet under search keeps its hooks)."""
        from ultralytics.data import build_dataloader

        limit = limit if limit is not None else self.test_limit
        v = _untimed_validator()(args={**vars(self.args), "mode": "val", "batch": VAL_BATCH,
                                     "conf": 0.001, "iou": 0.7, "save_json": False, "save_txt": False})
        v.device, v.data, v.training = torch.device(device), self.data, True
        v.args.quantize = None
        v.dataloader = build_dataloader(self.val_set, VAL_BATCH, 0, shuffle=False, rank=-1)
        was = model.training
        model.eval()
        seen = 0
        try:
            v.init_metrics(model)
            v.end2end = False
            for batch in v.dataloader:
                batch = v.preprocess(batch)
                preds = v.postprocess(model(batch["img"]))
                v.update_metrics(preds, batch)
                seen += len(batch["img"])
                if limit is not None and seen >= limit:
                    break
            stats = v.get_stats()
        finally:
            model.train(was)
        return {"map50_95": float(stats["metrics/mAP50-95(B)"]), "map50": float(stats["metrics/mAP50(B)"]),
                "precision": float(stats["metrics/precision(B)"]), "recall": float(stats["metrics/recall(B)"]),
                "examples": seen}

    def describe(self) -> str:
        return (f"detect: {self.n_train} training / {len(self.val_set)} val images of {self.imgsz} px, "
                f"{self.info['nc']} classes ({self.info['data']})")

    def format_metrics(self, metrics: dict[str, float]) -> str:
        return f"mAP50-95 {100 * metrics['map50_95']:.2f}, mAP50 {100 * metrics['map50']:.2f}"

    # ---------------------------------------------------------------- deployment
    def save_artifacts(self, model: nn.Module, run_dir: str | Path) -> list[str]:
        """Write ``yolo.pt``, the Ultralytics checkpoint of ``model`` (see
        :func:`dmscale.integrations.ultralytics.save_yolo_checkpoint`)."""
        from dmscale.integrations.ultralytics import save_yolo_checkpoint

        train_args = {k: v for k, v in vars(self.args).items() if isinstance(v, (int, float, str, bool, type(None)))}
        save_yolo_checkpoint(model, Path(run_dir) / "yolo.pt", train_args=train_args)
        return ["yolo.pt"]


def _augment_overrides(augment: dict[str, Any] | None) -> dict[str, float]:
    """``--augment`` as Ultralytics overrides: only the keys of :data:`AUGMENT_KEYS`, as floats."""
    out: dict[str, float] = {}
    for key, value in (augment or {}).items():
        if key not in AUGMENT_KEYS:
            raise ConfigError(f"--augment: unknown key {key!r}; expected one of {', '.join(AUGMENT_KEYS)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"--augment {key}: expected a number, got {value!r}")
        out[key] = float(value)
    return out


def _untimed_validator() -> type:
    """Ultralytics' ``DetectionValidator`` whose NMS has no wall-clock limit.

    Ultralytics' ``non_max_suppression`` stops after ``2 s + 0.05 s x batch`` and drops the
    detections of the batch's remaining images with only a log warning: on a loaded CPU
    the same model then scores a lower mAP. A search
    must not depend on the machine's load, so this validator passes an unbounded time.
    """
    from ultralytics.models.yolo.detect import DetectionValidator
    from ultralytics.utils import nms

    class UntimedDetectionValidator(DetectionValidator):
        def postprocess(self, preds: Any) -> list[dict[str, torch.Tensor]]:
            out = nms.non_max_suppression(preds, self.args.conf, self.args.iou, nc=0, multi_label=True,
                                          agnostic=self.args.single_cls or self.args.agnostic_nms,
                                          max_det=self.args.max_det, end2end=self.end2end,
                                          max_time_img=math.inf)
            return [{"bboxes": x[:, :4], "conf": x[:, 4], "cls": x[:, 5], "extra": x[:, 6:]} for x in out]

    return UntimedDetectionValidator


def _draw_partners_from_all(transform: Any) -> None:
    """Mosaic/MixUp/CutMix draw their partner images from a buffer of recently *loaded*
    images, which depends on the loading history; draw from the whole set instead, so that a
    batch is a function of the RNG seed alone."""
    if hasattr(transform, "buffer_enabled"):
        transform.buffer_enabled = False
    for child in getattr(transform, "transforms", []) or []:
        _draw_partners_from_all(child)
    if hasattr(transform, "pre_transform") and transform.pre_transform is not None:
        _draw_partners_from_all(transform.pre_transform)


@register_models("detection")
def build_detect_model(name: str, expand: dict[str, float], info: dict[str, Any]) -> nn.Module:
    """The YOLO supernet of ``--model yolo:SPEC`` (a yaml or a ``.pt``) for a task's ``info``."""
    _ultralytics()
    from dmscale.core.errors import DMScaleError
    from dmscale.integrations.ultralytics import build_yolo

    spec = name.split(":", 1)[1]
    try:
        return build_yolo(spec, nc=int(info["nc"]), expand=expand,
                          names={int(k): v for k, v in info.get("names", {}).items()} or None)
    except DMScaleError as err:
        raise ConfigError(f"--model {name}: {err}") from None
