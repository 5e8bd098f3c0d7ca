"""The offline detection dataset: YOLO format, deterministic by seed, boxes on the ink."""

import hashlib

import numpy as np
import pytest
import yaml
from PIL import Image

from dmscale.cli import main
from dmscale.data import MnistDetectConfig, make_mnist_detect


def _digest(root):
    h = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.is_file() and p.name != "data.yaml"):
        h.update(f.relative_to(root).as_posix().encode() + f.read_bytes())
    return h.hexdigest()


def test_same_seed_same_files_other_seed_other_files(tmp_path):
    cfg = MnistDetectConfig(train=6, val=3, imgsz=48, seed=3)
    make_mnist_detect(tmp_path / "a", cfg)
    make_mnist_detect(tmp_path / "b", cfg)
    make_mnist_detect(tmp_path / "c", MnistDetectConfig(train=6, val=3, imgsz=48, seed=4))
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b") != _digest(tmp_path / "c")


def test_labels_are_yolo_boxes_around_the_ink(tmp_path):
    info = make_mnist_detect(tmp_path, MnistDetectConfig(train=10, val=4, imgsz=64, max_digits=4))
    data = yaml.safe_load(open(info["yaml"]))
    assert data["names"] == {i: str(i) for i in range(10)} and data["path"] == str(tmp_path.resolve())
    n_obj = 0
    for split, n in (("train", 10), ("val", 4)):
        images = sorted((tmp_path / "images" / split).glob("*.png"))
        assert len(images) == n
        for img in images:
            pixels = np.asarray(Image.open(img))
            assert pixels.shape == (64, 64) and pixels.dtype == np.uint8
            rows = [line.split() for line in (tmp_path / "labels" / split / (img.stem + ".txt")).read_text().splitlines()]
            assert 1 <= len(rows) <= 4
            ink = np.zeros_like(pixels, dtype=bool)
            for c, *xywh in rows:
                x, y, w, h = (float(v) * 64 for v in xywh)
                assert 0 <= int(c) <= 9 and 0 < w <= 64 and 0 < h <= 64
                x0, y0, x1, y1 = round(x - w / 2), round(y - h / 2), round(x + w / 2), round(y + h / 2)
                assert 0 <= x0 < x1 <= 64 and 0 <= y0 < y1 <= 64
                box = pixels[y0:y1, x0:x1]
                # the box is tight: ink on its first and last rows and columns
                assert box[0].max() > 32 and box[-1].max() > 32 and box[:, 0].max() > 32 and box[:, -1].max() > 32
                ink[y0:y1, x0:x1] = True
                n_obj += 1
            assert not (pixels[~ink] > 32).any(), "ink outside every box"
    assert n_obj == sum(info["objects"].values())


def test_bad_config_and_non_empty_out_are_refused(tmp_path):
    with pytest.raises(ValueError, match="imgsz"):
        MnistDetectConfig(imgsz=16)
    with pytest.raises(ValueError, match="train"):
        MnistDetectConfig(train=0)
    assert main(["data", "mnist-detect", "--out", str(tmp_path), "--train", "2", "--val", "1", "--quiet"]) == 0
    assert main(["data", "mnist-detect", "--out", str(tmp_path), "--train", "2", "--val", "1"]) == 2
