"""A small object-detection dataset in Ultralytics YOLO format, made offline from MNIST.

Each image is a black ``imgsz x imgsz`` canvas with one to ``max_digits`` MNIST digits pasted
at random positions and scales; every digit is one object whose class is its label (ten
classes, ``"0"`` ... ``"9"``) and whose box is the tight box around its ink. Training images
take their digits from MNIST's training split, validation images from its test split, so the
two splits share no digit. The output is what Ultralytics reads::

    DIR/data.yaml                 path, train, val, names
    DIR/images/{train,val}/*.png  grey images
    DIR/labels/{train,val}/*.txt  one line per digit: class x_center y_center width height (0-1)

Everything is a pure function of the arguments (``seed`` included): the same call writes the
same files, byte for byte.

Example:
    >>> import tempfile, yaml
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     info = make_mnist_detect(tmp, MnistDetectConfig(train=4, val=2, imgsz=64))
    ...     data = yaml.safe_load(open(info["yaml"]))
    ...     n_labels = len(open(tmp + "/labels/train/000000.txt").read().splitlines())
    >>> data["train"], data["val"], len(data["names"]), info["objects"]["train"] >= 4
    ('images/train', 'images/val', 10, True)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from dmscale.core.errors import ConfigError
from dmscale.data.idx import load_mnist_dir
from dmscale.data.mnist import mnist_dir

__all__ = ["MnistDetectConfig", "make_mnist_detect"]


@dataclass(frozen=True)
class MnistDetectConfig:
    """What :func:`make_mnist_detect` writes.

    Attributes:
        train: number of training images.
        val: number of validation images.
        imgsz: side of the square canvas in pixels (at least 32).
        max_digits: at most this many digits per image (at least one).
        min_scale, max_scale: a digit's side, as a fraction of ``imgsz`` (its 28x28 cell is
            resized to it).
        seed: the random seed of placement, scale and the digits drawn.
        mnist: a directory of MNIST IDX files (None: the bundled copy).
    """

    train: int = 512
    val: int = 128
    imgsz: int = 64
    max_digits: int = 3
    min_scale: float = 0.25
    max_scale: float = 0.5
    seed: int = 0
    mnist: str | None = None

    def __post_init__(self) -> None:
        for name in ("train", "val", "max_digits"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"MnistDetectConfig.{name} must be a positive int, got {value!r}")
        if isinstance(self.imgsz, bool) or not isinstance(self.imgsz, int) or self.imgsz < 32:
            raise ConfigError(f"MnistDetectConfig.imgsz must be an int >= 32, got {self.imgsz!r}")
        if not 0.0 < self.min_scale <= self.max_scale <= 1.0:
            raise ConfigError("MnistDetectConfig needs 0 < min_scale <= max_scale <= 1, got "
                              f"min_scale={self.min_scale}, max_scale={self.max_scale}")
        if round(self.min_scale * self.imgsz) < 8:
            raise ConfigError(f"digits of {self.min_scale} x {self.imgsz} px are under 8 px: raise "
                              "min_scale or imgsz")


def _resize(digit: np.ndarray, side: int) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.fromarray(digit).resize((side, side), Image.BILINEAR))


def _overlap(box: tuple[int, int, int, int], boxes: list[tuple[int, int, int, int]]) -> float:
    """The largest fraction of ``box``'s area that any of ``boxes`` covers."""
    x0, y0, x1, y1 = box
    area = max(1, (x1 - x0) * (y1 - y0))
    worst = 0.0
    for a0, b0, a1, b1 in boxes:
        w = max(0, min(x1, a1) - max(x0, a0))
        h = max(0, min(y1, b1) - max(y0, b0))
        worst = max(worst, w * h / area)
    return worst


def _compose(rng: np.random.Generator, images: np.ndarray, labels: np.ndarray,
             cfg: MnistDetectConfig) -> tuple[np.ndarray, list[tuple[int, float, float, float, float]]]:
    size = cfg.imgsz
    canvas = np.zeros((size, size), dtype=np.uint8)
    placed: list[tuple[int, int, int, int]] = []
    objects: list[tuple[int, float, float, float, float]] = []
    for _ in range(int(rng.integers(1, cfg.max_digits + 1))):
        k = int(rng.integers(len(labels)))
        side = int(round(rng.uniform(cfg.min_scale, cfg.max_scale) * size))
        digit = _resize(images[k], side)
        ys, xs = np.nonzero(digit > 32)
        if len(xs) == 0:
            continue
        for _attempt in range(10):  # a place where it covers less than a fifth of another
            x, y = int(rng.integers(0, size - side + 1)), int(rng.integers(0, size - side + 1))
            box = (x + int(xs.min()), y + int(ys.min()), x + int(xs.max()) + 1, y + int(ys.max()) + 1)
            if _overlap(box, placed) < 0.2 and all(_overlap(p, [box]) < 0.2 for p in placed):
                break
        else:
            continue
        region = canvas[y:y + side, x:x + side]
        np.maximum(region, digit, out=region)
        placed.append(box)
        x0, y0, x1, y1 = box
        objects.append((int(labels[k]), (x0 + x1) / 2 / size, (y0 + y1) / 2 / size,
                        (x1 - x0) / size, (y1 - y0) / size))
    return canvas, objects


def make_mnist_detect(out: str | Path, cfg: MnistDetectConfig | None = None) -> dict[str, Any]:
    """Write the dataset of ``cfg`` to ``out``; returns ``{"yaml", "images", "objects"}``.

    Raises:
        ValueError: ``out`` already holds a different dataset's files, or MNIST has too few
            examples (see :class:`MnistDetectConfig`).
    """
    from PIL import Image

    cfg = cfg or MnistDetectConfig()
    root = Path(out).resolve()
    if (root / "images").exists() and any((root / "images").rglob("*.png")):
        raise ConfigError(f"{root} already holds images: choose an empty --out directory")
    mnist = load_mnist_dir(Path(cfg.mnist) if cfg.mnist else mnist_dir())
    counts = {"images": {}, "objects": {}}
    for split, n, source, offset in (("train", cfg.train, "train", 0), ("val", cfg.val, "test", 1)):
        rng = np.random.default_rng([cfg.seed, offset])
        images, labels = mnist[f"{source}_images"], mnist[f"{source}_labels"]
        (root / "images" / split).mkdir(parents=True, exist_ok=True)
        (root / "labels" / split).mkdir(parents=True, exist_ok=True)
        total = 0
        for i in range(n):
            canvas, objects = _compose(rng, images, labels, cfg)
            Image.fromarray(canvas).save(root / "images" / split / f"{i:06d}.png")
            lines = [f"{c} {x:.6f} {y:.6f} {w:.6f} {h:.6f}" for c, x, y, w, h in objects]
            (root / "labels" / split / f"{i:06d}.txt").write_text("\n".join(lines) + "\n")
            total += len(objects)
        counts["images"][split], counts["objects"][split] = n, total
    data = {"path": str(root), "train": "images/train", "val": "images/val",
            "names": {i: str(i) for i in range(10)}}
    (root / "data.yaml").write_text(
        "# MNIST digits on a canvas, written by `dmscale data mnist-detect`\n"
        + yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return {"yaml": str(root / "data.yaml"), **counts}
