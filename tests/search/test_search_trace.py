"""The search trace's numbers (src/dmscale/search/search_trace.py), against autograd computed
apart, on torchvision's ResNet-18: the resource and task gradients on every ratio, the cost
per element and the soft counts."""

from __future__ import annotations

import json

import pytest
import torch

import dmscale as dms
from dmscale.core.ratios import ratio_leaf
from dmscale.search.search_trace import TRACE_FILE, SearchTrace, read_trace

torchvision = pytest.importorskip("torchvision")


def _value(grad: torch.Tensor | None, gate) -> float:
    _, i = ratio_leaf(gate)
    return 0.0 if grad is None else float(grad.reshape(-1)[i if i is not None else 0])


def test_the_trace_splits_each_ratios_gradient_into_its_task_and_resource_parts(tmp_path):
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    searcher = dms.prepare(model, x, dms.SearchConfig(target=0.3))
    trace = SearchTrace(searcher, tmp_path)
    gates = trace.gates
    task = torch.nn.functional.cross_entropy(model(x), y)
    r_loss = searcher.resource_loss(progress=1.0)  # over the target: a gradient on every ratio
    leaves = trace._leaves()
    ref_task = torch.autograd.grad(task, leaves, retain_graph=True, allow_unused=True)
    ref_res = torch.autograd.grad(r_loss, leaves, retain_graph=True, allow_unused=True)
    by_leaf = lambda grads: {id(p): g for p, g in zip(leaves, grads)}  # noqa: E731
    trace.before_backward(r_loss)
    (task + r_loss).backward()
    trace.after_step("search", 1, 1.0)
    dims, records = read_trace(tmp_path)
    rec = records[0]
    assert [d["name"] for d in dims][:2] == ["conv1", "layer1.0.conv1"] and len(dims) == len(gates)
    for i, g in enumerate(gates):
        leaf = id(ratio_leaf(g)[0])
        assert rec["grad_resource"][i] == pytest.approx(_value(by_leaf(ref_res).get(leaf), g), rel=1e-4, abs=1e-9)
        assert rec["grad_task"][i] == pytest.approx(_value(by_leaf(ref_task).get(leaf), g), rel=1e-3, abs=1e-7)
    assert all(r < 0 for r in rec["grad_resource"])  # over the target, every ratio is pushed up
    # the cost of one channel: a residual stream (read by every block of its stage) costs more
    # than the inner width of one of its blocks
    cost = dict(zip([d["name"] for d in dims], rec["cost_per_element"]))
    assert cost["layer3.0.conv2"] > cost["layer3.1.conv1"] > 0
    w, _ = searcher.costs.masks("soft")
    assert rec["soft"][0] == pytest.approx(float(w[:64].sum().detach()), rel=1e-5)  # conv1's 64 slots
    assert rec["kept"] == [int(g.hard_mask().sum()) for g in gates]


def test_without_a_resource_loss_the_resource_part_is_zero(tmp_path):
    """The check of the check: below the target the resource loss is 0, so is its part."""
    model = torchvision.models.resnet18(num_classes=10)
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    searcher = dms.prepare(model, x, dms.SearchConfig(target=1.0))
    trace = SearchTrace(searcher, tmp_path)
    r_loss = searcher.resource_loss(progress=1.0)
    loss = torch.nn.functional.cross_entropy(model(x), y) + r_loss
    trace.before_backward(r_loss)
    loss.backward()
    trace.after_step("search", 1, 1.0)
    rec = json.loads((tmp_path / TRACE_FILE).read_text().splitlines()[1])
    assert set(rec["grad_resource"]) == {0.0} and any(g != 0 for g in rec["grad_task"])


def test_wants_traces_about_a_hundred_steps_with_the_first_and_last():
    steps = [s for s in range(1, 1001) if SearchTrace.wants(s, 1000)]
    assert steps[0] == 1 and steps[-1] == 1000 and 100 <= len(steps) <= 102
    assert [s for s in range(1, 6) if SearchTrace.wants(s, 5)] == [1, 2, 3, 4, 5]
