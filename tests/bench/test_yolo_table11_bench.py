"""bench/yolo_table11.py: the table and plot build from cached per-run json files, with the
paired differences against YOLOv8n and the MACs ratio of every arm (no training here)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("dmscale.integrations.ultralytics", reason="the detection benchmark needs ultralytics")

ROOT = Path(__file__).resolve().parents[2]
from bench import yolo_table11 as yt  # noqa: E402


def _settings() -> dict:
    args = yt.argparse.Namespace(train=8, val=4, imgsz=64, max_digits=3, min_scale=0.25, max_scale=0.5, epochs=2.0,
                                 batch_size=4, optimizer="adamw", lr=1e-3, weight_decay=None, warmup=0.02,
                                 augment="fliplr=0", expand="width=1.5,depth=1.5", search_epochs=None,
                                 structure_lr=0.05, resource_weight=3.0, uniform_rule="nearest")
    return yt.settings_of(args)


def test_table_from_cache_pairs_seeds_and_keeps_the_reading(tmp_path: Path) -> None:
    s = _settings()
    assert s["dms"]["search_epochs"] == 2.0  # defaults to --epochs
    cache = tmp_path / "runs" / "tag0"
    cache.mkdir(parents=True)
    base = 40_000_000
    maps = {"dms_np": [0.15, 0.13], "yolov8n": [0.14, 0.10], "uniform": [0.12, 0.12]}
    macs = {"dms_np": 38_000_000, "yolov8n": base, "uniform": 40_400_000}
    for arm, values in maps.items():
        for seed, m in enumerate(values):
            row = {"arm": arm, "seed": seed, "map50_95": m, "map50": 2 * m, "macs": macs[arm], "params": 3e6,
                   "seconds": 60.0, "command": "PYTHONPATH=src python bench/yolo_table11.py --seeds 0 1",
                   "commit": "abc1234"}
            if arm == "dms_np":
                row["search_map50_95"] = m / 2
            (cache / f"{arm}-s{seed}.json").write_text(json.dumps(row))
    meta = {"base_macs": base, "supernet_macs": 2 * base,
            "uniform": {"width": 0.8751, "depth": 1.5, "macs": 40_400_000, "below": [0.8748, 35e6],
                        "above": [0.8751, 40.4e6]}}
    out = tmp_path / "table"
    out.with_suffix(".md").write_text("# old\n\n## Reading\n\nhand-written.\n")
    yt.write_table(cache, [0, 1, 2], out, s, meta, "PYTHONPATH=src python bench/yolo_table11.py --table-only")
    md = out.with_suffix(".md").read_text()
    assert md.endswith("\n## Reading\n\nhand-written.\n") and "# old" not in md
    dms_row = next(line for line in md.splitlines() if line.startswith("| DMS_np"))
    # paired by seed: +1 and +3 points -> 2.00 ± 1.41; MACs ratio 0.95
    assert "| 0.950 |" in dms_row and "2.00 ± 1.41 [1.00, 3.00]" in dms_row
    uni_row = next(line for line in md.splitlines() if line.startswith("| uniform"))
    assert "| 1.010 |" in uni_row and "x0.8751" in uni_row
    assert "seed 1: 0.950, 6.50 -> 13.00" in md
    cached = json.loads(out.with_suffix(".json").read_text())
    assert [r["seed"] for r in cached["rows"]["yolov8n"]] == [0, 1]

    pytest.importorskip("matplotlib")
    from bench.lib import plots as results_plots

    png = results_plots.plot_yolo(cached, tmp_path / "t.png")
    assert png.stat().st_size > 1000


@pytest.mark.slow  # 35 s: the width search builds a YOLO per bisection step
def test_p3_arm_is_yolov8n_with_one_stride8_level_widened_to_its_macs() -> None:
    """The hand-made baseline of the `p3` arm: bench/yolov8n_p3.yaml builds as a YOLO with a
    single detection level at stride 8 (no stride-16/32 outputs), and its width multiple
    brackets YOLOv8n's MACs at 64 px."""
    import torch
    from dmscale.integrations.ultralytics import build_yolo

    model = build_yolo(str(yt.P3_YAML), nc=10).eval()
    assert model.model[-1].stride.tolist() == [8.0]
    info = {"nc": 10, "kind": "detection"}
    base = yt._macs(info, 64)
    arm = yt.uniform_arm(info, 64, 1.0, base, "nearest", yaml=str(yt.P3_YAML))
    assert arm["below"][1] <= base < arm["above"][1]
    assert arm["macs"] in (arm["below"][1], arm["above"][1]) and abs(arm["macs"] / base - 1) < 0.1
    assert arm["width"] > 1.0  # one level is cheaper than three: it is widened to spend the same MACs
    with torch.no_grad():
        out = build_yolo(str(yt.P3_YAML), nc=10, expand={"width": arm["width"], "depth": 1.0}).eval()(
            torch.zeros(1, 3, 64, 64))
    preds = out[0] if isinstance(out, (tuple, list)) else out
    assert preds.shape[-1] == (64 // 8) ** 2  # one prediction per stride-8 cell, none from P4/P5
