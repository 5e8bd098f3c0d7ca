"""Discovery: unsupported layers, exclusion, explicit depth, fixed channels, one mask per forward."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from zoo import ZOO

import dmscale as dms
from dmscale.topk import DifferentiableTopK


def _prelu_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.PReLU(8), nn.Conv2d(8, 8, 3), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


def test_unsupported_layer_is_a_clear_error_that_names_it_and_the_fix():
    net = _prelu_net()
    keys = list(net.state_dict())
    with pytest.raises(dms.UnsupportedLayerError) as err:
        dms.prepare(net, torch.randn(1, 3, 12, 12))
    msg = str(err.value)
    assert "'1'" in msg and "PReLU" in msg and "exclude=['1']" in msg and "register_handler" in msg
    assert list(net.state_dict()) == keys and not any(m._forward_pre_hooks for m in net.modules())


def test_excluding_the_layer_fixes_the_widths_around_it():
    net = _prelu_net()
    searcher = dms.prepare(net, torch.randn(1, 3, 12, 12), dms.SearchConfig(exclude=["1"]))
    names = [d.name for d in searcher.space.width]
    assert names == ["2"]  # conv 0's channels meet the excluded PReLU: fixed
    assert "excluded module 1" in searcher.space.pinned_reasons["0"]


def test_explicit_depth_stages_and_unknown_stage():
    entry = ZOO["resnet20"]
    x = torch.randn(1, *entry.input_shape[1:])
    space = dms.discover(entry.build(), x, depth=["layer2"])
    assert [d.name for d in space.depth] == ["layer2"]
    with pytest.raises(ValueError, match="have no residual block"):
        dms.discover(entry.build(), x, depth=["fc"])


def test_hard_coded_channel_slice_fixes_the_channels():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Conv2d(3, 8, 1)
            self.b = nn.Conv2d(4, 4, 1)
            self.c = nn.Conv2d(4, 2, 1)

        def forward(self, x):
            return self.c(self.b(self.a(x)[:, :4]))

    space = dms.discover(Net(), torch.randn(1, 3, 4, 4))
    assert [d.name for d in space.width] == ["b"]
    assert "no channel rule" in space.pinned_reasons["a"]


def test_each_mask_is_computed_once_per_forward(monkeypatch):
    entry = ZOO["tv_resnet18"]
    model = entry.build()
    x = torch.randn(2, *entry.input_shape[1:])
    searcher = dms.prepare(model, x)
    calls = []
    original = DifferentiableTopK.unit_soft_mask
    monkeypatch.setattr(DifferentiableTopK, "unit_soft_mask", lambda self: calls.append(self) or original(self))
    model.train()
    model(x).sum().backward()
    n_dims = len(searcher.gates.width) + len(searcher.gates.depth)
    assert len(calls) == n_dims  # the residual stream has 5 consumers, still one mask
    assert len({id(t) for t in calls}) == n_dims


class _TokenNet(nn.Module):
    """Passes a view of a parameter into a submodule (timm CaiT's class token, PiT)."""

    def __init__(self) -> None:
        super().__init__()
        self.token = nn.Parameter(torch.randn(1, 1, 8))
        self.proj = nn.Linear(4, 8)
        self.block = _TokenBlock()
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.token.expand(x.shape[0], -1, -1)  # (N, 1, 8), requires grad, no grad_fn
        return self.head(self.block(self.proj(x), tokens))


class _TokenBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return x + self.fc(tokens)


def test_discovery_and_count_accept_parameter_views_as_module_inputs():
    net, x = _TokenNet(), torch.randn(2, 3, 4)
    space = dms.discover(net, x)
    # per-module MACs: proj 2*3*4*8, block.fc 2*1*8*8, head 2*3*8*2
    assert space.module_macs["proj"] == 192 and space.module_macs["block.fc"] == 128
    assert space.module_macs["block"] == 128 and space.total_macs == 192 + 128 + 96
    assert dms.count(net, x)["macs"] == space.total_macs
