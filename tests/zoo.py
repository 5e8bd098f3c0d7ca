"""A zoo of small models for tests (a helper module, not a test file).

* :class:`C2f` / :class:`C2fNet` -- a YOLOv8-style split/concat block and a tiny network
  built from it (chunk + growing concat, the hard case for channel dependency tracking).
* :class:`ResidualMLP` -- Linear(8 -> 16), residual MLP blocks of 16 -> 32 -> 16, Linear(16 -> 3):
  the smallest model with searchable width and depth.
* :data:`ZOO` -- named :class:`ZooEntry` builders (torchvision, timm and dmscale models)
  with their input shapes. Every build seeds torch with 0 and randomises BatchNorm
  statistics via :func:`randomize_bn_`, so two builds give identical models and BN layers
  are not the identity in eval mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from dmscale.tasks.models import ResNetCifar, SmallCNN

__all__ = [
    "ConvBNAct",
    "Bottleneck",
    "C2f",
    "C2fNet",
    "MLPBlock",
    "ResidualMLP",
    "ZooEntry",
    "ZOO",
    "randomize_bn_",
]


class ConvBNAct(nn.Module):
    """Conv2d (no bias, 'same' padding) -> BatchNorm2d -> SiLU, as YOLOv8's ``Conv``."""

    def __init__(self, c1: int, c2: int, k: int = 1, s: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c1, c2, k, s, padding=k // 2, bias=False)
        self.bn = nn.BatchNorm2d(c2)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn(self.conv(x)))


class Bottleneck(nn.Module):
    """Two 3x3 ConvBNAct; ``x + cv2(cv1(x))`` when ``shortcut`` else ``cv2(cv1(x))``."""

    def __init__(self, c: int, shortcut: bool = True) -> None:
        super().__init__()
        self.cv1 = ConvBNAct(c, c, 3)
        self.cv2 = ConvBNAct(c, c, 3)
        self.add = shortcut

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.cv2(self.cv1(x))
        return x + y if self.add else y


class C2f(nn.Module):
    """YOLOv8 C2f: split cv1's output in two, chain n bottlenecks on the last chunk, concat all.

    Example:
        >>> C2f(16, 32, n=2)(torch.randn(1, 16, 8, 8)).shape
        torch.Size([1, 32, 8, 8])
    """

    def __init__(self, c1: int, c2: int, n: int = 2, shortcut: bool = True) -> None:
        super().__init__()
        self.c = int(c2 * 0.5)
        self.cv1 = ConvBNAct(c1, 2 * self.c, 1)
        self.cv2 = ConvBNAct((2 + n) * self.c, c2, 1)
        self.m = nn.ModuleList(Bottleneck(self.c, shortcut) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = list(self.cv1(x).chunk(2, 1))  # 2 x (B, c, H, W)
        y.extend(m(y[-1]) for m in self.m)  # (2 + n) x (B, c, H, W)
        return self.cv2(torch.cat(y, 1))  # (B, c2, H, W)


class C2fNet(nn.Module):
    """stem(3->16, s2) -> C2f(16->32, n=2) -> conv(32->64, s2) -> C2f(64->64, n=1) -> head.

    Example:
        >>> C2fNet()(torch.randn(1, 3, 64, 64)).shape
        torch.Size([1, 10])
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = ConvBNAct(3, 16, 3, s=2)
        self.stage1 = C2f(16, 32, n=2)
        self.down = ConvBNAct(32, 64, 3, s=2)
        self.stage2 = C2f(64, 64, n=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, 3, H, W)
        x = self.stem(x)  # (B, 16, H/2, W/2)
        x = self.stage1(x)  # (B, 32, H/2, W/2)
        x = self.down(x)  # (B, 64, H/4, W/4)
        x = self.stage2(x)  # (B, 64, H/4, W/4)
        x = torch.flatten(self.pool(x), 1)  # (B, 64)
        return self.fc(x)  # (B, num_classes)


def randomize_bn_(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give every BatchNorm random statistics and affine parameters, in place.

    running_mean ~ N(0, 0.1), running_var ~ U(0.5, 1.5), weight ~ U(0.5, 1.5),
    bias ~ N(0, 0.1), drawn from a dedicated generator seeded with ``seed``.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if not isinstance(m, nn.modules.batchnorm._BatchNorm):
                continue
            n = m.num_features
            if m.running_mean is not None:
                m.running_mean.copy_(torch.randn(n, generator=g) * 0.1)
            if m.running_var is not None:
                m.running_var.copy_(torch.rand(n, generator=g) + 0.5)
            if m.weight is not None:
                m.weight.copy_(torch.rand(n, generator=g) + 0.5)
            if m.bias is not None:
                m.bias.copy_(torch.randn(n, generator=g) * 0.1)
    return model


class MLPBlock(nn.Module):
    """``x + fc2(relu(fc1(x)))``, 16 -> 32 -> 16."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class ResidualMLP(nn.Module):
    """Linear(8 -> 16), ``blocks`` :class:`MLPBlock`, Linear(16 -> 3); x: (B, 8)."""

    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.stem, self.blocks, self.head = nn.Linear(8, 16), nn.ModuleList(MLPBlock() for _ in range(blocks)), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


@dataclass
class ZooEntry:
    """A named, deterministic model builder and the input shape it expects."""

    name: str
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]


def _seeded(fn: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """Wrap a constructor: seed torch with 0 first, randomise BN statistics last."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        return randomize_bn_(fn(), seed=0)

    return build


def _torchvision(name: str) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        from dmscale.core._compat import ensure_torchvision

        ensure_torchvision()
        import torchvision

        return getattr(torchvision.models, name)(num_classes=10)

    return make


def _timm(name: str) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        from dmscale.core._compat import ensure_torchvision

        ensure_torchvision()
        import timm

        return timm.create_model(name, pretrained=False, num_classes=10)

    return make


_IMG64 = (1, 3, 64, 64)

ZOO: dict[str, ZooEntry] = {
    e.name: e
    for e in [
        ZooEntry("tv_resnet18", _seeded(_torchvision("resnet18")), _IMG64),
        ZooEntry("tv_resnet50", _seeded(_torchvision("resnet50")), _IMG64),
        ZooEntry("tv_mobilenet_v2", _seeded(_torchvision("mobilenet_v2")), _IMG64),
        ZooEntry("timm_resnet18", _seeded(_timm("resnet18")), _IMG64),
        ZooEntry("timm_mobilenetv2_100", _seeded(_timm("mobilenetv2_100")), _IMG64),
        ZooEntry("timm_efficientnet_b0", _seeded(_timm("efficientnet_b0")), _IMG64),
        ZooEntry("resnet20", _seeded(lambda: ResNetCifar(depth=20)), (1, 3, 32, 32)),
        ZooEntry("small_cnn", _seeded(lambda: SmallCNN()), (1, 1, 28, 28)),
        ZooEntry("c2f_net", _seeded(lambda: C2fNet()), _IMG64),
    ]
}
