"""``--model package.module:factory`` (src/dmscale/tasks/user_models.py) and how build_model
dispatches to it (src/dmscale/tasks/registry.py)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from dmscale.config.run_config import ConfigError, RunConfig
from dmscale.tasks.registry import build_model, is_import_path
from dmscale.tasks.user_models import factory_kwargs, import_factory, task_facts

IMAGE = {"kind": "classification", "num_classes": 10, "in_channels": 1, "image_size": [8, 8]}
CHARS = {"kind": "language", "vocab": list("abcdefgh"), "seq_len": 16}

NETS = '''
import torch
from torch import nn


def build(num_classes=10, in_channels=3, width=8):
    """A tiny classifier; the task passes num_classes and in_channels."""
    return nn.Sequential(nn.Conv2d(in_channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, num_classes))


def bare(**kwargs):
    """Only **kwargs: it receives no task facts, only --model-args."""
    return nn.Linear(64, int(kwargs.get("out", 10)))


def needs(depth, num_classes):
    return nn.Linear(depth, num_classes)


def not_a_module(num_classes=10):
    return {"num_classes": num_classes}


def broken(num_classes=10):
    raise RuntimeError("widths must be even")


class Net(nn.Module):
    def __init__(self, num_classes: int, image_size: int = 0):
        super().__init__()
        self.image_size = image_size
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x):
        return self.fc(x.flatten(1))

    @classmethod
    def small(cls, num_classes):
        return cls(num_classes)


class CharNet(nn.Module):
    def __init__(self, vocab_size, seq_len, width=8):
        super().__init__()
        self.seq_len = seq_len
        self.emb = nn.Embedding(vocab_size, width)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, x):
        return self.head(self.emb(x))


SIZE = 3
'''


@pytest.fixture
def user_pkg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``my_pkg.nets`` written into tmp_path, which goes on sys.path (and out again)."""
    pkg = tmp_path / "my_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "nets.py").write_text(textwrap.dedent(NETS))
    (pkg / "bad_dep.py").write_text("import no_such_dependency_xyz\n")
    (pkg / "bad_syntax.py").write_text("def f(:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "my_pkg" or m.startswith("my_pkg.")]:
        monkeypatch.delitem(sys.modules, name)
    yield tmp_path
    for name in [m for m in sys.modules if m == "my_pkg" or m.startswith("my_pkg.")]:
        del sys.modules[name]


def _cfg(model: str, task: str = "digits", **kw) -> RunConfig:
    return RunConfig(task=task, model=model, **kw).resolved()


def test_import_paths_are_told_from_the_built_in_families() -> None:
    assert is_import_path("my_pkg.nets:build") and is_import_path("nets:Net.small")
    for name in ("resnet", "tv:resnet18", "timm:resnet18", "yolo:yolov8n.yaml", "hf:/models/x",
                 "my_pkg.nets", "my_pkg/nets.py:build", "pkg:", ":build"):
        assert not is_import_path(name), name


def test_the_factory_gets_the_task_facts_its_signature_names(user_pkg: Path) -> None:
    model, exclude = build_model(_cfg("my_pkg.nets:build", model_args={"width": 4}), IMAGE)
    assert exclude == [] and model[0].in_channels == 1 and model[0].out_channels == 4
    assert model[-1].out_features == 10
    assert build_model(_cfg("my_pkg.nets:Net"), IMAGE)[0].image_size == 8  # square: an int
    rect = {**IMAGE, "image_size": [8, 6]}
    assert build_model(_cfg("my_pkg.nets:Net"), rect)[0].image_size == (8, 6)
    assert build_model(_cfg("my_pkg.nets:Net.small"), IMAGE)[0].fc.out_features == 10  # dotted attribute
    # **kwargs alone receives no facts, only --model-args
    assert build_model(_cfg("my_pkg.nets:bare", model_args={"out": 3}), IMAGE)[0].out_features == 3
    assert factory_kwargs(lambda **kw: None, {"a": 1}, task_facts(IMAGE)) == {"a": 1}


def test_a_character_model_gets_the_vocabulary_and_the_sequence_length(user_pkg: Path) -> None:
    model, _ = build_model(_cfg("my_pkg.nets:CharNet", task="shakespeare"), CHARS)
    assert model.emb.num_embeddings == 8 and model.seq_len == 16
    logits = model(torch.zeros(2, 16, dtype=torch.long))
    assert logits.shape == (2, 16, 8)


@pytest.mark.parametrize("name, args, words", [
    ("no_pkg_xyz.nets:build", {}, ["cannot import module 'no_pkg_xyz.nets'", "ModuleNotFoundError",
                                   "sys.path", "PYTHONPATH", "no_pkg_xyz", "exported, evaluated or retrained"]),
    ("my_pkg.nope:build", {}, ["cannot import module 'my_pkg.nope'", "PYTHONPATH"]),
    ("my_pkg.bad_dep:build", {}, ["imports 'no_such_dependency_xyz'", "not installed"]),
    ("my_pkg.bad_syntax:f", {}, ["SyntaxError"]),
    ("my_pkg.nets:biuld", {}, ["has no attribute 'biuld'", "nets.py", "build"]),
    ("my_pkg.nets:Net.large", {}, ["has no attribute 'large'"]),
    ("my_pkg.nets:SIZE", {}, ["SIZE is not callable (it is of type int)"]),
    ("my_pkg.nets:build", {"depth": 3}, ["takes no argument 'depth'", "build(num_classes=10"]),
    ("my_pkg.nets:build", {"num_classes": 5}, ["num_classes=5", "the task has num_classes=10",
                                               "drop num_classes"]),
    ("my_pkg.nets:needs", {}, ["cannot be called", "missing a required argument: 'depth'",
                               "--model-args KEY=VALUE"]),
    ("my_pkg.nets:not_a_module", {}, ["returned a builtins.dict", "not a torch.nn.Module"]),
    ("my_pkg.nets:broken", {}, ["raised RuntimeError: widths must be even", "num_classes=10"]),
])
def test_errors_name_the_problem_and_the_fix(user_pkg: Path, name: str, args: dict, words: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        build_model(_cfg(name, model_args=args), IMAGE)
    text = str(err.value)
    assert text.startswith(f"--model {name}") or text.startswith("--model-args"), text
    assert "\n" not in text
    for word in words:
        assert word in text, (word, text)


def test_expand_and_tasks_without_a_place_for_own_models_are_refused(user_pkg: Path) -> None:
    with pytest.raises(ConfigError, match="--expand enlarges the built-in models"):
        build_model(_cfg("my_pkg.nets:build", expand={"width": 2.0, "depth": 1.0}), IMAGE)
    with pytest.raises(ConfigError, match="yolo:YAML"):
        build_model(_cfg("my_pkg.nets:build"), {"kind": "detection"})
    with pytest.raises(ConfigError, match="hf:PATH"):
        build_model(replace_task(_cfg("my_pkg.nets:build"), "text"), {**CHARS, "tokenizer": "x"})


def replace_task(cfg: RunConfig, task: str) -> RunConfig:
    cfg.task = task  # --task text refuses own models already in RunConfig; build_model checks too
    return cfg


def test_import_factory_returns_the_callable(user_pkg: Path) -> None:
    factory = import_factory("my_pkg.nets:build")
    assert isinstance(factory(num_classes=3), nn.Module)
