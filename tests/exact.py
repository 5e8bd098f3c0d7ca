"""The three exactness checks every supported model must pass, as one test helper.

1. open masks (every channel and block kept) reproduce the original model's outputs;
2. the export computes what the hardened supernet computes, for random structures (random
   ratios and random importance, so kept elements are not only the leading ones);
3. the cost at hard masks is ``dms.count`` of the export.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import dmscale as dms


def flat_tensors(out: Any) -> list[torch.Tensor]:
    """Every tensor of a (nested) model output, in order."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in flat_tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in flat_tensors(o)]
    if hasattr(out, "to_tuple"):
        return flat_tensors(out.to_tuple())
    return []


def max_abs_diff(a: Any, b: Any) -> float:
    """Largest absolute difference over all output tensors (their counts must match)."""
    ta, tb = flat_tensors(a), flat_tensors(b)
    assert len(ta) == len(tb), f"outputs differ in number: {len(ta)} vs {len(tb)} tensors"
    for x, y in zip(ta, tb):
        assert x.shape == y.shape, f"output shapes differ: {tuple(x.shape)} vs {tuple(y.shape)}"
    return max((float((x.double() - y.double()).abs().max()) for x, y in zip(ta, tb) if x.numel()), default=0.0)


@dataclass
class Exactness:
    open_diff: float  # max |open masks - original|
    export_diffs: list[float]  # max |export - hardened| per random structure
    costs: list[tuple[float, int]]  # (searcher hard MACs, dms.count of the export)
    searcher: Any
    scale: float  # max |original output|, to judge the diffs


def check_exact(model: nn.Module, x: Any, seeds: tuple[int, ...] = (0, 1),
                config: dms.SearchConfig | None = None) -> Exactness:
    """Prepare ``model`` (eval mode) and measure the three exactness properties."""
    model.eval()
    with torch.no_grad():
        reference = model(x)
    searcher = dms.prepare(model, x, config or dms.SearchConfig(resource="macs", target=1.0))
    gates = list(searcher.gates.width) + list(searcher.gates.depth)
    with torch.no_grad():
        for t in gates:
            t.a.fill_(0.0)
        with searcher.hardened():
            opened = model(x)
    diffs, costs = [], []
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for t in gates:
                t.a.fill_(float(torch.rand((), generator=g)) * t.max_ratio)
            searcher.randomize_importance(g)  # kept elements anywhere, not only leading ones
            with searcher.hardened():
                hard = model(x)
        small = searcher.export().eval()
        with torch.no_grad():
            diffs.append(max_abs_diff(small(x), hard))
        costs.append((searcher.resources()["hard"], dms.count(small, x)["macs"]))
    scale = max(float(t.abs().max()) for t in flat_tensors(reference) if t.numel())
    return Exactness(max_abs_diff(opened, reference), diffs, costs, searcher, scale)


def assert_exact(model: nn.Module, x: Any, seeds: tuple[int, ...] = (0, 1), tol: float = 1e-4,
                 config: dms.SearchConfig | None = None) -> Exactness:
    """:func:`check_exact`, asserting each property (diffs relative to the output scale)."""
    r = check_exact(model, x, seeds, config)
    bound = tol * max(1.0, r.scale)
    assert r.open_diff <= bound, f"open masks differ from the original by {r.open_diff:.3g}"
    for seed, d in zip(seeds, r.export_diffs):
        assert d <= bound, f"seed {seed}: export differs from the hardened supernet by {d:.3g}"
    for seed, (hard, counted) in zip(seeds, r.costs):
        assert round(hard) == counted, f"seed {seed}: hard cost {hard:.0f} != count of the export {counted}"
    return r


def drop_units(searcher: dms.Searcher, dropped: list[int]) -> None:
    """Harden the (one) depth gate so that exactly the units ``dropped`` are removed."""
    (gate,) = searcher.gates.depth
    importance = torch.arange(gate.n_units, 0, -1, dtype=torch.float32) + gate.n_units
    importance[dropped] = torch.arange(len(dropped), dtype=torch.float32)
    with torch.no_grad():
        gate.importance.copy_(importance)
        gate.set_count(gate.n_units - len(dropped))
    assert gate.unit_hard_mask().nonzero().flatten().tolist() == \
        [i for i in range(gate.n_units) if i not in dropped]
