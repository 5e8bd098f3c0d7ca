"""Real model definitions (timm, Ultralytics) at small inputs: each is exact or pinned.

Exact: open masks reproduce the model, the export computes what the hardened supernet
computes, and the hard cost is ``dms.count`` of the export (see ``exact.py``). Channels that
cannot be searched exactly are fixed, never wrong.
"""

from __future__ import annotations

import os

import pytest
import torch
from exact import assert_exact

import dmscale as dms

dms.ensure_torchvision()
timm = pytest.importorskip("timm")

# name -> (create_model kwargs, input size, search has widths)
TIMM = {
    "pit_ti_224": (dict(img_size=64), 64, True),  # parameter views passed to submodules
    "cait_xxs24_224": (dict(img_size=32), 32, True),  # width read to shape the heads
    "nfnet_l0": ({}, 64, True),  # ScaledStdConv2d with a per-channel gain
    "convnext_atto": ({}, 32, True),  # LayerScale
    "convnextv2_atto": ({}, 32, False),  # GlobalResponseNorm: statistics over channels
    "hgnetv2_b0": ({}, 64, True),  # LearnableAffineBlock
    "poolformerv2_s12": ({}, 32, True),  # Scale
    "poolformer_s12": ({}, 32, True),
    "swin_tiny_patch4_window7_224": (dict(img_size=56, window_size=7), 56, True),  # relative position bias
}


@pytest.mark.parametrize("name", sorted(TIMM))
def test_timm_model_is_exact(name):
    kwargs, size, searchable = TIMM[name]
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=4, **kwargs)
    r = assert_exact(model, torch.randn(2, 3, size, size))
    assert bool(r.searcher.space.width) == searchable


def _import_detection_model() -> type:
    """ultralytics.nn.tasks.DetectionModel (the print options it sets are restored by the
    autouse fixture in conftest.py)."""
    os.environ.setdefault("YOLO_VERBOSE", "False")
    pytest.importorskip("ultralytics")
    from ultralytics.nn.tasks import DetectionModel

    return DetectionModel


@pytest.mark.parametrize("cfg", ["yolov8n.yaml", "yolo11n.yaml"])
def test_ultralytics_detection_model_is_exact(cfg):
    DetectionModel = _import_detection_model()
    torch.manual_seed(0)
    model = DetectionModel(cfg, verbose=False).eval()
    # eval output: (decoded boxes and scores, raw head outputs); every tensor is compared
    r = assert_exact(model, torch.randn(1, 3, 64, 64))
    assert len(r.searcher.space.width) > 10 and r.searcher.space.depth


def test_attention_flop_formulas_count_grouped_query_attention_as_expanded():
    """Regression (torch 2.11 on a GPU machine): torch's ``sdpa_flop_count`` asserted equal
    query and key/value heads, so tracing a Llama with 9 query and 3 key/value heads failed;
    every forward attention formula now counts GQA as its expanded form."""
    from torch.utils.flop_counter import flop_registry, sdpa_flop_count

    from dmscale.cost.resources import _SDPA_OPS, _gqa_safe

    q, kv, full = (2, 9, 16, 64), (2, 3, 16, 64), (2, 9, 16, 64)
    want = sdpa_flop_count(q, full, full)

    def strict(query_shape, key_shape, value_shape, *args, **kwargs):  # torch < 2.13's check
        assert key_shape[1] == query_shape[1], "query/key/value shapes are incompatible"
        return sdpa_flop_count(query_shape, key_shape, value_shape)
    assert _gqa_safe(strict)(q, kv, kv) == want
    for name in _SDPA_OPS:
        op = getattr(torch.ops.aten, name, None)
        if op is not None and op in flop_registry:
            assert flop_registry[op](q, kv, kv) == want, name
            tensors = [torch.empty(sh, device="meta") for sh in (q, kv, kv)]  # what the counter passes
            assert flop_registry[op](*tensors) == want, name
