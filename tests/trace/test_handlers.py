"""Layer handlers: convs that transform their weights (weight standardisation, weight norm)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from exact import assert_exact
from torch import nn

import dmscale as dms

dms.ensure_torchvision()
timm_layers = pytest.importorskip("timm.layers")


class _WSNet(nn.Module):
    """conv -> weight-standardised conv(s) -> head: as in timm NFNet / BiT."""

    def __init__(self, ws: type, depthwise: bool = False) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 12, 3, padding=1)
        self.b = ws(12, 16, 3, padding=1)
        self.dw = ws(16, 16, 3, padding=1, groups=16) if depthwise else nn.Identity()
        self.c = nn.Conv2d(16, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(F.relu(self.dw(F.relu(self.b(F.relu(self.a(x)))))))


@pytest.mark.parametrize("ws", ["ScaledStdConv2d", "StdConv2d", "ScaledStdConv2dSame", "StdConv2dSame"])
def test_weight_standardised_conv_searches_outputs_and_fixes_inputs(ws):
    cls = getattr(timm_layers, ws)
    torch.manual_seed(0)
    net = _WSNet(cls, depthwise=True)
    with torch.no_grad():
        for m in net.modules():
            if hasattr(m, "gain"):
                m.gain.uniform_(0.5, 1.5)  # distinct per channel: a wrong slice would show
    r = assert_exact(net, torch.randn(2, 3, 8, 8), seeds=(0, 1, 2))
    space = r.searcher.space
    assert [d.name for d in space.width] == ["b"]  # a feeds b's fan-in: fixed
    assert "weight-standardised conv b" in space.pinned_reasons["a"]
    assert space.layers["b"].in_slots is None and space.layers["dw"].in_slots is not None
    small = r.searcher.export()
    if hasattr(small.b, "gain"):
        assert small.b.gain.shape[0] == small.b.out_channels == small.dw.gain.shape[0]
    assert r.searcher.costs.exact("hard", "params") == dms.count(small, torch.randn(1, 3, 8, 8))["params"]


class _ScaledWeightConv(nn.Conv2d):
    """A conv subclass dmscale knows nothing about that rescales its weight per filter."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scale = nn.Parameter(torch.rand(self.out_channels, 1, 1, 1) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight / self.weight.flatten(1).norm(dim=1).view(-1, 1, 1, 1) * self.scale
        return self._conv_forward(x, w, self.bias)


@pytest.mark.parametrize("make", [
    lambda: _ScaledWeightConv(8, 8, 3, padding=1),
    lambda: nn.utils.parametrizations.weight_norm(nn.Conv2d(8, 8, 3, padding=1)),
], ids=["custom-subclass", "weight-norm"])
def test_conv_that_transforms_its_weights_keeps_its_widths_fixed(make):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 1), nn.ReLU(), make(), nn.ReLU(), nn.Conv2d(8, 6, 1), nn.ReLU(),
                        nn.Conv2d(6, 2, 1))
    r = assert_exact(net, torch.randn(2, 3, 6, 6))
    space = r.searcher.space
    assert [d.name for d in space.width] == ["4"]
    assert "transforms its parameters" in space.pinned_reasons["2"]
    assert "transforms its parameters" in space.pinned_reasons["0"]
