"""Property-based fuzzing of prepare / export / count / apply_structure / detach (issue 12).

Hypothesis draws a network (:mod:`strategies`: conv stacks with residual adds, concat,
split, depthwise and grouped convs, SE gates, MLP heads; MLPs; tiny Llamas with GQA and tied
embeddings) and a random hard structure (per searched dimension a random importance and a
pruning ratio in [0, max_ratio]), and checks:

1. open masks reproduce the model (:func:`exact.max_abs_diff`, relative 1e-5);
2. ``export()`` computes what the hardened supernet computes (relative 1e-4);
3. the exact cost at hard masks equals ``dms.count`` of the export (MACs and params);
4. ``apply_structure`` on a fresh copy gives the export's state_dict shapes and function;
5. tied embeddings stay tied in the export;
6. ``dms.detach`` restores the model exactly (:class:`model_state.ModelSnapshot`: state_dict
   keys and values, outputs, train/eval flags, no hooks, no extra submodules).

The default run draws 30 examples, derandomised (the same 30 on every run); the ``slow``
variant draws several hundred with a fresh random seed each run.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from exact import flat_tensors, max_abs_diff
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from model_state import ModelSnapshot, hooks_of
from strategies import NetCase, any_nets

import dmscale as dms

_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _call(model: torch.nn.Module, x: Any) -> Any:
    with torch.no_grad():
        return model(**x) if isinstance(x, dict) else model(x)


def _scale(out: Any) -> float:
    return max(1.0, max(float(t.abs().max()) for t in flat_tensors(out) if t.numel()))


def check_case(case: NetCase, data: st.DataObject) -> None:
    """Every property of the module docstring on one drawn network and structure."""
    net, x = case.model, case.inputs
    snap = ModelSnapshot.take(net, x)
    fresh = copy.deepcopy(net)
    reference = _call(net, x)
    scale = _scale(reference)
    searcher = dms.prepare(net, x, dms.SearchConfig(resource="macs", target=1.0))
    gates = list(searcher.gates.width) + list(searcher.gates.depth)
    assert gates, f"{case.what}: nothing to search"
    with torch.no_grad():
        for t in gates:
            t.a.zero_()
        with searcher.hardened():
            opened = _call(net, x)
    assert max_abs_diff(opened, reference) <= 1e-5 * scale, f"{case.what}: open masks change the output"

    with torch.no_grad():  # (random hard structure)
        for i, t in enumerate(gates):
            seed = data.draw(st.integers(0, 2 ** 16), label=f"importance seed {i}")
            t.importance.copy_(torch.rand(t.importance.shape, generator=torch.Generator().manual_seed(seed)))
            t.a.fill_(data.draw(st.floats(0.0, 1.0), label=f"ratio {i}") * t.max_ratio)
        with searcher.hardened():
            hard = _call(net, x)
    small = searcher.export().eval()
    structure = searcher.structure()
    where = f"{case.what}: kept {[(w['name'], w['size'], w['kept']) for w in structure['width']]}"
    out = _call(small, x)
    diff = max_abs_diff(out, hard)
    assert diff <= 1e-4 * scale, f"{where}: export differs from the hardened supernet by {diff:.3g}"
    for res in ("macs", "params"):
        counted = dms.count(small, x)[res]
        assert round(searcher.costs.exact("hard", res)) == counted, \
            f"{where}: {res} at hard masks {searcher.costs.exact('hard', res):.0f} != count of the export {counted}"
    assert not hooks_of(small), f"{where}: export has hooks {hooks_of(small)}"
    again = dms.apply_structure(fresh, structure)
    shapes = {k: tuple(v.shape) for k, v in small.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in again.state_dict().items()} == shapes, f"{where}: apply_structure shapes"
    if getattr(getattr(net, "config", None), "tie_word_embeddings", False):
        assert small.lm_head.weight is small.get_input_embeddings().weight, f"{where}: tied weights untied"
        assert again.lm_head.weight is again.get_input_embeddings().weight, f"{where}: apply_structure untied"

    dms.detach(net)
    snap.assert_same(net, f"{case.what}: after detach")


@settings(max_examples=30, derandomize=True, **_SETTINGS)
@given(case=any_nets(), data=st.data())
def test_fuzz_prepare_export_detach(case: NetCase, data: st.DataObject) -> None:
    check_case(case, data)


@pytest.mark.slow
@settings(max_examples=400, **_SETTINGS)
@given(case=any_nets(), data=st.data())
def test_fuzz_prepare_export_detach_slow(case: NetCase, data: st.DataObject) -> None:
    check_case(case, data)
