"""Tests for dmscale.tasks.models and the tests/zoo.py model zoo."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dmscale.tasks.models import BasicBlock, ResNetCifar, SmallCNN, resnet20
from zoo import ZOO, C2fNet, randomize_bn_


def _n_params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def _stage_lengths(m: ResNetCifar) -> list[int]:
    return [len(m.layer1), len(m.layer2), len(m.layer3)]


def test_resnet20_structure_and_shape() -> None:
    m = resnet20().eval()
    assert _stage_lengths(m) == [3, 3, 3]
    assert all(isinstance(b, BasicBlock) for s in (m.layer1, m.layer2, m.layer3) for b in s)
    # option-B shortcuts only where the shape changes (first block of layer2 and layer3)
    projections = [
        isinstance(b.shortcut, nn.Sequential)
        for s in (m.layer1, m.layer2, m.layer3)
        for b in s
    ]
    assert projections == [False] * 3 + [True, False, False] * 2
    assert m.fc.in_features == 64
    assert m(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_resnet20_param_count() -> None:
    assert abs(_n_params(resnet20()) - 0.27e6) <= 0.01e6


def test_resnet_depth_and_width_mult() -> None:
    m = ResNetCifar(depth=20, depth_mult=2.0, width_mult=0.5, num_classes=7).eval()
    assert _stage_lengths(m) == [6, 6, 6]
    assert [m.layer1[0].conv1.out_channels, m.layer2[0].conv1.out_channels] == [8, 16]
    assert m.fc.in_features == 32
    assert m(torch.randn(1, 3, 32, 32)).shape == (1, 7)
    assert _stage_lengths(ResNetCifar(depth=56)) == [9, 9, 9]
    assert _stage_lengths(ResNetCifar(depth=20, depth_mult=0.1)) == [1, 1, 1]
    with pytest.raises(ValueError):
        ResNetCifar(depth=21)


def test_small_cnn_shape_and_flatten_classifier() -> None:
    m = SmallCNN().eval()
    assert len(m.stage1) == 2 and len(m.stage2) == 2
    assert m.fc1.in_features == 64 * 2 * 2
    assert m(torch.randn(3, 1, 28, 28)).shape == (3, 10)
    m2 = SmallCNN(in_channels=3, num_classes=5, width=8, blocks=1).eval()
    assert m2.fc1.in_features == 16 * 4
    assert m2(torch.randn(1, 3, 28, 28)).shape == (1, 5)


def test_small_cnn_residual_has_no_post_activation() -> None:
    m = SmallCNN(width=4, blocks=1).eval()
    block = m.stage1[0]
    x = -torch.ones(1, 4, 6, 6)  # negative input: a ReLU after the add would clip it
    with torch.no_grad():
        for p in block.body.parameters():
            p.zero_()  # body(x) == 0 -> block(x) == x
        assert torch.equal(block(x), x)


def test_c2f_net_shape() -> None:
    m = C2fNet().eval()
    assert m.stage1.cv2.conv.in_channels == (2 + 2) * 16
    assert m.stage2.cv2.conv.in_channels == (2 + 1) * 32
    assert m(torch.randn(2, 3, 64, 64)).shape == (2, 10)


def test_randomize_bn_is_deterministic_and_in_range() -> None:
    a = randomize_bn_(nn.BatchNorm2d(100), seed=3)
    b = randomize_bn_(nn.BatchNorm2d(100), seed=3)
    for name in ("running_mean", "running_var", "weight", "bias"):
        assert torch.equal(getattr(a, name), getattr(b, name))
    assert a.running_var.min() >= 0.5 and a.running_var.max() <= 1.5
    assert a.weight.min() >= 0.5 and a.weight.max() <= 1.5
    assert not torch.equal(a.running_mean, torch.zeros(100))


@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_entry_builds_runs_and_is_deterministic(name: str) -> None:
    entry = ZOO[name]
    x = torch.randn(entry.input_shape, generator=torch.Generator().manual_seed(1))
    outs = []
    for _ in range(2):
        model = entry.build().eval()
        with torch.no_grad():
            outs.append(model(x))
    assert outs[0].shape == (1, 10)
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[0], outs[1])
    # BN statistics were randomised (not the default zeros/ones)
    bn = next(m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm))
    assert not torch.equal(bn.running_mean, torch.zeros_like(bn.running_mean))
