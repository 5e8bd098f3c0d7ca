"""One property suite over the CNN zoo (timm tests/test_models.py style).

For every model: open masks reproduce the original; the export computes what the hardened
supernet computes; the differentiable cost at hard masks is the exact count of the export;
every structural parameter gets a task-loss gradient; detach and apply_structure restore.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from zoo import ZOO

import dmscale as dms

MODELS = sorted(ZOO)


def _inputs(entry, batch: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, *entry.input_shape[1:], generator=g)


def _train_steps(model: nn.Module, searcher, x: torch.Tensor, steps: int = 3) -> None:
    """A few real steps so importance is not flat (in the search's first half: the settle
    phase would freeze depth, whose gradients these tests check)."""
    model.train()
    opt = torch.optim.SGD([
        {"params": list(searcher.model_parameters()), "lr": 1e-3},
        {"params": list(searcher.structure_parameters()), "lr": 1e-2},
    ])
    target = torch.arange(x.shape[0]) % 10
    for i in range(steps):
        loss = nn.functional.cross_entropy(model(x), target) + searcher.resource_loss(progress=0.5 * (i + 1) / steps)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def _randomize_structure(searcher, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in list(searcher.gates.width) + list(searcher.gates.depth):
            t.a.fill_(float(torch.rand((), generator=g)) * t.max_ratio)


@pytest.fixture(scope="module", params=MODELS)
def prepared(request):
    entry = ZOO[request.param]
    model = entry.build().eval()
    x = _inputs(entry)
    with torch.no_grad():
        reference = model(x)
    keys = list(model.state_dict().keys())
    fresh = copy.deepcopy(model)
    searcher = dms.prepare(model, x, dms.SearchConfig(resource="macs", target=0.5))
    return dict(name=request.param, model=model, x=x, reference=reference, keys=keys,
                fresh=fresh, searcher=searcher)


def test_open_masks_equal_original(prepared):
    model, searcher = prepared["model"], prepared["searcher"]
    with torch.no_grad(), searcher.hardened():
        out = model(prepared["x"])
    torch.testing.assert_close(out, prepared["reference"], atol=1e-5, rtol=0)


def test_every_structure_parameter_gets_task_gradient(prepared):
    model, searcher, x = prepared["model"], prepared["searcher"], prepared["x"]
    _train_steps(model, searcher, x)
    importance = [t.importance for t in list(searcher.gates.width) + list(searcher.gates.depth)]
    assert all(float(c.abs().sum()) > 0 for c in importance), "importance was not populated"
    # mid-search: a's fuzzy band (|c' - a| < 3/N) holds live elements, not the dead tail
    with torch.no_grad():
        for t in list(searcher.gates.width) + list(searcher.gates.depth):
            t.a.fill_(0.4 * t.max_ratio)
    model.train()
    for p in searcher.structure_parameters():
        p.grad = None
    task = nn.functional.cross_entropy(model(x), torch.arange(x.shape[0]) % 10)
    task.backward()
    names = [d.name for d in searcher.space.width] + [d.name for d in searcher.space.depth]
    for name, t in zip(names, [*searcher.gates.width, *searcher.gates.depth]):
        assert t.ratio_grad is not None and float(t.ratio_grad.abs()) > 0, f"no task gradient for {name}"
    model.eval()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_export_equals_hardened_and_cost_is_exact(prepared, seed):
    model, searcher, x = prepared["model"], prepared["searcher"], prepared["x"]
    _randomize_structure(searcher, seed)
    model.eval()
    with torch.no_grad(), searcher.hardened():
        hard = model(x)
    small = searcher.export().eval()
    with torch.no_grad():
        out = small(x)
    torch.testing.assert_close(out, hard, atol=1e-4, rtol=1e-4)
    # the differentiable cost at hard masks is the exact count of the export
    exact = dms.count(small, x)
    assert round(searcher.costs.exact("hard", "macs")) == exact["macs"]
    assert round(searcher.costs.exact("hard", "params")) == exact["params"]
    # shapes follow the structure
    structure = searcher.structure()
    modules = dict(small.named_modules())
    removed = {b["name"] for b in structure["removed_blocks"]}
    for name, spec in structure["layers"].items():
        if any(name.startswith(r + ".") for r in removed):
            assert name not in modules
            continue
        w = modules[name].weight
        if spec["out"] is not None:
            assert w.shape[0] == len(spec["out"]) or w.dim() == 1 and w.shape[0] == len(spec["out"]), name
        if spec["in"] is not None and spec["handler"] in ("conv", "linear") and w.shape[1] != 1:
            assert w.shape[1] == len(spec["in"]), name
    for r in removed:
        assert not any(True for _ in modules[r].parameters()), f"removed block {r} still has weights"


def test_apply_structure_and_detach(prepared):
    model, searcher, x = prepared["model"], prepared["searcher"], prepared["x"]
    _randomize_structure(searcher, 7)
    small = searcher.export()
    structure = searcher.structure()
    again = dms.apply_structure(copy.deepcopy(prepared["fresh"]), structure)
    shapes = {k: tuple(v.shape) for k, v in small.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in again.state_dict().items()} == shapes
    assert prepared["searcher"].supernet_cost == dms.count(prepared["fresh"], x)["macs"]
    dms.detach(model)
    assert list(model.state_dict().keys()) == prepared["keys"]
    assert not hasattr(model, "dms_gates")
    with torch.no_grad():
        out = model.eval()(x)
    # training steps changed the weights: compare with the same weights, no hooks
    with torch.no_grad():
        plain = copy.deepcopy(model)(x)
    torch.testing.assert_close(out, plain)
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
