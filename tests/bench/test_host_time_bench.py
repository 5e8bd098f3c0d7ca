"""bench/host_time.py: the host time of a DMS step on models with the real layers and tiny widths."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import host_time  # noqa: E402


def test_the_tiny_models_keep_the_real_models_layers():
    import torch

    from search_proxies import PROXY_MODELS

    def kinds(model: torch.nn.Module) -> dict[str, int]:
        out: dict[str, int] = {}
        for m in model.modules():
            if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear, torch.nn.LayerNorm)) or "RMSNorm" in type(m).__name__:
                out[type(m).__name__] = out.get(type(m).__name__, 0) + 1
        return out
    # the same layers (and so the same hooks and operators) as the full-size proxy models; the
    # ResNet-50 is timm's (torchvision's has no width argument): the same convolutions and norms
    for name in ("vit_b16", "llama_135m"):
        assert kinds(host_time.TINY_MODELS[name].build()) == kinds(PROXY_MODELS[name].build()), name
    tiny, full = kinds(host_time.TINY_MODELS["resnet50"].build()), kinds(PROXY_MODELS["resnet50"].build())
    assert tiny["Conv2d"] == full["Conv2d"] == 53


@pytest.mark.slow
def test_host_time_measures_three_arms_and_renders_them(tmp_path):
    row = host_time.measure("resnet50", rounds=2, per_round=1)
    for arm in host_time.ARMS:
        assert 0 < row[arm]["q1"] <= row[arm]["median"] <= row[arm]["q3"]
    assert row["dms_ratio"] > 1.0  # the hooks and the masks' operators cost host time
    md = host_time.render({"rows": {"resnet50": row}, "command": "c", "commit": "x", "machine": "m"})
    assert "| resnet50 |" in md and f"{row['dms_ratio']:.2f}" in md
