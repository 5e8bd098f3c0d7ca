"""The rule table (dmscale.trace.rules): how torch functions carry channel labels."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from torch import nn

import dmscale as dms


class _After(nn.Module):
    """conv(3 -> 8) -> ``fn(features)`` -> conv(8 -> 2): is conv ``a``'s width searchable?"""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 8, 1)
        self.b = nn.Conv2d(8, 2, 1)
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.fn(self.a(x)))


def _searchable(fn: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    space = dms.discover(_After(fn), torch.randn(2, 3, 4, 4))
    return [d.name for d in space.width] == ["a"]


def _anchors_like(f: torch.Tensor) -> torch.Tensor:
    """Ultralytics' anchor code: a lower-rank tensor takes the dtype of a feature map."""
    grid = torch.arange(4.0).type_as(f) + torch.arange(4.0).to(f)  # (4,) from a (2, 8, 4, 4) donor
    return f + grid  # broadcasts over the last dim, not the channels


@pytest.mark.parametrize("fn", [
    _anchors_like,
    lambda f: torch.zeros(3).type_as(f.mean((2, 3))).sum() + f,  # a (2, 8) dtype donor
    lambda f: torch.where(f > 0, f, 0.5 * f),  # comparison then where
    lambda f: f * torch.ones(4),  # lower-rank operand over the width (last) dim
    lambda f: f * torch.ones(1, 1, 1),  # lower-rank operand of size 1
    lambda f: torch.maximum(f, torch.tensor(0.0)),  # 0-dim operand
], ids=["anchors", "flat-donor", "where", "rank1", "rank3-ones", "scalar-tensor"])
def test_elementwise_broadcasts_right_aligned_and_keeps_the_channels(fn):
    assert _searchable(fn)


@pytest.mark.parametrize("fn", [
    lambda f: f * torch.ones(8, 1, 1),  # an unlabelled constant over the channels
    lambda f: f[:, :1] * f,  # channel 0 broadcast over all channels
    lambda f: f + f.mean(1, keepdim=True),  # a statistic over channels
], ids=["constant", "broadcast-channel", "channel-mean"])
def test_elementwise_pins_what_it_cannot_slice(fn):
    assert not _searchable(fn)


class _WidthReadingAttention(nn.Module):
    """timm CaiT's TalkingHeadAttn pattern: the head dim comes from the *input* width."""

    def __init__(self, dim: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        attn = (qkv[0] @ qkv[1].transpose(-2, -1)).softmax(-1)
        return self.proj((attn @ qkv[2]).transpose(1, 2).reshape(B, N, C))


def test_width_read_to_split_other_channels_is_fixed():
    from exact import assert_exact

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 8), _WidthReadingAttention(), nn.ReLU(), nn.Linear(8, 6), nn.ReLU(),
                        nn.Linear(6, 3))
    r = assert_exact(net, torch.randn(2, 4, 5))  # was: the export crashed in the reshape
    assert [d.name for d in r.searcher.space.width] == ["1.proj", "3"]  # not 0: its width shapes qkv
    assert "module 1 reads their count" in r.searcher.space.pinned_reasons["0"]


class _SpatialReduction(nn.Module):
    """timm PVT-v2's key/value path: ``C`` is read from ``x`` and then used to flatten the
    output of another layer, ``sr(x).reshape(B, C, -1)``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.sr = nn.Conv2d(dim, dim, 2, stride=2)
        self.kv = nn.Linear(dim, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, N, C), N = 4 * 4
        B, N, C = x.shape
        x = x.permute(0, 2, 1).reshape(B, C, 4, 4)
        x = self.sr(x).reshape(B, C, -1).permute(0, 2, 1)  # (B, 4, C): sr's width must equal C
        return self.kv(x)


class _ReshapeAs(nn.Module):
    """``z.reshape_as(y)``: z's width is written as y's, with no other op between the two."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(5, 8), nn.Linear(5, 8)
        self.out_a, self.out_b = nn.Linear(8, 3), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 5)
        y = self.a(x)  # (B, 8)
        z = self.b(x.unsqueeze(1))  # (B, 1, 8)
        return self.out_a(y) + self.out_b(z.reshape_as(y))


def test_width_read_to_reshape_another_layer_ties_the_two():
    from exact import assert_exact

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 8), _SpatialReduction(8))
    r = assert_exact(net, torch.randn(2, 16, 5))  # was: the export failed in the reshape
    (dim,) = r.searcher.space.width  # the input width and sr's output are one dimension
    assert dim.name in ("0", "1.sr") and sorted(dim.producers) == ["0", "1.sr"]


def test_reshape_as_ties_to_the_other_tensor():
    from exact import assert_exact

    torch.manual_seed(0)
    r = assert_exact(_ReshapeAs(), torch.randn(2, 5))
    assert [sorted(d.producers) for d in r.searcher.space.width] == [["a", "b"]]
