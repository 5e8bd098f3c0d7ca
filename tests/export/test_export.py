"""Export: a removed block returns what the block returned (issue 8, defect 2)."""

from __future__ import annotations

import torch
from torch import nn

import dmscale as dms
from dmscale.export.shrink import SkipBlock


class TupleBlock(nn.Module):
    """A residual block returning ``(x + f(x), None)``; the caller takes ``out[0]``."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.Linear(d, 16), nn.ReLU(), nn.Linear(16, d))

    def forward(self, x):
        return x + self.f(x), None


class TupleNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([TupleBlock() for _ in range(3)])
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)[0]
        return self.head(h)


class DictBlock(TupleBlock):
    def forward(self, x):
        return {"hidden": x + self.f(x)}


def test_removed_tuple_block_keeps_the_tuple():
    torch.manual_seed(0)
    model = TupleNet().eval()
    x = torch.randn(5, 4)
    searcher = dms.prepare(model, x, dms.SearchConfig(resource="macs", target=0.9, search_width=False))
    assert [len(d.blocks) for d in searcher.space.depth] == [3]
    with torch.no_grad():
        searcher.gates.depth[0].importance.copy_(torch.tensor([3.0, 1.0, 2.0]))
        searcher.gates.depth[0].set_count(2)
    with torch.no_grad(), searcher.hardened():
        hard = model(x)
    small = searcher.export()
    assert isinstance(small.blocks[1], SkipBlock)
    out = small.blocks[1](torch.ones(5, 8))
    assert isinstance(out, tuple) and out[1] is None and out[0].shape == (5, 8)
    with torch.no_grad():
        torch.testing.assert_close(small(x), hard)
    assert searcher.structure()["removed_blocks"][0]["output"] == {"type": "tuple", "items": [{"tensor": True}, None]}


def test_block_with_an_output_it_cannot_rebuild_is_not_removable():
    model = nn.Sequential(nn.Linear(4, 8), DictBlock(), nn.Identity())
    space = dms.discover(model, torch.randn(2, 4))
    assert space.depth == []
