"""``--task imagefolder`` (src/dmscale/tasks/imagefolder.py): batches as a pure function of
(seed, step) with any number of workers, streamed evaluation, the folder layouts and their
errors, the transforms per model kind, and memory that does not grow with the data set."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from dmscale.config.run_config import ConfigError, RunConfig
from dmscale.core.errors import DataError
from dmscale.tasks.imagefolder import ImageFolderTask, build_imagefolder_task
from dmscale.tasks.registry import build_model, build_task
from image_folders import make_image_folder

__all__: list[str] = []

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("imgs") / "data", n_train=24, n_val=10, size=24)


def _task(data: Path, **kw: object) -> ImageFolderTask:
    options = {"image_size": 16, "workers": 0, **kw}
    cfg = RunConfig(task="imagefolder", data=str(data), **options)  # type: ignore[arg-type]
    task = build_task(cfg.resolved())
    assert isinstance(task, ImageFolderTask)
    return task


def _same(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_a_batch_is_a_function_of_seed_and_step_with_any_workers(folder: Path) -> None:
    """In order, out of order (a resumed run), with 0 or 2 workers: the same tensors."""
    plain, two = _task(folder), _task(folder, workers=2)
    in_order = [plain.train_batch(s, 6, seed=1) for s in range(8)]  # 2 epochs of 4 steps
    assert not _same(in_order[0], in_order[4])  # another epoch, another order and augmentation
    assert all(_same(two.train_batch(s, 6, 1), in_order[s]) for s in (5, 6, 7, 2, 3))
    assert _same(plain.train_batch(4, 6, 1), in_order[4]) and _same(plain.train_batch(0, 6, 1), in_order[0])
    assert not _same(plain.train_batch(0, 6, 2), in_order[0])  # another seed
    two.close()


def test_drawing_batches_leaves_the_training_generators_alone(folder: Path) -> None:
    task, model = _task(folder), nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 2))
    random.seed(0), torch.manual_seed(0)
    states = random.getstate(), torch.random.get_rng_state()
    task.train_batch(0, 6, 0)
    task.evaluate(model, batch_size=4)
    assert random.getstate() == states[0] and torch.equal(torch.random.get_rng_state(), states[1])


def test_evaluation_streams_the_test_split(folder: Path) -> None:
    task = _task(folder, workers=2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 2))
    got = task.evaluate(model, batch_size=4)
    xs = torch.stack([task.test_set[i][0] for i in range(10)])
    ys = torch.tensor([task.test_set[i][1] for i in range(10)])
    with torch.no_grad():
        logits = model(xs)
    assert got["examples"] == 10
    assert got["acc"] == pytest.approx(float((logits.argmax(-1) == ys).float().mean()))
    assert got["loss"] == pytest.approx(float(nn.functional.cross_entropy(logits, ys)), rel=1e-5)
    assert task.evaluate(model, batch_size=4, limit=3)["examples"] == 3
    assert torch.equal(task.example_inputs(), xs[:1])


def test_layouts_limits_and_their_errors(folder: Path, tmp_path: Path) -> None:
    task = _task(folder, train_limit=6, test_limit=4)
    assert (len(task.train_set), len(task.test_set)) == (6, 4)
    assert sorted(task.train_set.files.label(i) for i in range(6)) != [0] * 6  # a shuffled prefix
    single = _task(folder / "train")  # one folder: 90/10
    assert (len(single.train_set), len(single.test_set)) == (22, 2)
    assert single.info["classes"] == ["c0", "c1"] and single.info["image_size"] == [16, 16]
    with pytest.raises(ConfigError, match="--train-limit 30 exceeds the 22 train examples"):
        _task(folder / "train", train_limit=30)
    other = make_image_folder(tmp_path / "other", n_train=4, n_val=3, classes=3)
    (other / "val" / "c2").rename(other / "val" / "c9")
    with pytest.raises(ConfigError, match=r"val/ has classes \['c0', 'c1', 'c9'\], train/ has"):
        _task(other)
    with pytest.raises(ConfigError, match="needs --data DIR"):
        build_imagefolder_task(RunConfig(task="imagefolder").resolved())


def test_an_unreadable_image_is_named(tmp_path: Path) -> None:
    root = make_image_folder(tmp_path / "d", n_train=8, n_val=2)
    (root / "train" / "c0" / "0.jpg").write_bytes(b"")  # the first image: found when the task is built
    with pytest.raises(ConfigError, match=r"task imagefolder: --data .*train: cannot read image .*c0/0.jpg "
                                          r"\(\w+Error.*remove or replace the file"):
        _task(root)
    make_image_folder(root, n_train=8, n_val=2)
    (root / "train" / "c1" / "2.jpg").write_bytes(b"\xff\xd8 truncated")  # later: found in its batch
    task = _task(root, workers=2)
    with pytest.raises(DataError, match=r"task imagefolder: --data .*train: cannot read image .*c1/2.jpg"):
        for step in range(4):
            task.train_batch(step, 4, 0)


def test_transforms_per_model_kind(folder: Path) -> None:
    tv = _task(folder, model="tv:resnet18", image_size=None)
    assert tv.info["image_size"] == [32, 32] and tv.info["mean"] == pytest.approx([0.485, 0.456, 0.406])
    vit = _task(folder, model="timm:vit_small_patch16_224", image_size=None, image_augment="none")
    assert vit.info["image_size"] == [224, 224] and vit.info["mean"] == [0.5, 0.5, 0.5]
    assert "timm vit_small_patch16_224 transforms, no augmentation" in vit.describe()
    r18 = _task(folder, model="timm:resnet18", auto_augment="rand-m9-mstd0.5")
    assert "RandAugment" in repr(r18.train_set.transform)
    x, _ = r18.train_batch(0, 4, 0)
    model, _ = build_model(RunConfig(task="imagefolder", model="timm:resnet18").resolved(), r18.info)
    assert model(x).shape == (4, 2)


@pytest.mark.parametrize("kw, match", [
    ({"model": "resnet"}, "needs --task imagefolder and --model timm:NAME"),
    ({"model": "timm:resnet18", "image_augment": "none"}, "--image-augment none turns off"),
    ({"task": "digits", "model": "timm:resnet18"}, "needs --task imagefolder"),
])
def test_auto_augment_is_refused_where_it_cannot_apply(kw: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        RunConfig(**{"task": "imagefolder", "data": "x", "auto_augment": "rand-m9", **kw}).resolved()


# ----------------------------------------------------------------------------- memory
_PEAK = textwrap.dedent("""
    import json, resource, sys, torch
    from dmscale.config.run_config import RunConfig
    from dmscale.tasks.registry import build_model, build_task

    torch.set_num_threads(1)
    cfg = RunConfig(task="imagefolder", data=sys.argv[1], image_size=96, workers=2, model="smallcnn",
                    model_args={"width": 4, "blocks": 1}).resolved()
    task = build_task(cfg)
    model, _ = build_model(cfg, task.info)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    def rss(field):
        status = open("/proc/self/status").read()
        return int(next(line for line in status.splitlines() if line.startswith(field + ":")).split()[1])
    base = rss("VmRSS")  # torch, the libraries and the model: what the workers start from (forked)
    for step in range(4):
        x, y = task.train_batch(step, 32, 0)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    metrics = task.evaluate(model, batch_size=64)
    task.close()
    import gc; gc.collect()
    # this process: the high-water mark of its own memory map (ru_maxrss would also hold the
    # launching process's, inherited through exec); the workers (forked, ended): ru_maxrss
    peak = rss("VmHWM")
    workers = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB on Linux
    print(json.dumps({"self": peak - base, "workers": workers - base, "train": len(task.train_set),
                      "test": metrics["examples"]}))
""")


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/status; ru_maxrss in KiB")
@pytest.mark.slow  # four training processes over two image folders (~10 s on 2 cores)
def test_peak_memory_does_not_grow_with_the_data_set(tmp_path: Path) -> None:
    """Peak RSS of 4 training steps and a full evaluation on N and on 4N images (96 x 96 crops),
    training process and loader workers, over the RSS with torch, the libraries and the model
    loaded (a CUDA build of torch alone holds ~800 MB, a CPU one ~300, so a share of the whole
    RSS would not be portable): the 3N more images may add at most half of what holding them in
    memory as float tensors would (~78 MB; measured: about 30 MB for the training process,
    nothing for the workers)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}", "OMP_NUM_THREADS": "1"}
    folders = {n: make_image_folder(tmp_path / f"n{n}", n_train=n, n_val=n // 2) for n in (160, 640)}

    def measure(n: int) -> dict:
        proc = subprocess.run([sys.executable, "-c", _PEAK, str(folders[n])], env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    small, large = measure(160), measure(640)
    assert (small["train"], large["train"], large["test"]) == (160, 640, 320)
    in_memory_extra_kib = (480 + 240) * 3 * 96 * 96 * 4 / 1024  # what eager float tensors would add
    limit = 0.5 * in_memory_extra_kib
    if any(large[who] - small[who] > limit for who in ("self", "workers")):
        # the forked workers' peak varies between identical runs: measure both once more and
        # compare the lower peaks
        again_small, again_large = measure(160), measure(640)
        small = {k: min(v, again_small[k]) for k, v in small.items()}
        large = {k: min(v, again_large[k]) for k, v in large.items()}
    for who in ("self", "workers"):
        assert large[who] - small[who] <= limit, (who, small, large, limit)
