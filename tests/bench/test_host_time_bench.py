"""bench/host_time.py: the host time of a DMS step on models with the real layers and tiny widths."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from bench import host_time  # noqa: E402


def test_the_tiny_models_keep_the_real_models_layers():
    import torch

    from bench.search_proxies import PROXY_MODELS

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


def test_guard_ms_counts_the_guard_checks_of_compiled_calls_only():
    import torch

    layer, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    compiled = torch.compile(layer, backend="eager")
    compiled(x)  # compiles
    assert host_time.guard_ms(lambda: layer(x)) == 0
    assert host_time.guard_ms(lambda: compiled(x)) > 0


@pytest.mark.slow
def test_host_time_measures_every_arm_and_renders_them(tmp_path):
    row = host_time.measure("resnet50", rounds=2, per_round=1, compiled=True)
    for arm in (*host_time.ARMS, *host_time.COMPILED_ARMS):
        assert 0 < row[arm]["q1"] <= row[arm]["median"] <= row[arm]["q3"]
    assert row["dms_ratio"] > 1.0  # the hooks and the masks' operators cost host time
    assert row["plain"]["guards_ms"] == row["dms"]["guards_ms"] == 0  # nothing compiled
    assert row["dms_compiled"]["guards_ms"] > row["plain_compiled"]["guards_ms"] > 0  # the hooks are guarded too
    md = host_time.render({"rows": {"resnet50": row}, "command": "c", "commit": "x", "machine": "m"})
    assert "| resnet50 |" in md and f"{row['dms_ratio']:.2f}" in md and f"{row['dms_compiled_ratio']:.2f}" in md


def test_render_shows_the_compiled_arms_where_a_row_has_them():
    def arm(ms: float) -> dict[str, float]:
        return {"median": ms, "q1": ms - 1, "q3": ms + 1}

    base = {"shape": "s", "rounds": 2, "per_round": 1, "plain": arm(10.0), "dms": arm(15.0), "dms_ratio": 1.5}
    now = {**base, "model": "vit_b16", "plain_compiled": arm(8.0), "dms_compiled": arm(10.0),
           "dms_compiled_ratio": 1.25}
    before = {**base, "model": "vit_b16", "code": "before (x)"}  # measured without --compiled
    md = host_time.render({"rows": {"vit_b16": now, "vit_b16@before": before}, "command": "c", "commit": "x",
                           "machine": "m"})
    rows = [line for line in md.splitlines() if line.startswith("| vit_b16 |")]
    assert len(rows) == 2 and all(r.count("|") == 16 for r in rows)  # 15 columns each
    assert rows[0].endswith("| - | - | - | - | - | - | 2 |")  # the row before: no compiled arms, no guard times
    assert "| 8.0 (7.0-9.0) | 10.0 (9.0-11.0) | 1.25 | - | - | - | 2 |" in rows[1]  # (measured before guards)
    now["plain_compiled"]["guards_ms"], now["dms_compiled"]["guards_ms"] = 0.5, 1.25
    md = host_time.render({"rows": {"vit_b16": now}, "command": "c", "commit": "x", "machine": "m"})
    assert "| 1.25 | - / 0.50 / 1.25 | - | - | 2 |" in md
    now["dms_per_layer"], now["dms_per_layer_ratio"] = arm(16.0), 1.6
    md = host_time.render({"rows": {"vit_b16": now}, "command": "c", "commit": "x", "machine": "m"})
    assert "| 16.0 (15.0-17.0) | 1.60 | 2 |" in md


def test_the_per_layer_arm_runs_with_the_fold_batch_off_and_switches_it_back():
    from dmscale.core import fold_batch

    seen = []
    host_time._folding_alone(lambda: seen.append(fold_batch.ENABLED))()
    assert seen == [False] and fold_batch.ENABLED
    with pytest.raises(ZeroDivisionError):
        host_time._folding_alone(lambda: 1 / 0)()
    assert fold_batch.ENABLED
    fold_batch.ENABLED = False  # switched off by the caller: it stays off
    try:
        host_time._folding_alone(lambda: None)()
        assert not fold_batch.ENABLED
    finally:
        fold_batch.ENABLED = True


@pytest.mark.slow  # builds every arm of a ViT-B/16 (~12 s on 2 cores)
def test_the_per_layer_arm_is_built_only_when_asked_for():
    spec = host_time.TINY_MODELS["vit_b16"]
    assert list(host_time._arms(spec)) == ["plain", "dms", "dms_fused"]
    assert list(host_time._arms(spec, per_layer=True)) == ["plain", "dms", "dms_fused", "dms_per_layer"]
