"""The instruments of bench/np_uniform.py (issue 10, table 3): rank statistics, effective kept
fractions, the paired gap, and a traced pipeline that records without changing the run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.lib import np_uniform_lib as nl
from bench.lib.np_uniform_table import paired_gap
from dmscale.config.run_config import RunConfig
from dmscale.run.pipeline import Pipeline

ROOT = Path(__file__).resolve().parents[2]


def test_spearman_matches_pearson_of_ranks_with_ties() -> None:
    a = torch.tensor([0.0, 0.0, 1.0, 3.0, 2.0])
    b = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0])
    ra = torch.tensor([0.5, 0.5, 2.0, 4.0, 3.0], dtype=torch.float64)  # ties share their mean rank
    rb = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0], dtype=torch.float64)
    expected = float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])
    assert nl.spearman(a, b) == pytest.approx(expected)
    assert nl.spearman(b, b) == pytest.approx(1.0)
    assert nl.spearman(b, -b) == pytest.approx(-1.0)
    assert nl.spearman(torch.zeros(4), b[:4]) != nl.spearman(torch.zeros(4), b[:4])  # constant: nan


def test_topk_agreement() -> None:
    a, b = torch.tensor([4.0, 3.0, 2.0, 1.0]), torch.tensor([1.0, 3.0, 2.0, 4.0])
    assert nl.topk_agreement(a, b, 2) == 0.5  # b's top 2 = {3, 1}, a's = {0, 1}
    assert nl.topk_agreement(a, b, 4) == 1.0 and nl.topk_agreement(a, b, 0) == 1.0


def test_effective_kept_drops_widths_inside_removed_blocks() -> None:
    structure = {"width": [{"size": 8, "kept": 6, "producers": ["conv1", "layer1.1.conv2"]},
                           {"size": 8, "kept": 8, "producers": ["layer1.1.conv1"]},
                           {"size": 4, "kept": 1, "producers": ["layer1.10.conv1"]}],
                 "depth": [{"blocks": ["layer1.1", "layer1.10"], "kept": ["layer1.10"]}],
                 "removed_blocks": [{"name": "layer1.1"}]}
    # a shared width lives on through its other producer; "layer1.10" is not inside "layer1.1"
    assert nl.effective_kept(structure) == [0.75, 0.0, 0.25, 0.5]


def test_structure_shift() -> None:
    assert nl.structure_shift({"kept": [1.0, 0.5, 0.0]}, {"kept": [1.0, 0.25, 0.5]}) == \
        {"mean_abs": 0.25, "max_abs": 0.5, "changed": 2}


def test_paired_gap_pairs_by_seed() -> None:
    rows = [{"seed": 2, "acc": 0.5}, {"seed": 0, "acc": 0.9}, {"seed": 5, "acc": 1.0}]
    base = [{"seed": 0, "acc": 0.8}, {"seed": 2, "acc": 0.75}]
    assert paired_gap(rows, base) == pytest.approx([10.0, -25.0])  # seed 5 has no partner


def _cfg(out: Path) -> RunConfig:
    return RunConfig(command="search", task="digits", pipeline="np", model="resnet",
                     model_args={"depth": 14, "width": 4}, train_limit=256, test_limit=64,
                     batch_size=32, epochs=2, retrain_epochs=0, target=0.4, seed=3, threads=1,
                     quiet=True, out=str(out))


def test_traced_pipeline_records_without_changing_the_run(tmp_path: Path) -> None:
    traced = nl.TracedPipeline(_cfg(tmp_path / "traced").resolved())
    summary = traced.run()
    plain = Pipeline(_cfg(tmp_path / "plain").resolved()).run()
    # the same search: same structure, exported cost and accuracy
    assert json.loads((tmp_path / "traced" / "structure.json").read_text())["width"] == \
        json.loads((tmp_path / "plain" / "structure.json").read_text())["width"]
    assert summary["resources"] == plain["resources"] and summary["evals"] == plain["evals"]
    tr = traced.trace
    assert len(tr["during"]) == nl.SNAPSHOTS - 1
    progress = [s["progress"] for s in tr["during"]]
    assert progress == sorted(progress) and 0.1 <= progress[0] < 0.2 and progress[-1] < 1.0
    ends = summary["resources_search_end"]
    assert tr["search_end"]["hard_over_target"] == pytest.approx(ends["hard"] / ends["target"])
    final = summary["resources"]
    assert tr["final"]["hard_over_target"] == pytest.approx(final["hard"] / final["target"])
    n = tr["final"]["n_width"]
    assert len(tr["final"]["kept"]) == n + 3  # blocks per stage (depth 14: 2, of which 1 removable in stages 2, 3)
    assert tr["solver_ran"] == (tr["after_finish"]["hard_over_target"] < 0.98
                                or tr["after_finish"]["hard_over_target"] > 1.0)
    curve = nl.stability(tr["during"] + [tr["search_end"]], tr["search_end"])
    assert curve[-1]["spearman"] == pytest.approx(1.0) and curve[-1]["shift_mean_abs"] == 0.0


def test_plot_and_paired_intervals_from_the_committed_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.lib import np_uniform_table as nt

    cache = json.loads((ROOT / "bench" / "results" / "np_uniform.json").read_text())
    monkeypatch.setattr(nt, "RESULTS", tmp_path)
    md = nt.write_table(cache, "python bench/np_uniform.py --table-only").read_text()
    assert (tmp_path / "np_uniform.png").stat().st_size > 10_000
    # the paired column gives a t-interval and a p-value for every searched arm with >= 2 seeds
    dms_rows = [line for line in md.splitlines() if line.startswith("| 0.5 | dms | ")]
    assert dms_rows and "], p = " in dms_rows[0]


def test_use_starts_from_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """``use`` composed its changes with the previous call's (``use_task`` then ``use_width``):
    np_fastnas, random_control and importance share the module in ``python -m bench check``."""
    from bench.lib import np_uniform_runs as nr

    for name in ("CACHE", "WORK", "MODEL"):
        monkeypatch.setattr(nr, name, getattr(nr, name))
    nr.use("mnist", 4, 1000, Path("r"), Path("w"))
    assert (nr.CACHE.as_posix(), nr.WORK.as_posix()) == ("r/np_uniform_mnist_w4.json", "w/mnist/w4")
    assert nr.MODEL == {**nr.DEFAULT_MODEL, "task": "mnist", "train_limit": 1000, "model_args": {"width": 4}}
    nr.use(width=4)
    assert nr.CACHE == nr.RESULTS / "np_uniform_w4.json" and nr.MODEL["task"] == "digits"
    nr.use()
    assert nr.CACHE == nr.RESULTS / "np_uniform.json" and nr.MODEL == nr.DEFAULT_MODEL


def test_table_of_another_width_names_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``np_uniform.py --width 4`` keeps its own cache and table, and the table says which
    ResNet-20 it measured (a target of 1.0 is the baseline itself, its accuracy ceiling)."""
    from bench.lib import np_uniform_runs as nr
    from bench.lib import np_uniform_table as nt

    monkeypatch.setattr(nr, "CACHE", nr.CACHE)
    monkeypatch.setattr(nr, "WORK", nr.WORK)
    monkeypatch.setattr(nr, "MODEL", nr.MODEL)
    nr.use(width=4)
    assert nr.CACHE.name == "np_uniform_w4.json" and nr.MODEL["model_args"] == {"width": 4}
    assert nr.WORK.name == "w4"
    cache = json.loads((ROOT / "bench" / "results" / "np_uniform.json").read_text())
    monkeypatch.setattr(nt, "RESULTS", tmp_path)
    md = nt.write_table(cache, "python bench/np_uniform.py --width 4", name="np_uniform_w4", width=4).read_text()
    assert "ResNet-20 (width 4)" in md and "(width 8)" not in md
    assert (tmp_path / "np_uniform_w4.png").exists()


def test_table_only_keeps_the_last_invocation_that_ran(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--table-only`` rewrote the table's "command (last invocation)" with itself."""
    from bench import np_uniform
    from bench.lib import np_uniform_runs as nr
    from bench.lib import np_uniform_table as nt

    cache = json.loads((ROOT / "bench" / "results" / "np_uniform.json").read_text())
    cache["last_command"] = "python bench/np_uniform.py --arms dms --seeds 3 4"
    (tmp_path / "np_uniform.json").write_text(json.dumps(cache))
    monkeypatch.setattr(nr, "RESULTS", tmp_path)
    monkeypatch.setattr(nr, "CACHE", tmp_path / "np_uniform.json")
    monkeypatch.setattr(nr, "WORK", nr.WORK)
    monkeypatch.setattr(nt, "RESULTS", nt.RESULTS)
    np_uniform.main(["--table-only"])
    md = (tmp_path / "np_uniform.md").read_text()
    assert "- command (last invocation): `python bench/np_uniform.py --arms dms --seeds 3 4`" in md
    assert json.loads((tmp_path / "np_uniform.json").read_text())["last_command"] == cache["last_command"]


def test_a_second_call_in_one_process_starts_from_the_defaults(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """``main`` kept the previous call's task and cache: ``--width 4`` after ``--task mnist`` in
    one process (``python -m bench check``) read np_uniform_mnist.json and wrote
    np_uniform_mnist_w4.md instead of rewriting np_uniform_w4.md."""
    import shutil

    from bench import np_uniform
    from bench.lib import np_uniform_runs as nr
    from bench.lib import np_uniform_table as nt

    for name in ("np_uniform_mnist.json", "np_uniform_w4.json", "np_uniform_mnist.md"):
        shutil.copy(ROOT / "bench" / "results" / name, tmp_path / name)
    committed = (ROOT / "bench" / "results" / "np_uniform_w4.md").read_text()
    (tmp_path / "np_uniform_w4.md").write_text("stale\n" + committed.split("\n", 1)[1])  # its findings kept
    for name in ("RESULTS", "CACHE", "WORK", "MODEL"):
        monkeypatch.setattr(nr, name, getattr(nr, name))
    nr.RESULTS = tmp_path
    monkeypatch.setattr(nt, "RESULTS", nt.RESULTS)
    np_uniform.main(["--task", "mnist", "--train-limit", "10000", "--search-epochs", "5", "--retrain-epochs", "10",
                     "--table-only"])
    np_uniform.main(["--width", "4", "--table-only"])
    assert not (tmp_path / "np_uniform_mnist_w4.md").exists()
    assert (tmp_path / "np_uniform_w4.md").read_text() == committed


def test_fastnas_arm_gets_its_own_section_and_no_search_columns(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``fastnas`` row (bench/np_fastnas.py: no traced search) sits in the main table with "-"
    in the search columns and gets the FastNAS section: paired intervals against uniform and
    DMS_np over its seeds, and per-stage widths where a DMS block removed counts 0 channels."""
    import doctest

    from bench.lib import np_fastnas_table as ft
    from bench.lib import np_uniform_table as nt

    assert doctest.testmod(ft).failed == 0
    w4 = json.loads((ROOT / "bench" / "results" / "np_uniform_w4.json").read_text())["runs"]
    keep = {k: r for k, r in w4.items() if r["arm"] in ("uniform", "dms@hold") and r["target"] == 0.25
            and r["seed"] in (0, 1, 2)}
    groups = ["conv1"] + [f"layer1.{b}.conv1" for b in range(3)] + \
        [n for s in (2, 3) for n in (f"layer{s}.0.conv1", f"layer{s}.0.conv2", f"layer{s}.1.conv1", f"layer{s}.2.conv1")]
    for seed, acc in ((0, 0.97), (1, 0.95), (2, 0.96)):
        keep[f"fastnas/t0.25/s{seed}"] = {
            "arm": "fastnas", "target": 0.25, "seed": seed, "search_epochs": 10.0, "retrain_epochs": 20.0, "acc": acc,
            "structure": "3/2/1/2/5/7/2/1/2/16/1/1 | blocks 3/2/2", "width_groups": groups, "exported": 0.93,
            "macs": 37160, "params": 2660, "modelopt": "0.47.0", "constraint_percent": 25.4, "bisect_runs": 14,
            "search_seconds": 80.0, "pretrain_acc": 0.96, "commit": "abc1234"}
    monkeypatch.setattr(nt, "RESULTS", tmp_path)
    md = nt.write_table({"runs": keep}, "python bench/np_uniform.py --width 4", name="np_uniform_w4", width=4).read_text()
    main = [line for line in md.splitlines() if line.startswith("| 0.25 | fastnas | 3 | ")]
    assert main and main[0].rstrip(" |").endswith("| - | - | - | -"), main
    row = [line for line in md.splitlines() if line.startswith("| 0.25 | 3 | ")]
    assert len(row) == 1 and row[0].count("], p = ") == 2 and "0 of 3" in row[0], row
    dms = sorted((r for r in keep.values() if r["arm"] == "dms@hold"), key=lambda r: r["seed"])
    diffs = [100 * (d["acc"] - a) for d, a in zip(dms, (0.97, 0.95, 0.96))]
    assert f"{sum(diffs) / 3:+.2f} [" in row[0]
    stages = [line for line in md.splitlines() if line.startswith("| 0.25 | fastnas | 3 | ")]
    assert len(stages) == 2 and "16.0 / 2.0, 1.0, 1.0 / 2.0" in stages[1]  # the main table's, the stages'
    removed = [r for r in dms if min(r["kept_final"][:r["n_width"]]) == 0]
    assert all(0.0 in [v for st in ft.stage_row(r, groups).values() for v in st[1]] for r in removed)
