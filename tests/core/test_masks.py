"""Mask hooks: keyword inputs (defect 3) and the MHA fast-path switch (defect 11)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dmscale as dms


class KeywordCall(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 12)
        self.fc = nn.Linear(12, 3)

    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.fc(input=h)  # the input as a keyword


def test_layer_called_with_its_input_as_a_keyword_is_masked():
    torch.manual_seed(0)
    model = KeywordCall()
    x = torch.randn(8, 6)
    searcher = dms.prepare(model, x, dms.SearchConfig(resource="macs", target=0.5))
    loss = model(x).pow(2).mean()
    loss.backward()
    a = searcher.gates.width[0].a
    assert a.grad is not None and a.grad.abs() > 0  # the mask acts, so the task loss sees it
    assert searcher.gates.width[0].importance.abs().sum() > 0
    with torch.no_grad():
        searcher.gates.width[0].set_count(5)
    model.eval()
    with torch.no_grad(), searcher.hardened():
        hard = model(x)
    small = searcher.export()
    with torch.no_grad():
        torch.testing.assert_close(small(x), hard)


class Failing(nn.Module):
    def forward(self, x):
        raise RuntimeError("boom")


class MHANet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 16)
        self.fail = False

    def forward(self, x):
        h = self.inp(x)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        h = h + self.fc2(torch.relu(self.fc1(h)))
        if self.fail:
            raise RuntimeError("boom")
        return h


def test_mha_fastpath_switch_is_restored_when_a_forward_raises():
    model = MHANet().eval()
    x = torch.randn(2, 5, 8)
    assert torch.backends.mha.get_fastpath_enabled()
    dms.prepare(model, x, dms.SearchConfig(resource="macs", target=0.8))
    model.fail = True
    with pytest.raises(RuntimeError, match="boom"):
        model(x)
    assert torch.backends.mha.get_fastpath_enabled()
