"""``torch.compile(model)`` of a model prepared for a search computes the eager search.

The gates' forward pre-hook (masks of every dim, the importance hook on their gradient) runs
eagerly (``torch.compiler.disable``); the layers and the masks they read compile. Regression:
before, dynamo traced into the pre-hook, broke the graph at the gradient hook and the second
step failed with "Trying to backward through the graph a second time".
"""

from __future__ import annotations

import copy

import pytest
import torch

import dmscale as dms
from transformer_zoo import TZOO, search_steps
from zoo import ZOO


def _entry(name: str):
    if name in TZOO:
        return TZOO[name].build(), TZOO[name].make_inputs()
    g = torch.Generator().manual_seed(1)
    return ZOO[name].build(), torch.randn((4,) + tuple(ZOO[name].input_shape[1:]), generator=g)


@pytest.mark.parametrize("name", ["small_cnn", "hf_bert", "hf_llama_gqa"])
def test_compiled_model_searches_exactly_as_the_eager_one(name):
    base, x = _entry(name)
    base.eval()  # no dropout; the gates train (importance is tracked)
    example = {k: v[:1] for k, v in x.items()} if isinstance(x, dict) else x[:1]
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        searcher = dms.prepare(model, example, dms.SearchConfig(resource="macs", target=0.5))
        searcher.gates.train()
        searcher.randomize_importance(0)
        run = torch.compile(model, backend="aot_eager") if compiled else model
        results.append(search_steps(run, model, x, searcher))
    (y0, imp0, a0), (y1, imp1, a1) = results
    torch.testing.assert_close(y1, y0)
    for a, b in zip(imp1 + a1, imp0 + a0):
        torch.testing.assert_close(a, b)
