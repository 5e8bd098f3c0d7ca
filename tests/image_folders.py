"""Generated JPEG image folders for the image-folder tests and benchmarks (nothing downloaded),
and WebDataset tar shards of the same images.

Each class has its own colour cast on random noise, so a small CNN learns the classes in a
few steps.

    >>> import tempfile
    >>> from pathlib import Path
    >>> root = make_image_folder(Path(tempfile.mkdtemp()) / "imgs", n_train=4, n_val=2)
    >>> sorted(p.relative_to(root).as_posix() for p in root.rglob("*.jpg"))[:3]
    ['train/c0/0.jpg', 'train/c0/1.jpg', 'train/c1/0.jpg']
    >>> [p.name for p in write_shards(root / "train", root / "shards", per_shard=3)]
    ['train-000000.tar', 'train-000001.tar']
"""

from __future__ import annotations

from pathlib import Path

import io
import tarfile

import numpy as np

__all__ = ["make_image_folder", "tar_add", "write_shards"]


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


def tar_add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    """Add the member ``name`` holding ``data`` to ``tar``."""
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_shards(folder: Path, out: Path, per_shard: int, prefix: str = "train") -> list[Path]:
    """The images of the class folders of ``folder`` as WebDataset shards
    ``out/PREFIX-000000.tar, ...`` of ``per_shard`` examples (``CLASS_NAME.jpg`` with the same
    bytes, ``CLASS_NAME.cls`` its class index), in torchvision ``ImageFolder``'s order."""
    classes = sorted(d.name for d in folder.iterdir() if d.is_dir())
    images = [(f, c) for c, name in enumerate(classes) for f in sorted((folder / name).iterdir())]
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for s in range(0, len(images), per_shard):
        paths.append(out / f"{prefix}-{s // per_shard:06d}.tar")
        with tarfile.open(paths[-1], "w") as tar:
            for f, c in images[s:s + per_shard]:
                key = f"{f.parent.name}_{f.stem}"
                tar_add(tar, f"{key}{f.suffix}", f.read_bytes())
                tar_add(tar, f"{key}.cls", str(c).encode())
    return paths
