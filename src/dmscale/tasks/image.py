"""Image classification on in-memory tensors (MNIST, scikit-learn digits) and image models.

Data are held in memory as float tensors ``N x C x H x W``; a training batch is a slice of
a per-epoch permutation drawn from ``(seed, epoch)``, so batches depend on the step alone.
Image folders are read lazily instead (:mod:`dmscale.tasks.imagefolder`).

Models (``--model``):

* ``resnet``: :class:`dmscale.tasks.models.ResNetCifar` (depth 20, width 16 by default);
  ``--expand width=W,depth=D`` sets ``width_mult=W, depth_mult=D``.
* ``smallcnn``: :class:`dmscale.tasks.models.SmallCNN`; ``--expand`` scales ``width`` and
  ``blocks``.
* ``tv:NAME``: ``torchvision.models.get_model(NAME, weights=None, num_classes=...)``; a first
  convolution made for 3 channels is replaced when the images have another count.
* ``timm:NAME``: ``timm.create_model(NAME, pretrained=False, num_classes=..., in_chans=...)``.

Models are built with random weights; the weights a run starts from (``--weights``, the
libraries' own with ``--pretrained``) are loaded when it starts (:mod:`dmscale.tasks.start_weights`),
so a run directory rebuilds its model without a file or the network. The user's own
``package.module:factory`` models are built by :mod:`dmscale.tasks.user_models`.

Example:
    >>> from dmscale.config.run_config import RunConfig
    >>> task = build_image_task(RunConfig(task="mnist", train_limit=8, test_limit=4))
    >>> task.describe()
    'mnist: 8 training / 4 test images of 1x28x28, 10 classes'
    >>> model = build_image_model("smallcnn", {"width": 4}, {"width": 2.0, "depth": 1.0}, task.info)
    >>> model.stem[0].out_channels
    8
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from dmscale.config.run_config import ConfigError, RunConfig
from dmscale.tasks.registry import (Task, _epoch_permutation, classification_metrics, register_models, register_task,
                                     scaled)

__all__ = ["ClassificationTask", "build_image_task", "build_image_model"]


class ClassificationTask(Task):
    """Classification on in-memory tensors."""

    kind = "classification"
    metric = "acc"

    def __init__(self, name: str, x_train: torch.Tensor, y_train: torch.Tensor,
                 x_test: torch.Tensor, y_test: torch.Tensor, num_classes: int,
                 classes: list[str] | None = None) -> None:
        if len(x_train) == 0 or len(x_test) == 0:
            raise ConfigError(f"task {name}: empty split ({len(x_train)} training, "
                              f"{len(x_test)} test examples)")
        self.name = name
        self.x_train, self.y_train = x_train.contiguous(), y_train.contiguous()
        self.x_test, self.y_test = x_test.contiguous(), y_test.contiguous()
        self.num_classes = int(num_classes)
        c, h, w = x_train.shape[1:]
        self.info = {"kind": "classification", "num_classes": self.num_classes,
                     "in_channels": int(c), "image_size": [int(h), int(w)]}
        if classes is not None:
            self.info["classes"] = list(classes)

    def example_inputs(self) -> torch.Tensor:
        return self.x_test[:1].clone()

    def steps_per_epoch(self, batch_size: int) -> int:
        return max(1, len(self.x_train) // batch_size)

    def train_batch(self, step: int, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self.x_train)
        spe = self.steps_per_epoch(batch_size)
        epoch, k = divmod(step, spe)
        perm = _epoch_permutation(n, epoch, seed)
        idx = perm[k * batch_size:(k + 1) * batch_size]
        return self.x_train[idx], self.y_train[idx]

    def evaluate(self, model: nn.Module, batch_size: int = 256, device: torch.device | str = "cpu",
                 limit: int | None = None) -> dict[str, float]:
        n = len(self.x_test) if limit is None else min(limit, len(self.x_test))
        batches = ((self.x_test[i:min(i + batch_size, n)].to(device), self.y_test[i:min(i + batch_size, n)].to(device))
                   for i in range(0, n, batch_size))
        return classification_metrics(self.forward, model, batches, n)

    def describe(self) -> str:
        c, h, w = self.x_train.shape[1:]
        return (f"{self.name}: {len(self.x_train):,} training / {len(self.x_test):,} test images "
                f"of {c}x{h}x{w}, {self.num_classes} classes")


def _limit(x: torch.Tensor, y: torch.Tensor, limit: int | None, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    if limit is None:
        return x, y
    if limit > len(x):
        raise ConfigError(f"--{what}-limit {limit} exceeds the {len(x)} {what} examples")
    return x[:limit], y[:limit]


@register_task("mnist", "digits")
def build_image_task(cfg: RunConfig) -> Task:
    """MNIST (bundled or ``--data``), digits or an image folder, as ``cfg`` says (the image
    folder is :func:`dmscale.tasks.imagefolder.build_imagefolder_task`'s)."""
    if cfg.task == "mnist":
        from dmscale.data import mnist_tensors

        if cfg.data is not None and not Path(cfg.data).is_dir():
            raise ConfigError(f"--data {cfg.data}: not a directory of MNIST IDX files")
        x, y, xt, yt = mnist_tensors(cfg.data, train_limit=cfg.train_limit, test_limit=cfg.test_limit)
        return ClassificationTask("mnist", x, y, xt, yt, 10)
    if cfg.task == "digits":
        from dmscale.data import digits_tensors

        x, y, xt, yt = digits_tensors(seed=0)
        x, y = _limit(x, y, cfg.train_limit, "train")
        xt, yt = _limit(xt, yt, cfg.test_limit, "test")
        return ClassificationTask("digits", x, y, xt, yt, 10)
    if cfg.task == "imagefolder":
        from dmscale.tasks.imagefolder import build_imagefolder_task

        return build_imagefolder_task(cfg)
    raise ConfigError(f"not an image task: {cfg.task!r}")


def _replace_first_conv(model: nn.Module, in_channels: int) -> None:
    """Swap the first Conv2d (made for 3 channels) for one reading ``in_channels``."""
    for name, m in model.named_modules():
        if isinstance(m, nn.Conv2d):
            if m.in_channels == in_channels:
                return
            new = nn.Conv2d(in_channels, m.out_channels, m.kernel_size, m.stride, m.padding,
                            m.dilation, m.groups if m.groups == 1 else in_channels,
                            m.bias is not None, m.padding_mode)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, new)
            return


@register_models("image")
def build_image_model(name: str, args: dict[str, Any], expand: dict[str, float],
                      info: dict[str, Any]) -> nn.Module:
    """The image model ``name`` for ``info`` (classes, channels), enlarged by ``expand``."""
    n_cls, c_in = int(info["num_classes"]), int(info["in_channels"])
    enlarged = expand.get("width", 1.0) != 1.0 or expand.get("depth", 1.0) != 1.0
    if name == "resnet":
        from dmscale.tasks.models import ResNetCifar

        kw = {"depth": 20, "width": 16, **args}
        kw["width_mult"] = float(kw.get("width_mult", 1.0)) * expand["width"]
        kw["depth_mult"] = float(kw.get("depth_mult", 1.0)) * expand["depth"]
        try:
            return ResNetCifar(num_classes=n_cls, in_channels=c_in, **kw)
        except ValueError as err:
            raise ConfigError(f"--model-args for resnet: {err}") from None
    if name == "smallcnn":
        from dmscale.tasks.models import SmallCNN

        kw = {"width": 32, "blocks": 2, **args}
        kw["width"] = scaled(int(kw["width"]), expand["width"])
        kw["blocks"] = scaled(int(kw["blocks"]), expand["depth"])
        return SmallCNN(in_channels=c_in, num_classes=n_cls, **kw)
    if enlarged:
        raise ConfigError(f"--expand works on the built-in models (resnet, smallcnn, charcnn, llama), "
                          f"not on {name}: pick a larger {name.split(':')[0]} model instead")
    if name.startswith("tv:"):
        from dmscale.core._compat import ensure_torchvision

        if not ensure_torchvision():
            raise ConfigError("--model tv:... needs torchvision: pip install 'dmscale[vision]'")
        import torchvision

        try:
            model = torchvision.models.get_model(name[3:], weights=None, num_classes=n_cls, **args)
        except ValueError as err:
            raise ConfigError(f"--model {name}: {err}") from None
        _replace_first_conv(model, c_in)
        return model
    if name.startswith("timm:"):
        from dmscale.core._compat import ensure_torchvision

        ensure_torchvision()
        try:
            import timm
        except ImportError:
            raise ConfigError("--model timm:... needs timm: pip install 'dmscale[vision]'") from None
        if not timm.is_model(name[5:]):
            raise ConfigError(f"--model {name}: timm has no model {name[5:]!r}")
        return timm.create_model(name[5:], pretrained=False, num_classes=n_cls, in_chans=c_in, **args)
    raise ConfigError(f"unknown image model {name!r}")
