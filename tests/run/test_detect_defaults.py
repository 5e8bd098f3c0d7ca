"""`dmscale search --task detect` with no tuning flags trains: the task's auto defaults
(AdamW at lr 1e-3, no mirroring or mosaic) instead of SGD at lr 0.05, which collapsed a YOLO
to predicting no objects; the summary names what was chosen."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("dmscale.integrations.ultralytics", reason="the detection task needs ultralytics")

from dmscale.cli import main  # noqa: E402
from dmscale.data import MnistDetectConfig, make_mnist_detect  # noqa: E402


@pytest.mark.slow
def test_detect_with_default_flags_trains_to_a_nontrivial_map(tmp_path, capsys):
    # about 100 s on one CPU thread: 3 search + 3 retraining epochs of 16 steps at 64 px
    data = make_mnist_detect(tmp_path / "d", MnistDetectConfig(train=256, val=64, imgsz=64, seed=123))["yaml"]
    run = tmp_path / "run"
    assert main(["search", "--task", "detect", "--data", data, "--image-size", "64", "--batch-size", "16",
                 "--epochs", "3", "--threads", "1", "--out", str(run)]) == 0
    out = capsys.readouterr().out
    assert "auto options  optimizer adamw, lr 0.001, weight decay 0.01, warm-up 0.02, " \
           "augment fliplr=0,mosaic=0, resource weight 3" in out and "(auto for detect)" in out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["auto"]["optimizer"] == {"value": "adamw", "why": "auto for detect"}
    final = summary["evals"]["final"]
    # measured 2.2 mAP50-95 / 4.7 mAP50 (%); SGD at lr 0.05 with Ultralytics' augmentation: 0.0 / 0.0
    assert final["map50"] > 0.01 and final["map50_95"] > 0.003, final
    assert summary["counts"]["found"]["macs"] <= 0.5 * summary["counts"]["supernet"]["macs"] * (1 + 1e-9)
