"""yolo.pt: an Ultralytics checkpoint of a pruned YOLO that loads, predicts, validates and
exports ONNX in a process where dmscale cannot be imported, and finetunes at its pruned size."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("dmscale.integrations.ultralytics", reason="the YOLO integration needs ultralytics")

import dmscale as dms  # noqa: E402
from dmscale.data import MnistDetectConfig, make_mnist_detect  # noqa: E402
from dmscale.core.errors import DMScaleError  # noqa: E402
from dmscale.integrations.ultralytics import (  # noqa: E402
    PrunedDetectionTrainer,
    build_yolo,
    ensure_nms,
    nms_reference,
    save_yolo_checkpoint,
)

TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("digits-det")
    return make_mnist_detect(root, MnistDetectConfig(train=8, val=4, imgsz=64, seed=1))["yaml"]


@pytest.fixture(scope="module")
def pruned(tmp_path_factory):
    """A YOLOv8n for 10 classes pruned to roughly a third of its MACs, and its yolo.pt."""
    torch.manual_seed(0)
    model = build_yolo("yolov8n.yaml", nc=10)
    x = torch.rand(1, 3, 64, 64)
    # no training: a hand-set structure keeping channels and blocks by position (importance="index")
    searcher = dms.prepare(model, x, dms.SearchConfig(resource="macs", target=0.5, importance="index"))
    with torch.no_grad():
        for i, t in enumerate([*searcher.gates.width, *searcher.gates.depth]):
            t.a.fill_(0.3 + 0.4 * ((i * 7) % 5) / 5)  # different ratios per dimension, some blocks off
    small = searcher.export().eval()
    with searcher.hardened():
        model.eval()
        assert torch.allclose(model(x)[0], small(x)[0], atol=1e-4)
    path = save_yolo_checkpoint(small, tmp_path_factory.mktemp("run") / "yolo.pt")
    return small, path, dms.count(small, x)


def test_nms_reference_matches_a_brute_force_definition():
    g = torch.Generator().manual_seed(0)
    xy = torch.rand(60, 2, generator=g) * 50
    boxes = torch.cat([xy, xy + 5 + torch.rand(60, 2, generator=g) * 20], 1)
    scores = torch.rand(60, generator=g)
    keep = nms_reference(boxes, scores, 0.4).tolist()
    expect = []
    for i in scores.argsort(descending=True).tolist():
        a = boxes[i]
        ok = True
        for j in expect:
            b = boxes[j]
            w = (torch.minimum(a[2:], b[2:]) - torch.maximum(a[:2], b[:2])).clamp(min=0).prod()
            iou = w / ((a[2:] - a[:2]).prod() + (b[2:] - b[:2]).prod() - w)
            ok &= bool(iou <= 0.4)
        if ok:
            expect.append(i)
    assert keep == expect
    ensure_nms()
    import torchvision

    assert torchvision.ops.nms(boxes, scores, 0.4).tolist() == expect


def test_yolo_pt_loads_predicts_validates_exports_without_dmscale(pruned, data, tmp_path):
    small, path, counts = pruned
    full = sum(p.numel() for p in build_yolo("yolov8n.yaml", nc=10).parameters())
    image = Path(data).parent / "images" / "val" / "000000.png"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(ULTRALYTICS_SAFE_LOAD="1", YOLO_OFFLINE="1", YOLO_VERBOSE="False")
    proc = subprocess.run([sys.executable, str(TESTS / "yolo_fresh.py"), str(path), data, str(image), str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    line = [s for s in proc.stdout.splitlines() if s.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(line[-1][len("RESULT "):])
    assert r["dmscale_loaded"] is False and r["classes"] == ["torch", "ultralytics"]
    assert r["params"] == counts["params"] < 0.8 * full
    assert r["map50_95"] >= 0.0 and r["predict_boxes"] >= 0
    assert r["onnx_shape"] == [1, 4 + 10, 84] and r["onnx_max_diff"] < 1e-3
    assert r["onnx_params"] < 0.8 * full


def test_finetuning_keeps_the_pruned_structure(pruned, data, tmp_path):
    from ultralytics import YOLO

    small, path, counts = pruned
    yolo = YOLO(str(path))
    yolo.train(data=data, epochs=1, imgsz=64, batch=4, workers=0, plots=False, val=False, amp=False,
               project=str(tmp_path), name="ft", trainer=PrunedDetectionTrainer, verbose=False)
    tuned = sum(p.numel() for p in yolo.trainer.model.parameters())
    assert tuned == counts["params"]
    last = YOLO(str(tmp_path / "ft" / "weights" / "last.pt"))
    assert sum(p.numel() for p in last.model.parameters()) == counts["params"]
    # the weights did change: it trained
    before = torch.cat([p.flatten() for p in small.parameters()])
    after = torch.cat([p.float().flatten() for p in last.model.parameters()])
    assert not torch.allclose(before, after)


def test_trainer_refuses_a_yaml_model(data, tmp_path):
    from ultralytics import YOLO

    with pytest.raises(DMScaleError, match="finetunes a loaded model"):
        YOLO("yolov8n.yaml").train(data=data, epochs=1, imgsz=64, batch=4, workers=0, project=str(tmp_path),
                                   trainer=PrunedDetectionTrainer)


def test_a_checkpoint_is_a_supernet_too(pruned):
    small, path, counts = pruned
    again = build_yolo(str(path), nc=10)  # --model yolo:FILE.pt
    assert sum(p.numel() for p in again.parameters()) == counts["params"]
    x = torch.rand(1, 3, 64, 64)
    assert torch.allclose(again.eval()(x)[0], small(x)[0], atol=1e-5)
    with pytest.raises(DMScaleError, match="--expand needs a model yaml"):
        build_yolo(str(path), nc=10, expand={"width": 1.5, "depth": 1.0})
    with pytest.raises(DMScaleError, match="detects 10 classes, the dataset has 3"):
        build_yolo(str(path), nc=3)
