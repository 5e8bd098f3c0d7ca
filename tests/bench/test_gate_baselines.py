"""The baseline gates of bench/gates.py (issue 10, table 1) work behind the StructuralGate protocol.

For each of MES, SNS, GET and DMS without importance normalisation, on a small ResNet: a
short structure-only search with the resource loss, then the budget solver, lands the hard
cost within a few % under the target; the export computes what the hardened supernet
computes, and its exact count equals the searcher's hard cost. DMS's default gate is
unchanged when no factory is given.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import dmscale as dms
from dmscale.tasks.models import ResNetCifar

ROOT = Path(__file__).resolve().parents[2]
from bench.lib import gates_lib as gl  # noqa: E402

TARGET = 0.5


def _search(name: str) -> tuple[torch.nn.Module, dms.Searcher, torch.Tensor]:
    torch.manual_seed(0)
    model = ResNetCifar(depth=8, width=4, in_channels=1)
    x = torch.randn(16, 1, 8, 8)
    y = torch.randint(0, 10, (16,))
    searcher = dms.prepare(model, x[:2], dms.SearchConfig(target=TARGET, gate_factory=gl.gate_factory(name)))
    for p in searcher.model_parameters():
        p.requires_grad_(False)
    opt = torch.optim.Adam(list(searcher.structure_parameters()), lr=0.05)
    model.train()
    steps = 40
    for step in range(steps):
        loss = torch.nn.functional.cross_entropy(model(x), y) + searcher.resource_loss(progress=step / steps)
        opt.zero_grad()
        loss.backward()
        opt.step()
    searcher.meet_target()
    return model, searcher, x[:2]


@pytest.mark.parametrize("name", ["mes", "sns", "get", "dms_nonorm"])
def test_baseline_gate_reaches_target_and_exports_exactly(name: str) -> None:
    model, searcher, x = _search(name)
    kind = {"mes": gl.MESGate, "sns": gl.SNSGate, "get": gl.GETGate}.get(name, dms.DifferentiableTopK)
    assert all(type(g) is kind for g in searcher.gates.width)
    res = searcher.resources()
    assert 0.9 * res["target"] <= res["hard"] <= res["target"], res
    small = searcher.export()  # verify=True: raises when the export differs from the hardened model
    assert dms.count(small, x)["macs"] == res["hard"]
    model.eval()
    with searcher.hardened():
        want = model(x)
    assert torch.allclose(small.eval()(x), want, atol=1e-5)
    state = searcher.state_dict()
    assert state["config"]["gate_factory"] in (None, f"bench.lib.gates_lib.{getattr(kind, '__qualname__', '')}",
                                               "bench.lib.gates_lib.no_normalization")


def test_default_gate_is_dms() -> None:
    model = ResNetCifar(depth=8, width=4, in_channels=1)
    searcher = dms.prepare(model, torch.randn(2, 1, 8, 8), dms.SearchConfig(target=TARGET))
    assert all(type(g) is dms.DifferentiableTopK for g in searcher.gates.width)
    assert searcher.state_dict()["config"]["gate_factory"] is None


def test_structure_parameter_counts() -> None:
    model = ResNetCifar(depth=8, width=4, in_channels=1)
    x = torch.randn(2, 1, 8, 8)
    n = {}
    for name in ("dms", "mes", "sns"):
        s = dms.prepare(model, x, dms.SearchConfig(target=TARGET, gate_factory=gl.gate_factory(name)))
        n[name] = gl.n_structure_params(s.gates)
        dms.detach(model)
    assert n["dms"] < n["sns"] <= n["mes"]
