"""Image folders read lazily (src/dmscale/data/images.py): the file list, per-example seeded
decoding, unreadable files, the loader."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from dmscale.core.errors import ConfigError
from dmscale.data.image_transforms import torchvision_transforms
from dmscale.data.images import ImageDataset, ImageFiles, Unreadable, collate_images, default_workers, image_loader
from dmscale.data.order import StepBatchSampler
from image_folders import make_image_folder

__all__: list[str] = []


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("imgs") / "data", n_train=12, n_val=4, classes=3, size=20)


def test_files_are_listed_like_torchvision_image_folder(folder: Path) -> None:
    from dmscale.core._compat import ensure_torchvision

    ensure_torchvision()
    from torchvision.datasets import ImageFolder

    files, tv = ImageFiles.from_folder(folder / "train"), ImageFolder(str(folder / "train"))
    assert files.classes == tv.classes and len(files) == len(tv)
    assert [(files.path(i), files.label(i)) for i in range(len(files))] == tv.samples
    sub = files.subset([5, 0])
    assert [sub.path(0), sub.path(1)] == [files.path(5), files.path(0)] and sub.label(0) == files.label(5)


def test_the_file_list_holds_no_object_per_image(folder: Path) -> None:
    """One bytes string and two arrays, whatever the number of images (forked workers would
    copy the pages of a list of per-image objects as they touch their reference counts)."""
    files = ImageFiles.from_folder(folder / "train")
    assert {type(v).__name__ for v in vars(files).values()} <= {"PosixPath", "WindowsPath", "list", "bytes", "ndarray"}
    assert len(files.classes) == 3


def test_a_folder_without_class_folders_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="Couldn't find any class folder.*one folder per class"):
        ImageFiles.from_folder(tmp_path)


def test_a_seeded_example_is_fixed_by_its_seed_and_leaves_the_global_generators_alone(folder: Path) -> None:
    ds = ImageDataset(ImageFiles.from_folder(folder / "train"), torchvision_transforms(12).train)
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    states = random.getstate(), np.random.get_state()[1].copy(), torch.random.get_rng_state()
    a, b, c = ds[(3, 10)], ds[(3, 10)], ds[(3, 11)]
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0]) and a[1] == ds.files.label(3)
    assert random.getstate() == states[0] and np.array_equal(np.random.get_state()[1], states[1])
    assert torch.equal(torch.random.get_rng_state(), states[2])


def test_an_unreadable_file_comes_back_as_the_batch(tmp_path: Path) -> None:
    root = make_image_folder(tmp_path / "d", n_train=4, n_val=2)
    bad = root / "train" / "c1" / "1.jpg"
    bad.write_bytes(b"not a jpeg")
    ds = ImageDataset(ImageFiles.from_folder(root / "train"), torchvision_transforms(8).eval)
    item = ds[3]
    assert isinstance(item, Unreadable) and item.path == str(bad)
    assert "Error: " in item.error  # PIL's, or a HEIF plugin's once Ultralytics is imported
    assert collate_images([ds[0], item]) == item
    batches = list(image_loader(ds, batch_size=2, workers=1))
    assert isinstance(batches[0], tuple) and batches[1] == item


def test_the_loader_gives_the_same_batches_with_any_number_of_workers(folder: Path) -> None:
    ds = ImageDataset(ImageFiles.from_folder(folder / "train"), torchvision_transforms(12).train)
    torch.manual_seed(5)
    before = torch.random.get_rng_state()
    runs = [list(image_loader(ds, batch_sampler=StepBatchSampler(len(ds), 4, seed=2, stop=6), workers=w))
            for w in (0, 1, 2)]
    assert torch.equal(torch.random.get_rng_state(), before)  # the loaders drew nothing from it
    for batches in runs[1:]:
        assert all(torch.equal(x, x0) and torch.equal(y, y0) for (x, y), (x0, y0) in zip(batches, runs[0]))


def test_default_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(64)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert default_workers() == 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert default_workers() == 8
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0}, raising=False)
    assert default_workers() == 1
