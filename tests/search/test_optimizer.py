"""searcher.optimizer (src/dmscale/search/optimizer.py): the weights' optimizer and Adam over the
structure stepped together, equal to the hand-written two-optimizer loop it replaces."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import dmscale as dms


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 6, generator=g), torch.randint(0, 4, (16,), generator=g)


def _searcher(net):
    x, _ = _data()
    return dms.prepare(net, x[:1], dms.SearchConfig(resource="params", target=0.4, settle=0.5))


def test_equals_the_hand_written_loop():
    total, (x, y) = 12, _data()
    a, b = _net(), _net()
    sa, sb = _searcher(a), _searcher(b)
    opt = sa.optimizer(torch.optim.SGD(sa.model_parameters(), lr=0.1, momentum=0.9), total_steps=total)
    w = torch.optim.SGD(sb.model_parameters(), lr=0.1, momentum=0.9)
    s = torch.optim.Adam(sb.structure_parameters(), lr=0.01, weight_decay=0.0)
    for step in range(total):
        progress = (step + 1) / total
        assert opt.progress == pytest.approx(progress)
        loss = nn.functional.cross_entropy(a(x), y) + sa.resource_loss(opt.progress)
        opt.zero_grad(); loss.backward(); opt.step()
        s.param_groups[0]["lr"] = 0.01 * sb.structure_lr_scale(progress)
        loss = nn.functional.cross_entropy(b(x), y) + sb.resource_loss(progress)
        w.zero_grad(); s.zero_grad(); loss.backward(); w.step(); s.step()
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, msg=n)
    assert sa.structure() == sb.structure()


def test_state_dict_round_trip_and_refusals():
    net = _net()
    searcher = _searcher(net)
    weights = torch.optim.SGD(searcher.model_parameters(), lr=0.1)
    opt = searcher.optimizer(weights, total_steps=4)
    x, y = _data()
    loss = nn.functional.cross_entropy(net(x), y) + searcher.resource_loss(opt.progress)
    loss.backward(); opt.step()
    again = searcher.optimizer(torch.optim.SGD(searcher.model_parameters(), lr=0.1), total_steps=4)
    again.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert again.steps_done == 1 and again.progress == 0.5
    with pytest.raises(ValueError, match="total_steps=4"):
        searcher.optimizer(torch.optim.SGD(searcher.model_parameters(), lr=0.1), total_steps=8).load_state_dict(opt.state_dict())
    with pytest.raises(ValueError, match="holds structural parameters"):
        searcher.optimizer(torch.optim.SGD(net.parameters(), lr=0.1), total_steps=4)
    with pytest.raises(ValueError, match="positive int"):
        searcher.optimizer(weights, total_steps=0)
    dms.detach(net)
