"""Discovery: unsupported layers, exclusion, explicit depth, fixed channels, one mask per forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from exact import assert_exact
from torch import nn
from zoo import ZOO

import dmscale as dms
from dmscale.core.topk import DifferentiableTopK


def _prelu_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.PReLU(8), nn.Conv2d(8, 8, 3), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


def test_layer_without_handler_is_traced_through_and_fixes_what_it_cannot_slice():
    net = _prelu_net()  # F.prelu(x, weight) has no channel rule: conv 0's channels stay
    r = assert_exact(net, torch.randn(2, 3, 12, 12))
    space = r.searcher.space
    assert [d.name for d in space.width] == ["2"]
    assert "prelu" in space.pinned_reasons["0"]


class _HiddenScale(nn.Module):
    """Reads its weight outside torch's function dispatch (as TorchScript or a kernel would)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(c) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch._C.DisableTorchFunction():
            return x * self.weight.view(1, -1, 1, 1)


def test_layer_whose_weights_the_trace_cannot_see_is_a_clear_error_that_names_it_and_the_fix():
    net = nn.Sequential(nn.Conv2d(3, 8, 3), _HiddenScale(8), nn.Conv2d(8, 8, 3), nn.ReLU(),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
    keys = list(net.state_dict())
    with pytest.raises(dms.UnsupportedLayerError) as err:
        dms.prepare(net, torch.randn(1, 3, 12, 12))
    msg = str(err.value)
    assert "'1'" in msg and "_HiddenScale" in msg and "exclude=['1']" in msg and "register_handler" in msg
    assert list(net.state_dict()) == keys and not any(m._forward_pre_hooks for m in net.modules())
    searcher = dms.prepare(net, torch.randn(1, 3, 12, 12), dms.SearchConfig(exclude=["1"]))
    assert "excluded module 1" in searcher.space.pinned_reasons["0"]


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
    """Every dim's soft mask comes from one batched evaluation per forward (GateBank), never
    gate by gate, however many layers read it (the residual stream has 5 consumers)."""
    from dmscale.core.gate_bank import GateBank

    entry = ZOO["tv_resnet18"]
    model = entry.build()
    x = torch.randn(2, *entry.input_shape[1:])
    searcher = dms.prepare(model, x)
    per_gate, batched = [], []
    original, original_bank = DifferentiableTopK.unit_soft_mask, GateBank.unit_soft_masks
    monkeypatch.setattr(DifferentiableTopK, "unit_soft_mask", lambda self: per_gate.append(self) or original(self))
    monkeypatch.setattr(GateBank, "unit_soft_masks",
                        lambda self, **kw: batched.append(self) or original_bank(self, **kw))
    model.train()
    model(x).sum().backward()
    n_dims = len(searcher.gates.width) + len(searcher.gates.depth)
    assert per_gate == [] and len(batched) == 1
    assert len(batched[0].gates) == n_dims


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


# ---------------------------------------------------------------- layers traced through


class _Scale(nn.Module):
    """A per-channel parameter applied element-wise (timm LayerScale / LayerScale2d / Scale)."""

    def __init__(self, c: int, layout: str) -> None:
        super().__init__()
        self.layout = layout
        self.gamma = nn.Parameter(torch.rand(c) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout == "view":  # LayerScale2d: gamma.view(1, -1, 1, 1)
            return x * self.gamma.view(1, -1, 1, 1)
        if self.layout == "unsqueeze":  # (C, 1, 1) like poolformer's Scale
            return self.gamma.unsqueeze(-1).unsqueeze(-1) * x
        if self.layout == "normalised":  # also read as a whole: must not be sliced
            return x * (self.gamma / self.gamma.sum()).view(1, -1, 1, 1)
        if self.layout == "linear":  # the parameter mixes channels: F.linear(x, w)
            return F.linear(x.permute(0, 2, 3, 1), self.gamma.view(1, -1).expand(x.shape[1], -1)).permute(0, 3, 1, 2)
        if self.layout == "twice":  # sliced element-wise here, summed over there
            return x * self.gamma.view(1, -1, 1, 1) + self.gamma.sum()
        raise ValueError(self.layout)


class _Linear(nn.Module):
    """A custom layer that applies its own weight with F.linear (no handler)."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(c_out, c_in) / c_in**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w)


def _scaled_net(layout: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), _Scale(8, layout), nn.Conv2d(8, 6, 3),
                         nn.ReLU(), nn.Conv2d(6, 4, 1))


@pytest.mark.parametrize("layout", ["view", "unsqueeze"])
def test_per_channel_parameter_of_a_layer_without_handler_is_sliced_with_the_channels(layout):
    r = assert_exact(_scaled_net(layout), torch.randn(2, 3, 10, 10), seeds=(0, 1, 2))
    space = r.searcher.space
    assert [d.name for d in space.width] == ["0", "3"]
    assert space.params["2.gamma"][0] == 0 and len(space.params["2.gamma"][1]) == 8
    small = r.searcher.export()
    assert small[2].gamma.shape[0] == small[0].out_channels
    x = torch.randn(1, 3, 10, 10)
    assert r.searcher.costs.exact("hard", "params") == dms.count(small, x)["params"]


@pytest.mark.parametrize("layout", ["normalised", "linear", "twice"])
def test_parameter_read_beyond_its_channels_fixes_them(layout):
    r = assert_exact(_scaled_net(layout), torch.randn(2, 3, 10, 10), seeds=(0, 1))
    space = r.searcher.space
    assert [d.name for d in space.width] == ["3"]
    assert "2.gamma" not in space.params


def test_custom_layer_applying_its_weight_with_f_linear_keeps_its_channels_fixed():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), _Linear(8, 7), nn.ReLU(), nn.Linear(7, 6), nn.ReLU(),
                        nn.Linear(6, 3))
    r = assert_exact(net, torch.randn(4, 5), seeds=(0, 1))
    space = r.searcher.space
    assert [d.name for d in space.width] == ["4"]  # 0 feeds F.linear; 2's output is unlabelled
    assert "'linear' has no channel rule" in space.pinned_reasons["0"]
    assert space.params == {}


class _ScaledMlp(nn.Module):
    """A block with its own layer scale that it also reads as a whole (not a leaf layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.gamma = nn.Parameter(torch.rand(8) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.gamma + self.gamma.sum()


def test_parameter_sliced_element_wise_and_summed_elsewhere_is_not_sliced():
    torch.manual_seed(0)
    net = nn.Sequential(_ScaledMlp(), nn.ReLU(), nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 3))
    r = assert_exact(net, torch.randn(4, 8), seeds=(0, 1))  # was: export off by > 1
    assert [d.name for d in r.searcher.space.width] == ["2"]
    assert "also read by sum" in r.searcher.space.pinned_reasons["0.fc"]
