"""``--task imagefolder`` on WebDataset tar shards: the batches, evaluation and classes of the
image folder the shards were written from, the layouts (``DIR/train`` + ``DIR/val``, a pattern
with ``--val-data``, one set split 90/10), each rank's disjoint share of a global batch, and the
errors of a missing shard or a bad ``--val-data``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from dmscale.config.run_config import ConfigError, RunConfig
from dmscale.tasks.imagefolder import ImageFolderTask
from dmscale.tasks.registry import build_task
from image_folders import make_image_folder, tar_add, write_shards

__all__: list[str] = []


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = make_image_folder(tmp_path_factory.mktemp("imgs") / "data", n_train=24, n_val=10, size=24)
    write_shards(root / "train", root / "shards" / "train", per_shard=5)
    write_shards(root / "val", root / "shards" / "val", per_shard=5, prefix="val")
    return root


def _task(data: Path | str, **kw: object) -> ImageFolderTask:
    options = {"image_size": 16, "workers": 0, **kw}
    task = build_task(RunConfig(task="imagefolder", data=str(data), **options).resolved())  # type: ignore[arg-type]
    assert isinstance(task, ImageFolderTask)
    return task


def _same(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_shards_train_and_evaluate_as_the_image_folder(folder: Path) -> None:
    shards, plain = _task(folder / "shards", workers=2), _task(folder, workers=2)
    assert shards.describe() == plain.describe().replace("images,", "images in 5 tar shards,")
    assert shards.info["classes"] == ["0", "1"]
    assert all(_same(shards.train_batch(s, 6, 1), plain.train_batch(s, 6, 1)) for s in (0, 1, 5, 2))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 2))
    assert shards.evaluate(model, batch_size=4) == plain.evaluate(model, batch_size=4)
    shards.close()


def test_a_pattern_with_val_data_and_one_set_split_90_10(folder: Path) -> None:
    d = folder / "shards"
    explicit = _task(d / "train" / "train-{000000..000004}.tar", val_data=str(d / "val" / "val-*.tar"))
    assert (len(explicit.train_set), len(explicit.test_set)) == (24, 10)
    assert _same(explicit.train_batch(3, 6, 0), _task(d).train_batch(3, 6, 0))
    alone = d.parent / "alone"  # DIR/train/*.tar without DIR/val: 10 % of DIR/train, or --val-data
    (alone / "train").mkdir(parents=True)
    for shard in (d / "train").iterdir():
        (alone / "train" / shard.name).symlink_to(shard)
    assert (len(_task(alone).train_set), len(_task(alone, val_data=str(d / "val")).test_set)) == (22, 10)
    split = _task(d / "train")
    assert (len(split.train_set), len(split.test_set)) == (22, 2)  # as a folder of class folders
    held_out = _task(folder / "train").test_set.files  # the same images held out
    assert [split.test_set.files.path(i).split(":")[1] for i in range(2)] == \
        [f"{Path(held_out.path(i)).parent.name}_{Path(held_out.path(i)).name}" for i in range(2)]
    with pytest.raises(ConfigError, match=r"--val-data .*val has classes \['c0', 'c1'\], --data has \['0', '1'\]"):
        _task(d / "train", val_data=str(folder / "val"))  # class folders' names, shards' indices


def test_each_rank_loads_a_disjoint_half_of_the_global_batch(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    task = _task(folder / "shards")
    whole = task.train_batch(2, 8, 0)
    halves = []
    for r in (0, 1):
        monkeypatch.setattr("dmscale.tasks.imagefolder.rank", lambda r=r: r)
        monkeypatch.setattr("dmscale.tasks.imagefolder.world_size", lambda: 2)
        halves.append(task.train_batch(2, 8, 0))
    assert [len(h[1]) for h in halves] == [4, 4]
    assert torch.equal(torch.cat([h[0] for h in halves]), whole[0])
    assert torch.equal(torch.cat([h[1] for h in halves]), whole[1])


def test_missing_shards_and_bad_members_are_named(folder: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--data .*train-\{000000..000009\}.tar: 5 of its 10 shards do not exist"):
        _task(folder / "shards" / "train" / "train-{000000..000009}.tar")
    with pytest.raises(ConfigError, match="--val-data .*nowhere: not a directory of class folders nor tar shards"):
        _task(folder / "shards" / "train", val_data=str(tmp_path / "nowhere"))
    import tarfile

    with tarfile.open(tmp_path / "bad.tar", "w") as tar:
        tar_add(tar, "k.jpg", (folder / "train" / "c0" / "0.jpg").read_bytes())
    with pytest.raises(ConfigError, match=r"task imagefolder: shard .*bad.tar: member k.jpg has no label; expected k.cls"):
        _task(tmp_path / "bad.tar")
    with tarfile.open(tmp_path / "bad.tar", "w") as tar:
        tar_add(tar, "k.jpg", b"not a jpeg")
        tar_add(tar, "k.cls", b"0")
    with pytest.raises(ConfigError, match=r"task imagefolder: .*cannot read image .*bad.tar:k.jpg \(.*\); write the shard again"):
        _task(tmp_path / "bad.tar", val_data=str(tmp_path / "bad.tar"))
