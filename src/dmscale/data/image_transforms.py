"""The training and evaluation transforms of an image classification set: PIL image in,
normalised ``3 x S x S`` float tensor out.

* :func:`torchvision_transforms` (any model but timm's): torchvision transforms v2,
  ImageNet-style. Training: ``RandomResizedCrop(S)`` (scale 0.08-1, bilinear) and a
  horizontal flip; evaluation: ``Resize(S / 0.875)`` of the shorter side and
  ``CenterCrop(S)``; both then scaled to [0, 1] and normalised with ImageNet's mean and std.
* :func:`timm_transforms` (``timm:NAME`` models): timm's own data configuration of the model
  (``timm.data.resolve_data_config``: input size, interpolation, crop fraction, mean, std) and
  ``timm.data.create_transform``: for training its random-resized crop, flip, colour jitter
  (0.4, timm's default) or ``auto_augment`` (timm's strings: ``rand-m9-mstd0.5`` RandAugment,
  ``augmix-m5-w3``, ``original`` AutoAugment) instead of the jitter; for evaluation resize and
  center crop at the model's crop fraction.

With ``augment=False`` training images get the evaluation transform. The random transforms
draw from python's ``random``, numpy's and torch's global generators, which
:class:`dmscale.data.images.ImageDataset` seeds per example.

Example:
    >>> from PIL import Image
    >>> tf = torchvision_transforms(16)
    >>> x = tf.train(Image.new("RGB", (40, 30), (255, 0, 0)))
    >>> tuple(x.shape), round(float(x[0].mean()), 3), tf.mean == IMAGENET_MEAN
    ((3, 16, 16), 2.249, True)
    >>> timm_transforms("resnet18", 24).eval.transforms[0].size   # 24 / crop_pct 0.95
    25
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from dmscale.core.errors import ConfigError, MissingDependencyError

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "EVAL_CROP", "ImageTransforms", "torchvision_transforms",
           "timm_data_config", "timm_transforms"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
EVAL_CROP = 0.875  # the center crop's share of the resized image (torchvision's ImageNet recipe)


@dataclass(frozen=True)
class ImageTransforms:
    """What a task does to its images (PIL in, tensor out), and what that means for inputs.

    Attributes:
        train / eval: the transforms of the training and the evaluation images.
        size: the side of the square crops.
        mean / std: the per-channel normalisation (what a deployed model expects).
        origin: where they come from, for the run's log ("torchvision" or "timm NAME").
    """

    train: Callable[[Any], Any]
    eval: Callable[[Any], Any]
    size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    origin: str


def _torchvision() -> Any:
    from dmscale.core._compat import ensure_torchvision

    if not ensure_torchvision():
        raise MissingDependencyError("image folders need torchvision: pip install 'dmscale[vision]'")
    from torchvision.transforms import v2

    return v2


def torchvision_transforms(size: int, augment: bool = True, mean: tuple[float, ...] = IMAGENET_MEAN,
                           std: tuple[float, ...] = IMAGENET_STD) -> ImageTransforms:
    """ImageNet-style transforms v2 at ``size`` (see the module text)."""
    import torch

    v2 = _torchvision()
    tail = [v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(list(mean), list(std))]
    evaluate = v2.Compose([v2.Resize(max(size, int(size / EVAL_CROP))), v2.CenterCrop(size), *tail])
    train = v2.Compose([v2.RandomResizedCrop(size), v2.RandomHorizontalFlip(), *tail]) if augment else evaluate
    return ImageTransforms(train, evaluate, size, tuple(mean), tuple(std), "torchvision")


def timm_data_config(name: str, size: int | None = None) -> dict[str, Any]:
    """timm's data configuration of model ``name`` (its pretrained configuration's input size,
    interpolation, crop fraction, mean and std), at ``size`` when given.

        >>> cfg = timm_data_config("vit_small_patch16_224")
        >>> cfg["input_size"], cfg["mean"], cfg["crop_pct"]
        ((3, 224, 224), (0.5, 0.5, 0.5), 0.9)
    """
    _torchvision()  # timm imports torchvision
    try:
        import timm
        from timm.data import resolve_data_config
    except ImportError:
        raise MissingDependencyError("--model timm:... needs timm: pip install 'dmscale[vision]'") from None
    pretrained = timm.get_pretrained_cfg(name)
    pretrained_dict = pretrained.to_dict() if pretrained is not None else None
    side = size or (pretrained.input_size[-1] if pretrained is not None else 224)
    return resolve_data_config(args={"input_size": (3, side, side)}, pretrained_cfg=pretrained_dict)


def timm_transforms(name: str, size: int | None = None, augment: bool = True,
                    auto_augment: str | None = None) -> ImageTransforms:
    """timm's transforms of model ``name`` at ``size`` (default: the model's input size).

    Raises:
        ConfigError: ``auto_augment`` is not one of timm's augmentation strings.
    """
    cfg = timm_data_config(name, size)  # imports timm (after torchvision's fix-up)
    from timm.data import create_transform

    evaluate = create_transform(**cfg, is_training=False)
    train = evaluate
    if augment:
        try:
            train = create_transform(**cfg, is_training=True, auto_augment=auto_augment)
        except (AssertionError, ValueError, KeyError) as err:
            raise ConfigError(f"--auto-augment {auto_augment}: timm does not know it ({err}); give one of "
                              "timm's strings, e.g. rand-m9-mstd0.5 (RandAugment), augmix-m5-w3 or "
                              "original (AutoAugment), or leave it out") from None
    return ImageTransforms(train, evaluate, int(cfg["input_size"][-1]), tuple(cfg["mean"]), tuple(cfg["std"]),
                           f"timm {name}")
