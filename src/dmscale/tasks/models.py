"""Plain, readable PyTorch models used as DMS search baselines.

* :class:`ResNetCifar` -- the classic CIFAR ResNet of He et al. (2016): 6n+2 layers, three
  stages of n :class:`BasicBlock` with 16/32/64 channels (times ``width_mult``).
* :class:`SmallCNN` -- a small residual CNN for 1x28x28 inputs (MNIST) whose classifier
  consumes flattened C*2*2 features, so a channel search has to follow a flatten.

Shapes in comments use B = batch, C = channels, H/W = spatial size.

Example:
    >>> import torch
    >>> from dmscale.tasks.models import resnet20, SmallCNN
    >>> resnet20()(torch.randn(2, 3, 32, 32)).shape
    torch.Size([2, 10])
    >>> SmallCNN()(torch.randn(2, 1, 28, 28)).shape
    torch.Size([2, 10])
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dmscale.core.errors import ConfigError

__all__ = ["BasicBlock", "ResNetCifar", "resnet20", "ResidualBlock", "SmallCNN"]


def _norm(channels: int, norm: bool) -> nn.Module:
    """BatchNorm2d, or nothing (``norm=False``)."""
    return nn.BatchNorm2d(channels) if norm else nn.Identity()


def _conv3x3(c_in: int, c_out: int, stride: int = 1) -> nn.Conv2d:
    """3x3 convolution with padding 1 and no bias (a BatchNorm follows)."""
    return nn.Conv2d(c_in, c_out, kernel_size=3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    """ResNet basic block: conv3x3-BN-ReLU-conv3x3-BN, add the shortcut, then ReLU.

    The shortcut is the identity when input and output shapes match and a 1x1 conv + BN
    ("option B" of He et al.) otherwise.

    Example:
        >>> import torch
        >>> BasicBlock(16, 32, stride=2)(torch.randn(1, 16, 8, 8)).shape
        torch.Size([1, 32, 4, 4])
    """

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = _conv3x3(c_in, c_out, stride)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU()
        self.conv2 = _conv3x3(c_out, c_out)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(c_out),
            )
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, C_in, H, W)
        out = self.relu(self.bn1(self.conv1(x)))  # (B, C_out, H/s, W/s)
        out = self.bn2(self.conv2(out))  # (B, C_out, H/s, W/s)
        out = out + self.shortcut(x)  # (B, C_out, H/s, W/s)
        return self.relu(out)


class ResNetCifar(nn.Module):
    """CIFAR ResNet (He et al. 2016): depth = 6n + 2, three stages of n basic blocks.

    Args:
        depth: total number of weighted layers, ``6n + 2`` (20, 32, 44, 56, 110, ...).
        num_classes: number of output logits.
        in_channels: channels of the input image.
        width: channels of the first stage (16 in the paper); stages use 1x, 2x, 4x.
        width_mult: multiplies every stage width (rounded, at least 1).
        depth_mult: multiplies the number of blocks per stage (rounded, at least 1).

    Example:
        >>> import torch
        >>> m = ResNetCifar(depth=20, depth_mult=2.0)
        >>> [len(s) for s in (m.layer1, m.layer2, m.layer3)]
        [6, 6, 6]
        >>> m(torch.randn(1, 3, 32, 32)).shape
        torch.Size([1, 10])
    """

    def __init__(
        self,
        depth: int = 20,
        num_classes: int = 10,
        in_channels: int = 3,
        width: int = 16,
        width_mult: float = 1.0,
        depth_mult: float = 1.0,
    ) -> None:
        super().__init__()
        if depth < 8 or (depth - 2) % 6 != 0:
            raise ConfigError(f"depth must be 6n+2 with n >= 1, got {depth}")
        n = max(1, round((depth - 2) // 6 * depth_mult))
        widths = [max(1, round(width * f * width_mult)) for f in (1, 2, 4)]

        self.conv1 = _conv3x3(in_channels, widths[0])
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU()
        self.layer1 = self._make_stage(widths[0], widths[0], n, stride=1)
        self.layer2 = self._make_stage(widths[0], widths[1], n, stride=2)
        self.layer3 = self._make_stage(widths[1], widths[2], n, stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(widths[2], num_classes)

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    @staticmethod
    def _make_stage(c_in: int, c_out: int, n: int, stride: int) -> nn.Sequential:
        blocks = [BasicBlock(c_in, c_out, stride)]
        blocks += [BasicBlock(c_out, c_out) for _ in range(n - 1)]
        return nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, in_channels, 32, 32)
        x = self.relu(self.bn1(self.conv1(x)))  # (B, 16w, 32, 32)
        x = self.layer1(x)  # (B, 16w, 32, 32)
        x = self.layer2(x)  # (B, 32w, 16, 16)
        x = self.layer3(x)  # (B, 64w, 8, 8)
        x = self.avgpool(x)  # (B, 64w, 1, 1)
        x = torch.flatten(x, 1)  # (B, 64w)
        return self.fc(x)  # (B, num_classes)


def resnet20(**kwargs: Any) -> ResNetCifar:
    """ResNet-20 for CIFAR (about 0.27M parameters with 10 classes).

    Example:
        >>> sum(p.numel() for p in resnet20().parameters()) // 1000
        272
    """
    return ResNetCifar(depth=20, **kwargs)


class ResidualBlock(nn.Module):
    """Residual block ``x + body(x)``, body = conv-BN-ReLU-conv-BN (conv-ReLU-conv without
    ``norm``).

    There is no activation after the addition.

    Example:
        >>> import torch
        >>> ResidualBlock(8)(torch.randn(1, 8, 5, 5)).shape
        torch.Size([1, 8, 5, 5])
    """

    def __init__(self, channels: int, norm: bool = True) -> None:
        super().__init__()
        self.body = nn.Sequential(
            _conv3x3(channels, channels),
            _norm(channels, norm),
            nn.ReLU(),
            _conv3x3(channels, channels),
            _norm(channels, norm),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, C, H, W) -> (B, C, H, W)
        return x + self.body(x)


class SmallCNN(nn.Module):
    """Small residual CNN for 1x28x28 inputs with a flatten-into-MLP classifier.

    stem conv-BN-ReLU (C=width) -> ``stage1`` residual blocks -> strided conv-BN-ReLU
    (C=2*width) -> ``stage2`` residual blocks -> AdaptiveAvgPool2d(2) -> flatten (C*2*2)
    -> ``fc1`` -> ReLU -> ``fc2``.

    Args:
        in_channels: channels of the input image.
        num_classes: number of output logits.
        width: channels of the first stage; the second stage has ``2 * width``.
        blocks: residual blocks per stage.
        norm: BatchNorm after every convolution (default); ``False``: none, so a sample's
            output does not depend on the other samples of its batch.

    Example:
        >>> import torch
        >>> m = SmallCNN(width=8, blocks=1)
        >>> m.fc1.in_features
        64
        >>> m(torch.randn(3, 1, 28, 28)).shape
        torch.Size([3, 10])
    """

    def __init__(
        self, in_channels: int = 1, num_classes: int = 10, width: int = 32, blocks: int = 2,
        norm: bool = True,
    ) -> None:
        super().__init__()
        c1, c2 = width, 2 * width
        norm = bool(norm)
        self.stem = nn.Sequential(
            _conv3x3(in_channels, c1), _norm(c1, norm), nn.ReLU()
        )
        self.stage1 = nn.Sequential(*[ResidualBlock(c1, norm) for _ in range(blocks)])
        self.down = nn.Sequential(
            _conv3x3(c1, c2, stride=2), _norm(c2, norm), nn.ReLU()
        )
        self.stage2 = nn.Sequential(*[ResidualBlock(c2, norm) for _ in range(blocks)])
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.fc1 = nn.Linear(c2 * 2 * 2, 4 * width)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(4 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, in_channels, 28, 28)
        x = self.stem(x)  # (B, w, 28, 28)
        x = self.stage1(x)  # (B, w, 28, 28)
        x = self.down(x)  # (B, 2w, 14, 14)
        x = self.stage2(x)  # (B, 2w, 14, 14)
        x = self.pool(x)  # (B, 2w, 2, 2)
        x = torch.flatten(x, 1)  # (B, 2w*4)
        x = self.relu(self.fc1(x))  # (B, 4w)
        return self.fc2(x)  # (B, num_classes)
