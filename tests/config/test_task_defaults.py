"""Options left at auto are chosen per task (dmscale.config.defaults): detect trains with AdamW
and the augmentation that works on small images, a pretrained hf: model with AdamW at 1e-4
and a strong resource weight, the structure lr follows the search's length; a value the user
gives always wins, and the summary, the report and --print-config say what was chosen."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dmscale.cli import main
from dmscale.config.defaults import (
    MIN_STRUCTURE_LR,
    PRETRAINED_LM_RESOURCE_WEIGHT,
    chosen_lines,
    resolve_structure_lr,
    structure_lr_for,
)
from dmscale.config.run_config import ConfigError, RunConfig, load_run_config, parse_mapping
from dmscale.run.pipeline import Pipeline
from dmscale.run.report import format_summary


def test_each_task_chooses_its_defaults() -> None:
    det = RunConfig(task="detect").resolved()
    assert (det.optimizer, det.lr, det.weight_decay, det.warmup) == ("adamw", 1e-3, 0.01, 0.02)
    assert det.augment == {"fliplr": 0.0, "mosaic": 0.0} and det.resource_weight == 3.0
    assert det.chosen["optimizer"] == det.chosen["augment"] == "auto for detect"
    mnist = RunConfig(task="mnist").resolved()  # the defaults of before, now named
    assert (mnist.optimizer, mnist.lr, mnist.weight_decay, mnist.warmup) == ("sgd", 0.05, 5e-4, 0.02)
    assert mnist.augment is None and "augment" not in mnist.chosen and mnist.resource_weight == 1.0
    for pipeline in ("p", "p-"):
        lm = RunConfig(task="text", model="hf:some/dir", pipeline=pipeline).resolved()
        assert (lm.optimizer, lm.lr, lm.weight_decay) == ("adamw", 1e-4, 0.0)
        assert lm.resource_weight == PRETRAINED_LM_RESOURCE_WEIGHT
        assert lm.chosen["resource_weight"] == "auto for a pretrained hf: model"
    # finetuning the found model of an hf: run: the LM's optimizer, no search
    assert RunConfig(command="retrain", task="text", model="hf:x").resolved().optimizer == "adamw"
    assert RunConfig(task="shakespeare", model="llama").resolved().optimizer == "sgd"  # random init


def test_a_value_the_user_gives_wins() -> None:
    cfg = RunConfig(task="detect", optimizer="sgd", warmup=0.1, augment={"mosaic": 0.5},
                    resource_weight=3.0, structure_lr=0.2).resolved()
    assert (cfg.optimizer, cfg.warmup, cfg.augment, cfg.resource_weight, cfg.structure_lr) == \
        ("sgd", 0.1, {"mosaic": 0.5}, 3.0, 0.2)
    assert cfg.lr == 0.01 and cfg.chosen["lr"] == "auto for detect"  # detect's lr for sgd (Ultralytics' lr0)
    assert not {"optimizer", "warmup", "augment", "resource_weight", "structure_lr"} & set(cfg.chosen)
    lm = RunConfig(task="text", model="hf:x", pipeline="p-", optimizer="sgd", lr=0.5).resolved()
    assert (lm.optimizer, lm.lr, lm.weight_decay) == ("sgd", 0.5, 0.0)
    # "auto" spelled out is the same as leaving the option out, from a flag or a config file
    given = parse_mapping({"optimizer": "auto", "lr": "auto", "resource-weight": "auto", "augment": "auto"})
    assert given == {"optimizer": None, "lr": None, "resource_weight": None, "augment": None}
    assert RunConfig(task="detect", **given).resolved().optimizer == "adamw"
    with pytest.raises(ConfigError, match=r"expected a number > 0, got '-1' \(or auto"):
        RunConfig(lr="-1")
    with pytest.raises(ConfigError, match=r"expected one of sgd, adamw; got .adam. \(or auto"):
        RunConfig(optimizer="adam")


def test_structure_lr_follows_the_search_length() -> None:
    assert structure_lr_for(20) == 0.025 and structure_lr_for(50) == MIN_STRUCTURE_LR
    assert structure_lr_for(5000) == MIN_STRUCTURE_LR and structure_lr_for(0) == 0.5
    cfg = RunConfig(task="digits").resolved()
    assert cfg.structure_lr is None  # the pipeline sets it once it knows the steps
    resolve_structure_lr(cfg, 20)
    assert cfg.structure_lr == 0.025 and cfg.chosen["structure_lr"] == "auto: max(0.01, 0.5 / 20 search steps)"


def test_summary_report_and_saved_config_name_the_choices(tmp_path: Path) -> None:
    cfg = RunConfig(task="digits", model="smallcnn", model_args={"width": 4, "blocks": 1}, train_limit=64,
                    test_limit=32, batch_size=32, epochs=1, retrain_epochs=0, quiet=True, threads=1,
                    out=str(tmp_path / "run"))
    summary = Pipeline(cfg).run()
    auto = summary["auto"]
    assert auto["optimizer"] == {"value": "sgd", "why": "auto for digits"}
    assert auto["structure_lr"]["value"] == 0.25  # 2 search steps
    text = format_summary(summary)
    assert "  auto options  optimizer sgd, lr 0.05, weight decay 0.0005, warm-up 0.02, resource weight 1 " \
           "(auto for digits)\n" in text
    assert "structure lr 0.25 (auto: max(0.01, 0.5 / 2 search steps))" in text
    assert "- auto options: optimizer sgd" in (tmp_path / "run" / "report.md").read_text()
    saved = load_run_config(tmp_path / "run")
    assert (saved.optimizer, saved.structure_lr, saved.chosen["structure_lr"]) == \
        ("sgd", 0.25, "auto: max(0.01, 0.5 / 2 search steps)")


def test_resume_keeps_the_runs_choices_and_refuses_a_changed_flag(tmp_path: Path) -> None:
    from dmscale.run.pipeline import Stopped

    cfg = RunConfig(task="digits", model="smallcnn", model_args={"width": 4, "blocks": 1}, train_limit=96,
                    test_limit=32, batch_size=32, epochs=1, retrain_epochs=0, quiet=True, threads=1,
                    stop_after=1, out=str(tmp_path / "run"))
    with pytest.raises(Stopped):
        Pipeline(cfg).run()
    again = RunConfig(**{**cfg.__dict__, "stop_after": None})  # still auto: the run's values
    assert Pipeline(again, resume=True).ctx.cfg.structure_lr == 0.5 / 3
    with pytest.raises(ConfigError, match="--optimizer"):
        Pipeline(RunConfig(**{**again.__dict__, "optimizer": "adamw"}), resume=True)


def test_a_run_saved_before_auto_defaults_keeps_its_meaning(tmp_path: Path) -> None:
    run = tmp_path / "old"
    run.mkdir()
    old = RunConfig(command="search", task="detect", data="d.yaml").to_dict()
    for key in ("chosen", "optimizer", "warmup", "resource_weight", "structure_lr"):
        old.pop(key)  # saved without them; augment: None meant Ultralytics' own values
    (run / "config.yaml").write_text(yaml.safe_dump(old))
    cfg = load_run_config(run)
    assert (cfg.optimizer, cfg.warmup, cfg.resource_weight, cfg.structure_lr, cfg.augment) == \
        ("sgd", 0.02, 1.0, 0.01, {})
    assert cfg.resolved().augment == {} and cfg.chosen == {}


def test_chosen_lines_group_by_reason() -> None:
    lines = chosen_lines({"optimizer": {"value": "adamw", "why": "auto for detect"},
                          "augment": {"value": {"fliplr": 0.0, "mosaic": 0.0}, "why": "auto for detect"},
                          "structure_lr": {"value": 0.025, "why": "auto: max(0.01, 0.5 / 20 search steps)"}})
    assert lines == ["optimizer adamw, augment fliplr=0,mosaic=0 (auto for detect)",
                     "structure lr 0.025 (auto: max(0.01, 0.5 / 20 search steps))"]


def test_print_config_says_what_auto_chose(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["search", "--task", "detect", "--data", "d.yaml", "--print-config"]) == 0
    text = capsys.readouterr().out
    assert "optimizer: adamw  # auto for detect\n" in text and "lr: 0.001  # auto for detect\n" in text
    assert "augment: {fliplr: 0.0, mosaic: 0.0}  # auto for detect\n" in text
    assert "structure-lr: auto  # max(0.01, 0.5 / search steps), set when the run starts\n" in text
    data = yaml.safe_load(text)
    assert data["optimizer"] == "adamw" and data["structure-lr"] == "auto"
    assert main(["search", "--task", "detect", "--data", "d.yaml", "--optimizer", "sgd", "--print-config"]) == 0
    assert "optimizer: sgd\n" in capsys.readouterr().out  # given: no comment
