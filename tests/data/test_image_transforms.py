"""The transforms of image folders (src/dmscale/data/image_transforms.py): torchvision v2 for
most models, timm's own data config and transforms for timm models."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from dmscale.core.errors import ConfigError
from dmscale.data.image_transforms import IMAGENET_MEAN, IMAGENET_STD, timm_transforms, torchvision_transforms

__all__: list[str] = []

IMAGE = Image.new("RGB", (50, 40), (200, 100, 50))


def test_torchvision_transforms_crop_and_normalise() -> None:
    tf = torchvision_transforms(16)
    names = [type(t).__name__ for t in tf.train.transforms]
    assert names[:2] == ["RandomResizedCrop", "RandomHorizontalFlip"]
    assert [type(t).__name__ for t in tf.eval.transforms][:2] == ["Resize", "CenterCrop"]
    x = tf.eval(IMAGE)
    assert type(x).__name__ in ("Image", "Tensor") and x.shape == (3, 16, 16) and x.dtype == torch.float32
    want = [(v / 255 - m) / s for v, m, s in zip((200, 100, 50), IMAGENET_MEAN, IMAGENET_STD)]
    assert torch.allclose(x.mean(dim=(1, 2)), torch.tensor(want), atol=1e-5)


def test_no_augmentation_trains_on_the_evaluation_transform() -> None:
    tf = torchvision_transforms(16, augment=False)
    assert tf.train is tf.eval
    assert timm_transforms("resnet18", 16, augment=False).train is not None


def test_timm_transforms_follow_the_models_data_config() -> None:
    vit = timm_transforms("vit_small_patch16_224")
    assert vit.size == 224 and vit.mean == (0.5, 0.5, 0.5) and vit.origin == "timm vit_small_patch16_224"
    r18 = timm_transforms("resnet18", 32, auto_augment="rand-m9-mstd0.5")
    assert r18.size == 32 and r18.mean == IMAGENET_MEAN
    assert "RandAugment" in repr(r18.train) and "RandomResizedCrop" in repr(r18.train)
    torch.manual_seed(0)
    assert r18.train(IMAGE).shape == (3, 32, 32) and r18.eval(IMAGE).shape == (3, 32, 32)


def test_an_unknown_augmentation_policy_is_refused() -> None:
    with pytest.raises(ConfigError, match="--auto-augment nope: timm does not know it.*rand-m9-mstd0.5"):
        timm_transforms("resnet18", 32, auto_augment="nope")
