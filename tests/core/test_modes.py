"""prepare() and count() give every module its own train/eval mode back (defect 6)."""

from __future__ import annotations

import torch
from torch import nn

import dmscale as dms


def _net() -> nn.Module:
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3),
                        nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                        nn.Linear(8, 4))
    net.train()
    net[1].eval()  # a frozen BatchNorm inside a training model
    return net


def _modes(net: nn.Module) -> list[bool]:
    return [m.training for m in net.modules()]


def test_prepare_keeps_a_frozen_batchnorm_frozen():
    net = _net()
    before = _modes(net)
    searcher = dms.prepare(net, torch.randn(2, 3, 12, 12), dms.SearchConfig(target=0.5, importance="index"))
    assert [m.training for n, m in net.named_modules() if not n.startswith("dms_gates")] == before
    searcher.export()  # self-check runs in eval mode and restores the modes too
    assert not net[1].training and net[4].training


def test_count_keeps_module_modes():
    net = _net()
    before = _modes(net)
    dms.count(net, torch.randn(1, 3, 12, 12))
    assert _modes(net) == before


def test_recalibrate_batchnorm_restores_module_modes():
    net = _net().eval()
    net[4].train()
    before = _modes(net)
    dms.recalibrate_batchnorm(net, [torch.randn(4, 3, 12, 12)])
    assert _modes(net) == before
