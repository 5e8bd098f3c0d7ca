"""The coverage suite of issue 8 (see ``tests/coverage_suite.py`` and ``docs/coverage.md``).

* The instrument itself: :func:`coverage_suite.classify` on tiny hand-written models gives
  ``exact``, ``wrong`` (a deliberately broken export), ``crash`` (a plain RuntimeError in
  forward after prepare) and ``refused`` (a layer without a handler).
* A fast subset of the registries, in the default run: every model is ``exact`` or
  ``refused`` (never wrong, crash or timeout), and the cheap models the issue names are
  ``exact``.
* The whole sweep, ``@pytest.mark.slow``: 0 wrong, 0 crash, >= 90 % exact.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

import coverage_suite as cs
import dmscale as dms


# --------------------------------------------------------------------------- the instrument
class TinyCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                  nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU())
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).mean((2, 3)))


class FailsAfterPrepare(TinyCNN):
    """Runs normally until dmscale attaches its gates, then raises a plain RuntimeError."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "dms_gates" in self._modules:
            raise RuntimeError("boom after prepare")
        return super().forward(x)


class Scale(nn.Module):
    """A leaf layer whose weight is read outside torch's function dispatch (as a custom
    kernel would), so the trace cannot see how it meets the channels."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch._C.DisableTorchFunction():
            return x * self.gain.view(1, -1, 1, 1)


class WithUnknownLayer(TinyCNN):
    def __init__(self) -> None:
        super().__init__()
        self.body.insert(1, Scale(16))


def _entry(model_cls: type[nn.Module]) -> cs.Entry:
    return cs.Entry("unit", model_cls.__name__, cs._seeded(model_cls), cs._image(16))


def test_classify_exact_on_a_tiny_cnn():
    v = cs.classify(_entry(TinyCNN))
    assert v.verdict == "exact", v.detail
    assert 0 < v.macs_ratio < 1 and 0 < v.params_ratio < 1
    assert v.checks["cost_macs"] == v.checks["export_macs"]


def test_classify_wrong_when_the_export_is_broken(monkeypatch):
    export = dms.Searcher.export

    def broken(self):
        small = export(self)
        with torch.no_grad():
            small.head.weight.add_(0.1)  # perturbed: no longer the hardened supernet
        return small

    monkeypatch.setattr(dms.Searcher, "export", broken)
    v = cs.classify(_entry(TinyCNN))
    assert v.verdict == "wrong"
    assert "export != hardened" in v.detail and "max abs diff" in v.detail
    assert "cost" not in v.detail  # the counts still agree: only the output check failed


def test_classify_wrong_when_the_cost_is_off(monkeypatch):
    count = dms.count

    def off_by_one(model, inputs):
        out = count(model, inputs)
        return {**out, "params": out["params"] + 1}

    monkeypatch.setattr(dms, "count", off_by_one)
    v = cs.classify(_entry(TinyCNN))
    assert v.verdict == "wrong" and "params cost at hard masks" in v.detail and "(diff -1)" in v.detail


def test_classify_wrong_when_export_raises_verification_error(monkeypatch):
    def refuses(self):
        raise dms.VerificationError("layer 'head' diverges")

    monkeypatch.setattr(dms.Searcher, "export", refuses)
    v = cs.classify(_entry(TinyCNN))
    assert v.verdict == "wrong" and "VerificationError" in v.detail and "'head'" in v.detail


def test_classify_crash_on_a_plain_error_after_prepare():
    v = cs.classify(_entry(FailsAfterPrepare))
    assert v.verdict == "crash"
    assert "RuntimeError: boom after prepare" in v.detail


def test_classify_refused_on_an_unsupported_layer():
    v = cs.classify(_entry(WithUnknownLayer))
    assert v.verdict == "refused"
    assert v.detail.startswith("UnsupportedLayerError:") and "Scale" in v.detail


def test_compare_outputs_flattens_nested_outputs():
    a = {"x": torch.ones(2), "y": (torch.zeros(3), [torch.ones(1)]), "cache": object()}
    assert cs.compare_outputs(a, a) is None
    b = {"x": torch.ones(2), "y": (torch.zeros(3), [torch.ones(1) + 1e-2]), "cache": None}
    assert "out.y[1][0]" in cs.compare_outputs(b, a)
    assert "shape" in cs.compare_outputs({"x": torch.ones(3)}, {"x": torch.ones(2)})


def test_run_isolated_times_out():
    v = cs.run_isolated("ultralytics", "yolov8n", timeout=0.5)
    assert v.verdict == "timeout"


# --------------------------------------------------------------------------- fast subset
FAST = [  # (registry, model): small and quick, across the four registries
    ("torchvision", "mobilenet_v3_small"),
    ("torchvision", "resnet18"),
    ("timm", "test_resnet"),
    ("timm", "test_vit"),
    ("hf", "llama"),
    ("hf", "bert"),
]
MUST_BE_EXACT = [("hf", "gemma"), ("ultralytics", "yolov8n")]  # named in the issue


def _classify(registry: str, name: str) -> cs.Verdict:
    if registry == "ultralytics":
        pytest.importorskip("ultralytics")
    return cs.classify(cs.get_entry(registry, name))


@pytest.mark.parametrize("registry,name", FAST, ids=[f"{r}/{n}" for r, n in FAST])
def test_fast_subset_is_exact_or_refused(registry, name):
    v = _classify(registry, name)
    assert v.verdict in ("exact", "refused"), f"{registry}/{name}: {v.verdict}: {v.detail}"


@pytest.mark.parametrize("registry,name", MUST_BE_EXACT, ids=[f"{r}/{n}" for r, n in MUST_BE_EXACT])
def test_named_models_are_exact(registry, name):
    v = _classify(registry, name)
    assert v.verdict == "exact", f"{registry}/{name}: {v.verdict}: {v.detail}"


# --------------------------------------------------------------------------- whole sweep
@pytest.mark.slow
def test_whole_sweep():
    """Every registry, each model in a child process with its own time limit (2 at a time)."""
    import concurrent.futures as cf

    selection = []
    for reg in cs.REGISTRIES:
        if reg == "ultralytics":
            try:
                import ultralytics  # noqa: F401
            except ImportError:
                continue
        selection += cs.entries(reg)
    with cf.ThreadPoolExecutor(max_workers=2) as pool:
        verdicts = list(pool.map(lambda e: cs.run_isolated(e.registry, e.name), selection))
    counts = collections.Counter(v.verdict for v in verdicts)
    bad = [f"{v.registry}/{v.name}: {v.verdict}: {v.detail}" for v in verdicts if v.verdict in ("wrong", "crash")]
    counted = len(verdicts) - counts["skipped"]
    assert not bad, f"{len(bad)} wrong or crashed ({dict(counts)}):\n" + "\n".join(bad)
    assert counts["exact"] >= 0.9 * counted, dict(counts)
