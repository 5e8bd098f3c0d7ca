"""The same seed on CPU gives the same search result (issue 12).

Two library searches with the same seed and thread count -- same model init, same data,
same optimiser -- end with bit-identical structural parameters, importance and structure;
a different seed gives different importance. (The command line's equivalent, a resumed run
equal to an uninterrupted one, is in ``test_killed_runs.py``.)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import dmscale as dms

__all__: list[str] = []


def _search(seed: int, steps: int = 12) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Conv2d(3, 12, 3, padding=1), nn.BatchNorm2d(12), nn.ReLU(),
                        nn.Conv2d(12, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 5))
    x = torch.randn(16, 3, 8, 8)
    y = torch.randint(0, 5, (16,))
    searcher = dms.prepare(net, x[:1], dms.SearchConfig(resource="macs", target=0.4))
    opt = torch.optim.SGD([{"params": list(searcher.model_parameters()), "lr": 0.05},
                           {"params": list(searcher.structure_parameters()), "lr": 0.05}], momentum=0.9)
    for step in range(steps):
        loss = nn.functional.cross_entropy(net(x), y) + searcher.resource_loss(progress=step / steps)
        opt.zero_grad()
        loss.backward()
        opt.step()
    state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    return searcher.structure(), state


def test_same_seed_same_structure_and_weights() -> None:
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        (s1, w1), (s2, w2), (_, w3) = _search(0), _search(0), _search(1)
    finally:
        torch.set_num_threads(threads)
    assert s1 == s2
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)
    importance = [k for k in w1 if k.endswith("importance")]
    assert importance and any(not torch.equal(w1[k], w3[k]) for k in importance), "the seed has no effect"
