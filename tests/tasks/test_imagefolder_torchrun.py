"""``torchrun --nproc_per_node 2 ... search --task imagefolder``: each rank loads only its half
of every global batch (disjoint examples, together exactly the one-process batch of that step),
the global batch size stays ``--batch-size``, and both ranks end with the same structure and
weights (BatchNorm statistics: see the test)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from dmscale.data.order import StepBatchSampler
from image_folders import make_image_folder
from torchrun_util import run_group

__all__: list[str] = []

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
BATCH, TRAIN = 8, 32


def test_two_ranks_load_disjoint_halves_and_end_alike(tmp_path: Path) -> None:
    data = make_image_folder(tmp_path / "data", n_train=TRAIN, n_val=8, size=20)
    args = ["search", "--task", "imagefolder", "--data", str(data), "--image-size", "16", "--model", "smallcnn",
            "--model-args", "width=4,blocks=1", "--batch-size", str(BATCH), "--threads", "1", "--workers", "1",
            "--structure-lr", "0.05", "--epochs", "1", "--retrain-epochs", "0.5", "--seed", "0", "--quiet",
            "--out", str(tmp_path / "run")]
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT / 'tests'}", OMP_NUM_THREADS="1")
    proc = run_group([*TORCHRUN, str(Path(__file__).with_name("imagefolder_ddp_script.py")), str(tmp_path),
                      "--", *args], cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world"] for r in ranks] == [2, 2] and [r["rc"] for r in ranks] == [0, 0]
    steps = sorted(set(ranks[0]["seen"]) & set(ranks[1]["seen"]))
    assert len(steps) >= TRAIN // BATCH  # the search's steps at least (then finish, BN, retrain)
    for key in steps:
        seed, step = map(int, key.split("/"))
        a, b = ranks[0]["seen"][key], ranks[1]["seen"][key]
        assert len(a) == len(b) == BATCH // 2 and not set(a) & set(b), (key, a, b)
        assert a + b == [i for i, _ in StepBatchSampler(TRAIN, BATCH, seed).items(step)], key
    saved = [r["saved"] for r in ranks]
    assert list(saved[0]) == list(saved[1]) == ["0:model.safetensors", "1:model.safetensors"]
    # the found model after its BatchNorm statistics were re-estimated (each rank on its shares,
    # averaged over the ranks): the same structure, weights and statistics on both ranks
    assert saved[0]["0:model.safetensors"] == saved[1]["0:model.safetensors"]
    # retrained: the same shapes and weights; BatchNorm's running statistics are each rank's own
    # after the last step (DDP broadcasts rank 0's before every forward, not after the last one)
    final = [{k: v for k, v in s["1:model.safetensors"].items() if "running" not in k} for s in saved]
    assert final[0] == final[1]
    assert {k: v[0] for k, v in saved[0]["1:model.safetensors"].items()} == \
        {k: v[0] for k, v in saved[1]["1:model.safetensors"].items()}
    assert (tmp_path / "run" / "structure.json").is_file()
