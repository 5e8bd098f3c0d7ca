"""Self-checks: prepare refuses a model its masks change, export catches a broken export."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dmscale as dms
from dmscale.trace.handlers.base import HANDLERS_BY_NAME, Handler, _REGISTRY


class Drift(nn.Module):
    """Output depends on how often it ran (a running statistic updated in eval mode too)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return x * self.calls


def _drift_net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), Drift(), nn.Linear(8, 2))


def test_prepare_refuses_a_model_that_open_masks_do_not_reproduce_and_names_the_layer():
    net = _drift_net()
    keys = list(net.state_dict())
    with pytest.raises(dms.VerificationError, match=r"'2' \(Drift\).*exclude=\['2'\]"):
        dms.prepare(net, torch.randn(3, 4), dms.SearchConfig(target=0.5))
    assert not hasattr(net, "dms_gates") and list(net.state_dict()) == keys
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in net.modules())


def test_verify_false_skips_the_check():
    dms.prepare(_drift_net(), torch.randn(3, 4), dms.SearchConfig(target=0.5, verify=False))


class Doubler(nn.Module):
    """A user layer: per-channel scale."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.rand(n) + 0.5)

    def forward(self, x):
        return x * self.scale


def _broken_prune(m: nn.Module, in_keep, out_keep) -> None:
    keep = out_keep if out_keep is not None else in_keep
    if keep is not None:  # bug: keeps the first channels, not the kept ones
        m.scale = nn.Parameter(m.scale.data[: keep.numel()].clone())


def _trace(tr, name, m, args, out):
    lab = tr.label_of(args[0])
    ids = None if lab is None else lab.ids
    tr.record_layer(name, "broken_doubler", ids, ids, macs_sides=())
    if lab is not None:
        tr.set_label(out, lab.dim, lab.ids)


@pytest.fixture
def broken_handler():
    handler = Handler("broken_doubler", _trace, _broken_prune, lambda m: {"scale": {0: "out"}},
                      lambda m: (), channel_dim=-1)
    dms.register_handler(Doubler, handler)
    yield
    _REGISTRY[:] = [(k, h) for k, h in _REGISTRY if h is not handler]
    HANDLERS_BY_NAME.pop("broken_doubler", None)


def test_export_catches_a_broken_export_and_names_the_layer(broken_handler):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), Doubler(8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    searcher = dms.prepare(net, x, dms.SearchConfig(target=0.5))
    with torch.no_grad():
        searcher.gates.width[0].importance.copy_(torch.arange(8.0))  # keep the last channels
        searcher.gates.width[0].set_count(4)
    with pytest.raises(dms.VerificationError, match=r"'1' \(Doubler\)"):
        searcher.export()
    searcher.export(verify=False)  # the check can be skipped
