"""Generated JPEG image folders for the image-folder tests and benchmarks (nothing downloaded).

Each class has its own colour cast on random noise, so a small CNN learns the classes in a
few steps.

    >>> import tempfile
    >>> from pathlib import Path
    >>> root = make_image_folder(Path(tempfile.mkdtemp()) / "imgs", n_train=4, n_val=2)
    >>> sorted(p.relative_to(root).as_posix() for p in root.rglob("*.jpg"))[:3]
    ['train/c0/0.jpg', 'train/c0/1.jpg', 'train/c1/0.jpg']
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["make_image_folder"]


def make_image_folder(root: Path, n_train: int, n_val: int, classes: int = 2, size: int = 32,
                      seed: int = 0, quality: int = 90) -> Path:
    """``root/train/cK/I.jpg`` (``n_train`` images) and ``root/val/cK/I.jpg`` (``n_val``), split
    evenly over ``classes`` classes, ``size x size`` RGB JPEGs; returns ``root``."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for split, n in (("train", n_train), ("val", n_val)):
        for c in range(classes):
            d = root / split / f"c{c}"
            d.mkdir(parents=True, exist_ok=True)
            for i in range(n // classes + (1 if c < n % classes else 0)):
                a = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
                a[..., c % 3] = a[..., c % 3] // 4 + 192  # the class's colour cast
                Image.fromarray(a).save(d / f"{i}.jpg", quality=quality)
    return root
