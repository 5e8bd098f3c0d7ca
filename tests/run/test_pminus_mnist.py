"""DMS_p- on MNIST: only structural parameters are trained on a pretrained supernet.

A SmallCNN is pretrained inside the test (one short epoch on 14x14 MNIST), then for each budget 300
structural steps (weights frozen) and the budget solver give an exported model whose exact
cost is within 2 % under the target, and which classifies well once its batch norms' statistics
are measured again (``recalibrate_batchnorm``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import dmscale as dms
from dmscale.data.mnist import mnist_tensors
from dmscale.export.calibrate import recalibrate_batchnorm
from dmscale.tasks.models import SmallCNN

STEPS = 300


@pytest.fixture(scope="module")
def pretrained():
    torch.manual_seed(0)
    x_train, y_train, x_test, y_test = mnist_tensors(train_limit=8000, test_limit=1000)
    # 14x14 images keep the test fast on 2 CPU cores
    x_train, x_test = nn.functional.avg_pool2d(x_train, 2), nn.functional.avg_pool2d(x_test, 2)
    model = SmallCNN(width=12)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for i in range(0, len(x_train), 32):
        loss = nn.functional.cross_entropy(model(x_train[i:i + 32]), y_train[i:i + 32])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return model, (x_train, y_train, x_test, y_test)


def _accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def test_pretrained_supernet_is_good(pretrained):
    model, (_, _, x_test, y_test) = pretrained
    assert _accuracy(model, x_test, y_test) > 0.85


@pytest.mark.parametrize(("resource", "target"),
                         [("macs", 0.5), pytest.param("macs", 0.25, marks=pytest.mark.slow), ("params", 0.5)])
def test_structure_only_search_meets_budget(pretrained, resource, target):
    base, (x_train, y_train, x_test, y_test) = pretrained
    model = copy.deepcopy(base)
    example = x_train[:1]
    searcher = dms.prepare(model, example, dms.SearchConfig(resource=resource, target=target))
    for p in searcher.model_parameters():
        p.requires_grad_(False)
    opt = torch.optim.Adam(searcher.structure_parameters(), lr=0.02)
    g = torch.Generator().manual_seed(0)
    model.train()
    for step in range(STEPS):
        idx = torch.randint(0, len(x_train), (32,), generator=g)
        progress = min(1.0, step / (0.7 * STEPS))
        loss = nn.functional.cross_entropy(model(x_train[idx]), y_train[idx]) + searcher.resource_loss(progress)
        opt.zero_grad()
        loss.backward()
        opt.step()
    searched = searcher.resources()
    # the search itself gets close; the budget solver lands just under the target
    assert searched["hard"] <= 1.15 * searcher.target_cost, searched
    searcher.meet_target()
    small = searcher.export()
    exact = dms.count(small, example)[resource]
    assert 0.98 * searcher.target_cost <= exact <= searcher.target_cost, (exact, searcher.target_cost)
    # weights untouched, the export classifies well with its norms' statistics measured again.
    # Without that the accuracy is chaotic at a quarter of the MACs: 0.65-0.78 over six seeds,
    # and a 1-ulp change of one depth gradient at step 0 once gave 0.35 (the statistics of the
    # channels kept no longer match); recalibrated, 0.82-0.87 over the same seeds
    recalibrate_batchnorm(small, [x_train[i:i + 256] for i in range(0, 2048, 256)])
    assert _accuracy(small, x_test, y_test) > 0.7
