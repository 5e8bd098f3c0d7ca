"""WebDataset tar shards read by random access (src/dmscale/data/shards.py): the same examples
as the image folder they were written from, batches with any number of workers, the ways to
name shards, a compact index, and the errors that name the shard and the member."""

from __future__ import annotations

import gzip
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from dmscale.core.errors import ConfigError, DataError
from dmscale.data.image_transforms import torchvision_transforms
from dmscale.data.images import ImageDataset, ImageFiles, Unreadable, image_loader
from dmscale.data.order import StepBatchSampler
from dmscale.data.shards import ShardFiles, expand_braces, index_shard, is_shard_data, shard_paths
from image_folders import make_image_folder, tar_add, write_shards

__all__: list[str] = []


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = make_image_folder(tmp_path_factory.mktemp("imgs") / "data", n_train=14, n_val=4, classes=3, size=20)
    write_shards(root / "train", root / "shards", per_shard=4)  # 4 shards, the last one of 2
    return root


def _members(path: Path, members: list[tuple[str, bytes]]) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            tar_add(tar, name, data)
    return path


def test_shards_hold_the_examples_of_the_image_folder(folder: Path) -> None:
    shards = ShardFiles.from_shards(str(folder / "shards" / "train-{000000..000003}.tar"))
    files = ImageFiles.from_folder(folder / "train")
    assert len(shards) == len(files) == 14 and shards.classes == ["0", "1", "2"]
    assert [shards.label(i) for i in range(14)] == [files.label(i) for i in range(14)]
    assert shards.path(5).endswith("train-000001.tar:c1_0.jpg")
    a, b = ImageDataset(shards, torchvision_transforms(12).train), ImageDataset(files, torchvision_transforms(12).train)
    for i in range(14):
        (xa, ya), (xb, yb) = a[(i, 100 + i)], b[(i, 100 + i)]
        assert torch.equal(xa, xb) and ya == yb
    sub = shards.subset([9, 2])
    assert [sub.path(0), sub.label(1)] == [shards.path(9), shards.label(2)] and sub.classes == shards.classes


def test_batches_are_the_image_folders_with_any_number_of_workers(folder: Path) -> None:
    """The order is a function of (seed, step) only: the folder's batches, whoever decodes."""
    tf = torchvision_transforms(12).train
    shards = ImageDataset(ShardFiles.from_shards(folder / "shards"), tf)
    files = ImageDataset(ImageFiles.from_folder(folder / "train"), tf)
    want = list(image_loader(files, batch_sampler=StepBatchSampler(14, 4, seed=3, start=2, stop=7)))
    for workers in (0, 2):
        got = list(image_loader(shards, batch_sampler=StepBatchSampler(14, 4, seed=3, start=2, stop=7),
                                workers=workers))
        assert all(torch.equal(x, x0) and torch.equal(y, y0) for (x, y), (x0, y0) in zip(got, want, strict=True))


def test_the_index_holds_no_object_per_image(folder: Path) -> None:
    shards = ShardFiles.from_shards(folder / "shards")
    kinds = {type(v).__name__ for k, v in vars(shards).items() if k not in ("paths", "classes")}
    assert kinds <= {"str", "bytes", "ndarray"} and len(shards.paths) == 4


def test_ways_to_name_shards(folder: Path, tmp_path: Path) -> None:
    d = folder / "shards"
    assert expand_braces("a{1..3}") == ["a1", "a2", "a3"] and expand_braces("{x}") == ["{x}"]
    # zero-padded only when a bound of two or more digits starts with 0 (bash, braceexpand)
    assert expand_braces("s-{0..10}.tar")[:2] == ["s-0.tar", "s-1.tar"] and len(expand_braces("s-{0..10}")) == 11
    assert expand_braces("s-{00..10}")[:2] == ["s-00", "s-01"] and expand_braces("{-1..1}") == ["-1", "0", "1"]
    assert shard_paths(d) == shard_paths(f"{d}/train-*.tar") == shard_paths(f"{d}/train-{{000000..000003}}.tar")
    assert shard_paths(d / "train-000002.tar") == [d / "train-000002.tar"]
    assert is_shard_data(d) and is_shard_data(folder.parent / "x-{0..1}.tar") and not is_shard_data(folder / "train")
    with pytest.raises(ConfigError, match=r"2 of its 5 shards do not exist: .*train-000004.tar, .*train-000005.tar"):
        shard_paths(f"{d}/train-{{000001..000005}}.tar")
    with pytest.raises(ConfigError, match="no file matches"):
        shard_paths(f"{d}/val-*.tar")
    with pytest.raises(ConfigError, match="no .tar file in the directory"):
        shard_paths(tmp_path)


def test_written_by_webdataset(folder: Path, tmp_path: Path) -> None:
    """Shards of WebDataset's own writer read alike (keys with dots in their folder, extra members)."""
    wds = pytest.importorskip("webdataset")
    files = ImageFiles.from_folder(folder / "train")
    with wds.TarWriter(str(tmp_path / "w-0.tar")) as sink:
        for i in range(len(files)):
            sink.write({"__key__": f"v1.0/{i:04d}", "jpg": Path(files.path(i)).read_bytes(), "cls": files.label(i),
                        "json": {"i": i}})
    shards = ShardFiles.from_shards(tmp_path / "w-0.tar")
    assert [shards.label(i) for i in range(len(files))] == [files.label(i) for i in range(len(files))]
    assert shards.path(3).endswith("w-0.tar:v1.0/0003.jpg")
    assert np.array_equal(np.asarray(shards.image(3)), np.asarray(files.image(3)))


def test_an_image_without_a_label_names_the_shard_and_the_member(tmp_path: Path) -> None:
    shard = _members(tmp_path / "s.tar", [("a.jpg", b"x"), ("a.cls", b"0"), ("b.jpg", b"x"), ("b.json", b"{}")])
    with pytest.raises(DataError, match=r"shard .*s.tar: member b.jpg has no label; expected b.cls"):
        index_shard(shard)
    _members(shard, [("a.cls", b"1")])
    with pytest.raises(DataError, match=r"s.tar: member a.cls labels example a, which has no image"):
        index_shard(shard)
    _members(shard, [("a.png", b"x"), ("a.cls", b"cat")])
    with pytest.raises(DataError, match=r"s.tar: member a.cls holds 'cat', expected the class index"):
        index_shard(shard)
    _members(shard, [("a.png", b"x"), ("a.jpg", b"x"), ("a.cls", b"1")])
    with pytest.raises(DataError, match=r"example a has two images, a.png and a.jpg"):
        index_shard(shard)
    _members(shard, [("a.png", b"x"), ("a.cls", b"1"), ("a.txt", b""), ("a.CLS", b"2")])
    with pytest.raises(DataError, match=r"example a has two labels, a.cls and a.CLS"):
        index_shard(shard)
    _members(shard, [("a.png", b"x"), ("a.cls", b"1"), ("b.png", b"x"), ("b.cls", b"0"), ("a.json", b"{}")])
    with pytest.raises(DataError, match=r"members of example a are not next to each other \(a.json"):
        index_shard(shard)


def test_a_corrupt_shard_names_the_shard(folder: Path, tmp_path: Path) -> None:
    data = (folder / "shards" / "train-000000.tar").read_bytes()
    cut = tmp_path / "cut.tar"
    for size in (len(data) // 3, 4096 + 300):  # in a member's data; in a header
        cut.write_bytes(data[:size])
        with pytest.raises(DataError, match=r"shard .*cut.tar: .*truncated.*write the shard again"):
            index_shard(cut)
    cut.write_bytes(gzip.compress(data))
    with pytest.raises(DataError, match="cut.tar: gzip-compressed, expected a plain tar"):
        index_shard(cut)
    cut.write_bytes(b"not a tar")
    with pytest.raises(DataError, match="cut.tar: not a tar file"):
        index_shard(cut)


def test_an_unreadable_image_names_the_shard_and_the_member(tmp_path: Path) -> None:
    shard = _members(tmp_path / "s.tar", [("a.jpg", b"not a jpeg"), ("a.cls", b"0")])
    files = ShardFiles.from_shards(shard)
    item = ImageDataset(files, torchvision_transforms(8).eval)[0]
    assert isinstance(item, Unreadable) and item.path == f"{shard}:a.jpg" and "Error: " in item.error
    assert "BytesIO" not in item.error
    shard.write_bytes(shard.read_bytes()[:515])  # the shard changed after it was indexed
    assert "ends" in files.image(0).error
