"""Bad input gets a clear dmscale error and changes nothing (issue 12).

Library cases (:data:`LIBRARY_CASES`): each call must raise a
:class:`dmscale.core.errors.DMScaleError` whose message contains the given fragments (what is
wrong and the fix), and the user's model must be exactly as it was
(:class:`model_state.ModelSnapshot`: state_dict, outputs, train/eval flags, hooks,
submodules). Command-line cases (:data:`CLI_CASES`): ``dmscale ARGS``
(run in-process through ``dmscale.cli.main``, which ``python -m dmscale`` calls) exits
non-zero with exactly one line on stderr, no traceback, and the fragments.

``python tests/test_bad_input.py`` prints the table "Bad input and what you get" of docs/errors.md
from the messages the cases actually get.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
from model_state import ModelSnapshot
from torch import nn

import dmscale as dms
from dmscale.core.errors import DMScaleError

__all__ = ["LIBRARY_CASES", "CLI_CASES", "library_message", "markdown_table"]

ROOT = Path(__file__).resolve().parents[1]


def small_net() -> nn.Sequential:
    """A BN CNN in train mode (so a forward in the wrong mode would move BN statistics)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


X = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))


def _structure_of(net: nn.Module, x: torch.Tensor) -> dict[str, Any]:
    # no training here: keep elements by position on purpose (the structure's shapes matter)
    searcher = dms.prepare(net, x, dms.SearchConfig(target=1.0, importance="index"))
    with torch.no_grad():
        for t in searcher.gates.width:
            t.a.fill_(0.5 * t.max_ratio)
    structure = searcher.structure()
    dms.detach(net)
    return structure


def _export_untrained(net: nn.Module, what: str = "export") -> None:
    """``searcher.export()`` (or ``structure()``) right after ``prepare``: no training step, so
    no importance; the model is detached afterwards, whatever happens."""
    searcher = dms.prepare(net, X, dms.SearchConfig(target=0.5))
    try:
        searcher.meet_target()  # adjusting the counts is fine; handing out a structure is not
        searcher.export() if what == "export" else searcher.structure()
    finally:
        dms.detach(net)


def _other_structure() -> dict[str, Any]:
    torch.manual_seed(0)
    other = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.Conv2d(6, 8, 3, padding=1),
                          nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
    return _structure_of(other, X)


def _save_dir(tmp: Path, structure: dict[str, Any] | str) -> Path:
    d = tmp / "saved"
    d.mkdir(exist_ok=True)
    (d / "structure.json").write_text(structure if isinstance(structure, str) else json.dumps(structure))
    torch.manual_seed(0)
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(1)}, str(d / "model.safetensors"))
    return d


class _FFTNet(nn.Module):
    """Linear -> FFT (no channel rule) -> Linear: the hidden width cannot be searched."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.fft.fft(self.a(x)).real)


class _Untraceable(nn.Module):
    """Runs on its own but refuses to run under a TorchFunctionMode (as some compiled or
    framework-wrapped forwards do)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch._C._is_torch_function_mode_enabled():
            raise RuntimeError("this forward cannot run under a TorchFunctionMode")
        return self.b(torch.relu(self.a(x)))


class _HiddenScale(nn.Module):
    """A layer with weights and no handler whose forward reads them outside torch's function
    dispatch (as TorchScript or a custom kernel would)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(c) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch._C.DisableTorchFunction():
            return x * self.weight.view(1, -1, 1, 1)


def _scripted_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(torch.jit.script(nn.Sequential(nn.Linear(4, 8), nn.ReLU())), nn.Linear(8, 2))


def _hidden_scale_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), _HiddenScale(8), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


X4 = torch.randn(2, 4, generator=torch.Generator().manual_seed(2))

# cases whose model is not small_net(): name -> (model factory, inputs for the snapshot)
MODELS: dict[str, tuple[Callable[[], nn.Module], Any]] = {
    "unsupported_function": (_FFTNet, X4),
    "untraceable_model": (_Untraceable, X4),
    "torchscript_layer": (_scripted_net, X4),
    "layer_without_handler": (_hidden_scale_net, X),
}


def _weights_dir(tmp: Path, damage: str) -> Path:
    """A directory saved for small_net() whose structure fits but whose weights file is damaged."""
    d = _save_dir(tmp, _structure_of(small_net(), X))
    if damage == "corrupt":
        (d / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    return d  # otherwise: _save_dir's weights, a file from another model


# name -> (description, call(model, tmp_path), fragments the message must contain)
LIBRARY_CASES: dict[str, tuple[str, Callable[[nn.Module, Path], Any], list[str]]] = {
    "inputs_do_not_fit": ("example inputs that do not fit the model",
                          lambda m, t: dms.prepare(m, torch.randn(2, 5, 8, 8)),
                          ["does not run on the example inputs", "(2, 5, 8, 8)", "pass inputs"]),
    "nothing_to_search": ("a model with nothing to search",
                          lambda m, t: dms.prepare(m, X, dms.SearchConfig(exclude=["0", "3", "1"])),
                          ["found nothing to search", "exclude fewer"]),
    "inputs_wrong_type": ("example inputs that are not a tensor, tuple or dict",
                          lambda m, t: dms.prepare(m, "an image"),
                          ["example_inputs must be a tensor", "got str", "pass them in one of these forms"]),
    "untraceable_model": ("a model that cannot be traced (runs alone, fails under the trace)",
                          lambda m, t: dms.prepare(m, X4),
                          ["_Untraceable runs on the example inputs but not under dmscale's trace",
                           "cannot run under a TorchFunctionMode", "pass the plain nn.Module"]),
    "torchscript_layer": ("a model with a TorchScript submodule",
                          lambda m, t: dms.prepare(m, X4),
                          ["layer '0' is a TorchScript module", "pass the nn.Module from before torch.jit.script"]),
    "layer_without_handler": ("a layer no handler supports, whose weights the trace cannot see",
                              lambda m, t: dms.prepare(m, X),
                              ["layer '1' (_HiddenScale)", "exclude=['1']", "register_handler"]),
    "unsupported_function": ("a model whose hidden layer goes through a function dmscale has no rule for",
                             lambda m, t: dms.prepare(m, X4),
                             ["found nothing to search", "fft_fft", "no channel rule", "register_handler"]),
    "target_above_supernet": ("a target above the supernet's cost",
                              lambda m, t: dms.prepare(m, X, dms.SearchConfig(target=1e12)),
                              ["outside what this search space can reach", "pass a target between"]),
    "target_below_smallest": ("a target below the smallest reachable cost",
                              lambda m, t: dms.prepare(m, X, dms.SearchConfig(target=2)),
                              ["outside what this search space can reach", "(smallest)"]),
    "target_negative": ("a negative target", lambda m, t: dms.SearchConfig(target=-0.5),
                        ["target must be a finite number > 0", "-0.5"]),
    "target_zero": ("a zero target", lambda m, t: dms.SearchConfig(target=0), ["got 0"]),
    "target_nan": ("a NaN target", lambda m, t: dms.SearchConfig(target=float("nan")), ["got nan"]),
    "target_inf": ("an infinite target", lambda m, t: dms.SearchConfig(target=float("inf")), ["got inf"]),
    "unknown_resource": ("an unknown resource name", lambda m, t: dms.SearchConfig(resource="flops"),
                         ["unknown resource 'flops'", "'macs'"]),
    "unknown_importance": ("an unknown importance name", lambda m, t: dms.SearchConfig(importance="grad"),
                           ["unknown importance 'grad'", "'taylor'"]),
    "export_untrained": ("`searcher.export()` before any training step (no importance yet)",
                         lambda m, t: _export_untrained(m),
                         ["export() before any importance exists", "would keep its first elements",
                          "Train at least one step", "task loss", "Eq. 4",
                          'SearchConfig(importance="index")']),
    "structure_untrained": ("`searcher.structure()` before any training step",
                            lambda m, t: _export_untrained(m, "structure"),
                            ["structure() before any importance exists", "Train at least one step"]),
    "apply_structure_mismatch": ("`apply_structure` with a structure made for another model",
                                 lambda m, t: dms.apply_structure(m, _other_structure()),
                                 ["structure was made for shape", "the model has",
                                  "apply a structure to the model it was made for"]),
    "apply_structure_not_a_structure": ("`apply_structure` with something that is not a structure",
                                        lambda m, t: dms.apply_structure(m, {"layers": {}}),
                                        ["expected a structure with format"]),
    "apply_structure_malformed": ("`apply_structure` with a hand-edited structure missing keys",
                                  lambda m, t: dms.apply_structure(m, {"format": "dmscale.structure/1",
                                                                       "layers": {"0": {}}, "removed_blocks": []}),
                                  ["malformed structure", "unedited"]),
    "load_mismatch": ("`dms.load` of a directory saved from another model",
                      lambda m, t: dms.load(m, _save_dir(t, _other_structure())), ["structure was made for shape"]),
    "load_corrupt_structure": ("`dms.load` with a corrupt structure.json",
                               lambda m, t: dms.load(m, _save_dir(t, '{"format": "dmscale.struc')),
                               ["is not valid JSON", "save the model again"]),
    "load_weights_mismatch": ("`dms.load` of a directory whose weights file is from another model",
                              lambda m, t: dms.load(m, _weights_dir(t, "other")),
                              ["do not fit the model shrunk to its structure.json", "missing from the file ('0.weight'",
                               "1 tensor in the file but not in the model ('w')", "both files from the same save"]),
    "load_corrupt_weights": ("`dms.load` with a corrupt model.safetensors",
                             lambda m, t: dms.load(m, _weights_dir(t, "corrupt")),
                             ["model.safetensors is not a readable safetensors file", "save the model again"]),
    "load_missing_dir": ("`dms.load` of a directory that does not exist",
                         lambda m, t: dms.load(m, t / "nowhere"), ["is missing", "dmscale.save"]),
}


def library_message(name: str, tmp_path: Path) -> tuple[DMScaleError, ModelSnapshot, nn.Module]:
    """Run one library case on a fresh model; returns the error, the snapshot and the model."""
    _, call, _ = LIBRARY_CASES[name]
    make, inputs = MODELS.get(name, (small_net, X))
    model = make()
    snap = ModelSnapshot.take(model, inputs)
    with pytest.raises(DMScaleError) as info:
        call(model, tmp_path)
    return info.value, snap, model


@pytest.mark.parametrize("name", list(LIBRARY_CASES))
def test_library_bad_input(name: str, tmp_path: Path) -> None:
    err, snap, model = library_message(name, tmp_path)
    message = str(err)
    for fragment in LIBRARY_CASES[name][2]:
        assert fragment in message, f"{name}: {fragment!r} not in {message!r}"
    assert "\n" not in message.strip(), f"{name}: a multi-line message {message!r}"
    snap.assert_same(model, name)


def test_config_error_is_a_dmscale_error() -> None:
    from dmscale.config.run_config import ConfigError

    assert issubclass(ConfigError, DMScaleError) and issubclass(ConfigError, ValueError)


# ----------------------------------------------------------------------------- data files
def _idx_dir(tmp: Path, damage: str) -> Path:
    from dmscale.data import write_idx

    d = tmp / "idx"
    d.mkdir()
    rng = np.random.default_rng(0)
    for name, n in (("train", 8), ("t10k", 4)):
        write_idx(d / f"{name}-images-idx3-ubyte.gz", rng.integers(0, 255, (n, 28, 28), dtype=np.uint8))
        write_idx(d / f"{name}-labels-idx1-ubyte.gz", rng.integers(0, 10, (n,), dtype=np.uint8))
    target = d / "train-images-idx3-ubyte.gz"
    if damage == "missing":
        target.unlink()
    elif damage == "truncated_gzip":
        target.write_bytes(target.read_bytes()[:-40])
    elif damage == "truncated_idx":
        raw = gzip.decompress(target.read_bytes())
        target.write_bytes(gzip.compress(raw[: len(raw) // 2]))
    elif damage == "wrong_format":
        target.write_bytes(gzip.compress(b"<html>not an IDX file</html>"))
    return d


DATA_CASES = {"missing": ["no MNIST file"], "truncated_gzip": ["corrupt or truncated gzip"],
              "truncated_idx": ["truncated IDX file", "download it again"], "wrong_format": ["not an IDX file"]}
DATA_WHAT = {"missing": "an MNIST (IDX) directory with a file missing",
             "truncated_gzip": "an IDX file whose gzip stream is cut short",
             "truncated_idx": "an IDX file with fewer items than its header says",
             "wrong_format": "a file that is not IDX (here HTML) under an IDX name"}


@pytest.mark.parametrize("damage", list(DATA_CASES))
def test_idx_data_files(damage: str, tmp_path: Path) -> None:
    from dmscale.data import load_mnist_dir

    with pytest.raises(DMScaleError) as info:
        load_mnist_dir(_idx_dir(tmp_path, damage))
    for fragment in DATA_CASES[damage]:
        assert fragment in str(info.value)


# ----------------------------------------------------------------------------- command line
TINY = ["--task", "digits", "--model", "smallcnn", "--model-args", "width=4,blocks=2", "--train-limit", "128",
        "--test-limit", "64", "--batch-size", "64", "--threads", "1", "--quiet", "--structure-lr", "0.05"]


def cli(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str]:
    """``dmscale ARGS`` in this process (what ``python -m dmscale`` runs); (exit status, stderr)."""
    from dmscale.cli import main

    capsys.readouterr()
    try:
        rc = main([str(a) for a in args])
    except SystemExit as stop:  # argparse rejects a flag's value
        rc = stop.code if isinstance(stop.code, int) else 1
    return rc, capsys.readouterr().err


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A search stopped after 2 steps, with a checkpoint."""
    out = tmp_path_factory.mktemp("bad") / "run"
    from dmscale.cli import main

    assert main(["search", *TINY, "--epochs", "1", "--out", str(out), "--stop-after", "2"]) == 0
    assert (out / "checkpoint.pt").is_file()
    return out


def _damaged_run(stopped: Path, tmp: Path, damage: str) -> Path:
    import shutil

    run = tmp / "run"
    shutil.copytree(stopped, run)
    ck = run / "checkpoint.pt"
    if damage == "corrupt":
        ck.write_bytes(b"\x00garbage" * 100)
    elif damage == "truncated":
        ck.write_bytes(ck.read_bytes()[: ck.stat().st_size // 2])
    elif damage == "untrained":  # as if stopped before its first search step: no importance yet
        state = torch.load(ck, weights_only=False)
        for key, value in state["searcher"]["gates"].items():
            if key.endswith("importance"):
                value.zero_()
        state["step"] = 0
        torch.save(state, ck)
    elif damage == "wrong_version":
        state = torch.load(ck, weights_only=False)
        state["version"] = 999
        torch.save(state, ck)
    return run


def _image_dir(tmp: Path, damage: str) -> Path | str:
    """An image folder with no class folders ("empty"), or whose one image is not one
    ("not_an_image"); tar shards of which two are missing ("shards_missing"), or whose image has
    no label ("shards_no_label")."""
    import tarfile

    from image_folders import tar_add

    root = tmp / "images"
    root.mkdir()
    if damage == "not_an_image":
        for split in ("train", "val"):
            (root / split / "cat").mkdir(parents=True)
            (root / split / "cat" / "a.png").write_text("not a png")
    if damage.startswith("shards"):
        with tarfile.open(root / "train-0.tar", "w") as tar:
            tar_add(tar, "a.png", b"not read")
            if damage == "shards_missing":
                tar_add(tar, "a.cls", b"0")
        return str(root / "train-{0..2}.tar") if damage == "shards_missing" else root
    return root


# name -> (description, args given the stopped run and tmp_path, fragments)
CLI_CASES: dict[str, tuple[str, Callable[[Path, Path], list[Any]], list[str]]] = {
    "resume_corrupt_checkpoint": ("`--resume` with a corrupt checkpoint",
                                  lambda r, t: ["search", "--resume", _damaged_run(r, t, "corrupt")],
                                  ["is corrupt or truncated", "delete"]),
    "resume_truncated_checkpoint": ("`--resume` with a truncated checkpoint",
                                    lambda r, t: ["search", "--resume", _damaged_run(r, t, "truncated")],
                                    ["is corrupt or truncated", "delete"]),
    "resume_wrong_version": ("`--resume` with a checkpoint of another version",
                             lambda r, t: ["search", "--resume", _damaged_run(r, t, "wrong_version")],
                             ["expected a dmscale checkpoint of version", "got version 999"]),
    "resume_not_a_run": ("`--resume` of a directory that is not a run",
                         lambda r, t: ["search", "--resume", t], ["is not a dmscale run directory"]),
    "export_untrained_search": ("`export` of a search stopped before its first search step (no importance)",
                                lambda r, t: ["export", _damaged_run(r, t, "untrained"), "--out", t / "out"],
                                ["the search stopped at step 0", "before any step updated importance",
                                 "has found no structure yet", "dmscale search --resume"]),
    "export_not_a_run": ("`export` of a directory that is not a run",
                         lambda r, t: ["export", t], ["is not a dmscale run directory"]),
    "target_nan_flag": ("`--target nan`", lambda r, t: ["search", *TINY, "--target", "nan", "--out", t / "o"],
                        ["nan"]),
    "data_truncated_idx": ("`--data` with a truncated IDX file",
                           lambda r, t: ["search", "--data", _idx_dir(t, "truncated_idx"), "--out", t / "o",
                                         "--quiet"], ["truncated IDX file"]),
    "imagefolder_empty": ("`--task imagefolder` on a folder without class folders",
                          lambda r, t: ["search", "--task", "imagefolder", "--data", _image_dir(t, "empty"),
                                        "--out", t / "o", "--quiet"], ["Couldn't find any class folder", "one folder per class"]),
    "imagefolder_not_an_image": ("`--task imagefolder` with a file that is not an image",
                                 lambda r, t: ["search", "--task", "imagefolder", "--data",
                                               _image_dir(t, "not_an_image"), "--out", t / "o", "--quiet"],
                                 ["cannot read image", "a.png", "remove or replace the file"]),
    "shards_missing": ("`--task imagefolder` with tar shards missing",
                       lambda r, t: ["search", "--task", "imagefolder", "--data", _image_dir(t, "shards_missing"),
                                     "--out", t / "o", "--quiet"], ["2 of its 3 shards do not exist", "train-1.tar"]),
    "shards_no_label": ("`--task imagefolder` with a tar shard whose image has no .cls",
                        lambda r, t: ["search", "--task", "imagefolder", "--data", _image_dir(t, "shards_no_label"),
                                      "--out", t / "o", "--quiet"], ["train-0.tar: member a.png has no label"]),
    "data_missing_file": ("`--data` with an MNIST file missing",
                          lambda r, t: ["search", "--data", _idx_dir(t, "missing"), "--out", t / "o", "--quiet"],
                          ["no MNIST file"]),
}


@pytest.mark.parametrize("name", list(CLI_CASES))
def test_cli_bad_input(name: str, stopped_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, args, fragments = CLI_CASES[name]
    before = {p.name: p.read_bytes() for p in stopped_run.iterdir() if p.is_file()}
    rc, err = cli(capsys, *args(stopped_run, tmp_path))
    lines = err.strip().splitlines()
    assert rc != 0, f"{name}: exit 0; stderr {err!r}"
    assert "Traceback" not in err and len(lines) == 1, f"{name}: stderr is not one line: {err!r}"
    for fragment in fragments:
        assert fragment in lines[0], f"{name}: {fragment!r} not in {lines[0]!r}"
    assert before == {q.name: q.read_bytes() for q in stopped_run.iterdir() if q.is_file()}


def test_not_an_image_with_ultralytics_imported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Importing Ultralytics patches PIL's ``Image.open`` to retry with a HEIF plugin that may
    not be installed: the unreadable file is still named (was: "No module named 'pi_heif'")."""
    pytest.importorskip("ultralytics")
    import ultralytics  # noqa: F401  (the patch is applied on import)

    _, args, fragments = CLI_CASES["imagefolder_not_an_image"]
    rc, err = cli(capsys, *args(tmp_path, tmp_path))
    assert rc != 0 and all(f in err for f in fragments), err


# ----------------------------------------------------------------------------- non-finite losses
def _nan_loss_at(monkeypatch: pytest.MonkeyPatch, bad_calls: set[int]) -> None:
    """Make the task loss NaN on the given (0-based) training calls."""
    from dmscale.tasks.registry import Task

    original = Task.task_loss
    calls = {"n": 0}

    def task_loss(self: Any, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = original(self, logits, targets)
        calls["n"] += 1
        return loss * float("nan") if calls["n"] - 1 in bad_calls else loss

    monkeypatch.setattr(Task, "task_loss", task_loss)


def test_a_nan_loss_step_is_skipped_and_poisons_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors.torch import load_file

    _nan_loss_at(monkeypatch, {1})
    rc, err = cli(capsys, "search", *TINY, "--epochs", "1", "--retrain-epochs", "1", "--out", tmp_path / "r")
    assert rc == 0, err
    events = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [e["global_step"] for e in events if e.get("event") == "non_finite_loss"] == [2]
    weights = load_file(str(tmp_path / "r" / "model.safetensors"))
    assert all(bool(torch.isfinite(w).all()) for w in weights.values())
    assert json.loads((tmp_path / "r" / "structure.json").read_text())["width"]


def test_a_loss_that_stays_nan_stops_with_a_message(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    _nan_loss_at(monkeypatch, set(range(1, 100)))
    rc, err = cli(capsys, "search", *TINY, "--epochs", "1", "--out", tmp_path / "r")
    lines = err.strip().splitlines()
    assert rc == 1 and len(lines) == 1 and "Traceback" not in err, err
    assert "loss was not finite (nan) for 3 steps in a row" in lines[0] and "lower --lr" in lines[0]


def test_a_search_whose_every_step_was_skipped_writes_no_structure(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Both search steps skipped (NaN loss) and the supernet already under the target, so no
    finish step either: no importance, so no structure.json of leading channels, but one line."""
    _nan_loss_at(monkeypatch, {0, 1})
    rc, err = cli(capsys, "search", *TINY, "--epochs", "1", "--target", "1.0", "--out", tmp_path / "r")
    lines = err.strip().splitlines()
    assert rc == 1 and len(lines) == 1 and "Traceback" not in err, err
    assert "the search ran 2 steps but none updated importance" in lines[0] and "--epochs" in lines[0]
    assert not (tmp_path / "r" / "structure.json").exists()


def test_a_full_disk_keeps_the_previous_checkpoint(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The second checkpoint write fails half-way with ENOSPC: one line, and checkpoint.pt is
    still the first one (which ``--resume`` then continues from)."""
    import errno

    import dmscale.run.pipeline as pipeline

    real_save, calls = torch.save, {"n": 0}

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            Path(f).write_bytes(b"half a checkpoint")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(pipeline.torch, "save", save)
    run = tmp_path / "r"
    rc, err = cli(capsys, "search", *TINY, "--epochs", "2", "--checkpoint-every", "1", "--out", run)
    lines = err.strip().splitlines()
    assert rc == 1 and len(lines) == 1 and "Traceback" not in err, err
    assert "No space left on device" in lines[0] and "previous checkpoint" in lines[0] and "--resume" in lines[0]
    assert not (run / "checkpoint.pt.tmp").exists()
    monkeypatch.undo()
    assert torch.load(run / "checkpoint.pt", weights_only=False)["global_step"] == 1
    rc, err = cli(capsys, "search", "--resume", run, "--stop-after", "3")
    assert rc == 0 and "--resume" in err


# ----------------------------------------------------------------------------- text data files
class _ByteTokenizer:
    """One token per UTF-8 byte: what :func:`dmscale.tasks.text.token_cache` needs of a tokenizer."""

    def get_vocab(self) -> dict[str, int]:
        return {str(i): i for i in range(256)}

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": list(text.encode("utf-8"))}


def _text_data(tmp: Path, damage: str) -> Path:
    d = tmp / "text"
    d.mkdir()
    (d / "a.txt").write_text("To be, or not to be, that is the question.\n" * 20, encoding="utf-8")
    if damage == "missing":
        return tmp / "no-such-text"
    if damage == "empty":
        (d / "a.txt").write_bytes(b"")
    elif damage == "gzip":
        (d / "b.txt.gz").write_bytes(gzip.compress(b"compressed text\n" * 50))
    elif damage == "latin1":
        (d / "b.txt").write_bytes("caf\u00e9 cr\u00e8me\n".encode("latin-1") * 10)
    elif damage == "truncated_utf8":  # cut in the middle of a two-byte character
        (d / "b.txt").write_bytes("na\u00efve\n".encode("utf-8") * 10 + "\u00e9".encode("utf-8")[:1])
    return d


TEXT_WHAT = {"missing": "`--task text --data` naming a path that does not exist",
             "empty": "`--task text --data` with only empty files",
             "gzip": "`--task text --data` holding a gzip-compressed file",
             "latin1": "`--task text --data` holding a Latin-1 (not UTF-8) file",
             "truncated_utf8": "`--task text --data` holding a file cut inside a UTF-8 character"}
TEXT_CASES = {"missing": ["no such file or directory", "give a text file"],
              "empty": ["no non-empty files", "give a UTF-8 text file"],
              "gzip": ["b.txt.gz is not UTF-8 text", "byte 1", "gzip-compressed: decompress it", "give plain UTF-8"],
              "latin1": ["b.txt is not UTF-8 text", "byte 3", "convert it"],
              "truncated_utf8": ["b.txt is not UTF-8 text", "byte 70", "unexpected end of data"]}


@pytest.mark.parametrize("damage", list(TEXT_CASES))
def test_text_data_files(damage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--task text`` data: a missing path, only empty files, or a file that is not UTF-8 text
    (compressed, another encoding, cut inside a character) is refused, naming the file (was:
    decoded with errors="replace", so the model trained on U+FFFD); no cache is left behind."""
    from dmscale.tasks.text import text_files, token_cache

    monkeypatch.setenv("DMSCALE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(DMScaleError) as info:
        token_cache(text_files(str(_text_data(tmp_path, damage))), _ByteTokenizer())
    for fragment in TEXT_CASES[damage]:
        assert fragment in str(info.value), f"{fragment!r} not in {info.value}"
    assert not list((tmp_path / "cache").rglob("*.bin*"))


def test_a_truncated_token_cache_is_written_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A token cache whose train.bin was cut short (a full disk, a copy interrupted) is rebuilt
    (was: memory-mapping it raised "mmap length is greater than file size")."""
    from dmscale.tasks.text import _memmap, token_cache, text_files

    monkeypatch.setenv("DMSCALE_CACHE", str(tmp_path / "cache"))
    files, tok = text_files(str(_text_data(tmp_path, "none"))), _ByteTokenizer()
    cache = token_cache(files, tok)
    whole = (cache / "train.bin").read_bytes()
    (cache / "train.bin").write_bytes(whole[: len(whole) // 2])
    again = token_cache(files, tok)
    meta = json.loads((again / "meta.json").read_text())
    assert again == cache and (again / "train.bin").read_bytes() == whole
    assert len(_memmap(again / "train.bin", meta["train_tokens"])) == len(whole) // 4
    (cache / "meta.json").write_text('{"train_tok')
    assert token_cache(files, tok) == cache and json.loads((cache / "meta.json").read_text()) == meta


def test_a_nan_backward_in_a_library_loop_leaves_importance_unchanged() -> None:
    """A library user's loop (no CLI): a backward through a NaN loss leaves every importance
    as it was (the Eq. 4 update is skipped), while the structural parameters get NaN
    gradients, which is why the Searcher docstring says to skip such a step; skipping it
    leaves the whole search state unchanged."""
    net = small_net()
    y = torch.tensor([0, 1])
    searcher = dms.prepare(net, X, dms.SearchConfig(target=0.5))
    opt = torch.optim.SGD([{"params": searcher.model_parameters(), "lr": 0.01},
                           {"params": searcher.structure_parameters(), "lr": 5e-3}])

    def loss_of(scale: float) -> torch.Tensor:
        return nn.functional.cross_entropy(net(X), y) * scale + searcher.resource_loss(0.5)

    opt.zero_grad(); loss_of(1.0).backward(); opt.step()  # noqa: E702  (one finite step first)
    topks = list(searcher.gates.width) + list(searcher.gates.depth)
    before = [t.importance.clone() for t in topks]
    assert any(bool(b.abs().sum() > 0) for b in before)
    state = {k: v.clone() for k, v in searcher.state_dict()["gates"].items()}
    opt.zero_grad()
    loss = loss_of(float("nan"))
    loss.backward()
    assert all(torch.equal(t.importance, b) for t, b in zip(topks, before)), "a NaN backward changed importance"
    assert any(p.grad is not None and not bool(torch.isfinite(p.grad).all())
               for p in searcher.structure_parameters()), "expected NaN gradients on the structural parameters"
    if torch.isfinite(loss):  # the documented guard: the step is skipped
        opt.step()
    after = searcher.state_dict()["gates"]
    assert all(torch.equal(after[k], v) for k, v in state.items())


def _search_state(searcher: dms.Searcher, net: nn.Module) -> dict[str, Any]:
    return {"gates": {k: v.clone() for k, v in searcher.state_dict()["gates"].items()},
            "model": {k: v.clone() for k, v in net.state_dict().items()},
            "modes": [m.training for m in net.modules()], "target": searcher.target_cost,
            "grads": [None if p.grad is None else p.grad.clone() for p in net.parameters()]}


def _assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["gates"].keys() == b["gates"].keys() and a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["gates"][k], b["gates"][k]) for k in a["gates"]), "the search state changed"
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]), "the model's weights changed"
    assert a["modes"] == b["modes"] and a["target"] == b["target"]
    assert all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for x, y in zip(a["grads"], b["grads"])), "gradients changed"


def test_export_before_training_raises_changes_nothing_and_one_step_fixes_it() -> None:
    """Before any task-loss backward every importance is zero: ``export()`` and ``structure()``
    raise :class:`NoImportanceError` (not an arbitrary structure of leading elements) and
    change nothing; ``hardened()`` and ``meet_target()`` stay usable; one training step with
    the task loss is enough to export, and so is a checkpoint with importance restored by
    ``load_state_dict``; ``importance="index"`` exports by position on purpose."""
    from dmscale.core.errors import NoImportanceError

    net = small_net()
    y = torch.tensor([0, 1])
    searcher = dms.prepare(net, X, dms.SearchConfig(target=0.5))
    assert not searcher.has_importance()
    searcher.meet_target()
    with torch.no_grad(), searcher.hardened():
        net(X)
    before = _search_state(searcher, net)
    for call, name in ((searcher.export, "export()"), (searcher.structure, "structure()"),
                       (lambda: searcher.export(verify=False), "export()")):
        with pytest.raises(NoImportanceError, match=r"importance=\"index\"") as info:
            call()
        assert str(info.value).startswith(f"{name} before any importance exists")
        _assert_same_state(before, _search_state(searcher, net))
    fresh = small_net()
    fresh_searcher = dms.prepare(fresh, X, dms.SearchConfig(target=0.5))
    untrained_state = searcher.state_dict()
    # a resource-loss-only backward is not a task-loss step: still no importance
    searcher.resource_loss(1.0).backward()
    assert not searcher.has_importance()
    opt = torch.optim.SGD([{"params": searcher.model_parameters(), "lr": 0.01},
                           {"params": searcher.structure_parameters(), "lr": 5e-3}])
    opt.zero_grad()
    (nn.functional.cross_entropy(net(X), y) + searcher.resource_loss(0.5)).backward()
    opt.step()
    assert searcher.has_importance()
    searcher.meet_target()
    small = searcher.export()
    assert dms.count(small, X)["macs"] == round(searcher.resources()["hard"])
    # importance comes back with a checkpoint (derived from the buffers, no separate flag) ...
    fresh_searcher.load_state_dict(searcher.state_dict())
    assert fresh_searcher.has_importance()
    fresh.load_state_dict(net.state_dict())
    assert fresh_searcher.structure() == searcher.structure()
    # ... and goes away with one of an untrained search
    fresh_searcher.load_state_dict(untrained_state)
    with pytest.raises(NoImportanceError):
        fresh_searcher.export()
    dms.detach(net), dms.detach(fresh)
    # importance="index": keeping leading elements is what was asked for
    by_index = small_net()
    s_index = dms.prepare(by_index, X, dms.SearchConfig(target=0.5, importance="index"))
    assert s_index.has_importance()
    s_index.meet_target()
    assert dms.count(s_index.export(), X)["macs"] == round(s_index.resources()["hard"])


# ----------------------------------------------------------------------------- the table of docs/errors.md
def _row(what: str, err: BaseException | str, tmp: Path) -> str:
    msg = (err if isinstance(err, str) else f"`{type(err).__name__}`: {err}").strip()
    msg = msg.replace(str(tmp), "DIR").replace("|", "\\|")
    return f"| {what} | {msg} |"


def _library_rows(tmp: Path) -> list[str]:
    rows = []
    for name, (what, call, _) in LIBRARY_CASES.items():
        (tmp / name).mkdir()
        try:
            call(MODELS.get(name, (small_net, X))[0](), tmp / name)
        except DMScaleError as err:
            rows.append(_row(what, err, tmp / name))
    return rows


def _data_rows(tmp: Path) -> list[str]:
    from dmscale.data import load_mnist_dir
    from dmscale.tasks.text import text_files, token_cache

    rows = []
    for damage, what in DATA_WHAT.items():
        (tmp / f"idx-{damage}").mkdir()
        try:
            load_mnist_dir(_idx_dir(tmp / f"idx-{damage}", damage))
        except DMScaleError as err:
            rows.append(_row(what, err, tmp / f"idx-{damage}"))
    os.environ["DMSCALE_CACHE"] = str(tmp / "token-cache")
    for damage, what in TEXT_WHAT.items():
        (tmp / f"text-{damage}").mkdir()
        try:
            token_cache(text_files(str(_text_data(tmp / f"text-{damage}", damage))), _ByteTokenizer())
        except DMScaleError as err:
            rows.append(_row(what, err, tmp / f"text-{damage}"))
    return rows


def _cli_rows(tmp: Path) -> list[str]:
    """``dmscale ...`` cases: the one stderr line and the exit status."""
    import contextlib
    import io

    from dmscale.cli import main

    stopped = tmp / "stopped"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        main(["search", *TINY, "--epochs", "1", "--out", str(stopped), "--stop-after", "2"])
    rows = []
    for name, (what, args, _) in CLI_CASES.items():
        (tmp / name).mkdir()
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            try:
                rc = main([str(a) for a in args(stopped, tmp / name)])
            except SystemExit as stop:
                rc = stop.code if isinstance(stop.code, int) else 1
        line = err.getvalue().strip().replace(str(stopped), "RUN")
        rows.append(_row(what, f"exit {rc}: {line}", tmp / name))
    return rows


def markdown_table(tmp_path: Path) -> str:
    """The table of docs/errors.md, from the messages every case gets today (library calls, data files,
    then the command line)."""
    rows = ["| Bad input | Error and message |", "| --- | --- |"]
    return "\n".join(rows + _library_rows(tmp_path) + _data_rows(tmp_path) + _cli_rows(tmp_path))


def test_every_library_case_has_a_table_row(tmp_path: Path) -> None:
    assert len(_library_rows(tmp_path)) == len(LIBRARY_CASES)


if __name__ == "__main__":  # print the table of docs/errors.md
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        print(markdown_table(Path(tmp)))


@pytest.mark.parametrize("value", ["0", "1.5", "-0.2"])
def test_schedule_end_outside_its_range_names_the_range(capsys: pytest.CaptureFixture[str], value: str) -> None:
    rc, err = cli(capsys, "search", *TINY, "--schedule-end", value, "--epochs", "0.01")
    assert rc != 0 and "schedule-end" in err and "(0, 1]" in err, err


@pytest.mark.parametrize("value", ["1", "1.5", "-0.2", "x"])
def test_settle_outside_its_range_names_the_range(capsys: pytest.CaptureFixture[str], value: str) -> None:
    rc, err = cli(capsys, "search", *TINY, "--settle", value, "--epochs", "0.01")
    assert rc == 2 and "settle" in err and ("[0, 1)" in err or "number" in err), err
