"""The weights a run starts from: ``--weights PATH`` and ``--pretrained``
(src/dmscale/tasks/start_weights.py, src/dmscale/tasks/pretrained.py)."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_model

import dmscale.tasks.pretrained as pretrained
from dmscale.config.run_config import ConfigError, RunConfig
from dmscale.tasks.registry import build_model
from dmscale.tasks.start_weights import load_start_weights

IMAGE = {"kind": "classification", "num_classes": 10, "in_channels": 1, "image_size": [8, 8]}


def _cfg(**kw) -> RunConfig:
    kw.setdefault("model", "smallcnn")
    kw.setdefault("model_args", {"width": 4, "blocks": 1})
    return RunConfig(task="digits", **kw).resolved()


def _model(cfg: RunConfig, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(cfg, IMAGE)[0]


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("form", ["state_dict", "checkpoint", "ddp_prefix", "safetensors"])
def test_the_model_starts_from_the_file(tmp_path: Path, form: str) -> None:
    cfg = _cfg()
    source = _model(cfg, 1)
    state = source.state_dict()
    path = tmp_path / ("w.safetensors" if form == "safetensors" else "w.pt")
    if form == "state_dict":
        torch.save(state, path)
    elif form == "checkpoint":
        torch.save({"epoch": 7, "optimizer": {"lr": 0.1}, "state_dict": state}, path)
    elif form == "ddp_prefix":
        torch.save({"model": {f"module.{k}": v for k, v in state.items()}}, path)
    else:
        save_model(source, str(path))
    model = _model(cfg, 2)
    assert not _same(model, source)
    text = load_start_weights(model, replace(cfg, weights=str(path)), IMAGE)
    assert text == f"starting from the weights in {path}"
    assert _same(model, source)


def test_no_start_weights_leaves_the_model_alone() -> None:
    cfg = _cfg()
    model, again = _model(cfg, 3), _model(cfg, 3)
    assert load_start_weights(model, cfg, IMAGE) is None and _same(model, again)


def test_a_file_of_another_shape_names_the_key_and_both_shapes(tmp_path: Path) -> None:
    torch.save(_model(_cfg(model_args={"width": 8, "blocks": 1}), 0).state_dict(), tmp_path / "w8.pt")
    cfg = replace(_cfg(), weights=str(tmp_path / "w8.pt"))
    model = _model(cfg, 0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError) as err:
        load_start_weights(model, cfg, IMAGE)
    text = str(err.value)
    assert text.startswith("--weights: the weights in") and "do not fit --model smallcnn" in text
    assert "'stem.0.weight' is [8, 1, 3, 3] in the file, [4, 1, 3, 3] in --model smallcnn" in text
    assert "same --model and --model-args" in text
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing loaded


def test_missing_and_unexpected_keys_are_named(tmp_path: Path) -> None:
    cfg = _cfg()
    state = _model(cfg, 0).state_dict()
    first = next(iter(state))
    missing = {k: v for k, v in state.items() if k != first}
    torch.save(missing, tmp_path / "missing.pt")
    torch.save({**state, "extra.weight": torch.zeros(2)}, tmp_path / "extra.pt")
    with pytest.raises(ConfigError, match=f"1 tensor missing from the file \\('{first}'\\)"):
        load_start_weights(_model(cfg, 0), replace(cfg, weights=str(tmp_path / "missing.pt")), IMAGE)
    with pytest.raises(ConfigError, match="1 tensor in the file but not in the model \\('extra.weight'\\)"):
        load_start_weights(_model(cfg, 0), replace(cfg, weights=str(tmp_path / "extra.pt")), IMAGE)


def test_files_that_are_not_weights_are_refused(tmp_path: Path) -> None:
    cfg = _cfg()
    torch.save([1, 2, 3], tmp_path / "list.pt")
    torch.save({"epoch": 1, "lr": 0.1}, tmp_path / "meta.pt")
    torch.save(_model(cfg, 0), tmp_path / "module.pt")
    (tmp_path / "junk.safetensors").write_bytes(b"not safetensors")
    for name, words in [("list.pt", "holds a list, not a state dict"),
                        ("meta.pt", "holds a dict without a state dict (keys 'epoch', 'lr')"),
                        ("module.pt", "torch.save(model.state_dict(), PATH)"),
                        ("junk.safetensors", "not a readable safetensors file"),
                        ("absent.pt", "no weights file")]:
        with pytest.raises(ConfigError) as err:
            load_start_weights(_model(cfg, 0), replace(cfg, weights=str(tmp_path / name)), IMAGE)
        assert words in str(err.value), (name, str(err.value))


@pytest.mark.parametrize("kw, words", [
    ({"model": "smallcnn", "pretrained": True}, "--model tv:NAME or timm:NAME; --model smallcnn"),
    ({"model": None, "model_args": None, "pretrained": True}, "resnet (the default of --task digits)"),
    ({"model": "hf:/models/x", "weights": "w.pt", "pipeline": "p"}, "brings its own"),
    ({"model": "yolo:yolov8n.yaml", "weights": "w.pt", "task": "detect"}, "brings its own"),
    ({"weights": "w.pt", "init": "runs/pre", "pipeline": "p"}, "give one of them"),
])
def test_options_that_cannot_go_together(kw: dict, words: str) -> None:
    kw = {"task": "digits", "model": "smallcnn", **kw}
    with pytest.raises(ConfigError, match=words.replace("(", "\\(").replace(")", "\\)")):
        RunConfig(**kw)


# ----------------------------------------------------------------------------- --pretrained
def _tv_cfg(**kw) -> RunConfig:
    return RunConfig(task="digits", model="tv:resnet18", pretrained=True, **kw).resolved()


def test_pretrained_weights_from_a_local_copy_are_adapted_like_the_download(tmp_path: Path) -> None:
    """--pretrained --weights FILE: the library's ImageNet state dict (1000 classes, RGB) onto a
    10-class, 1-channel resnet18: head kept random, first conv summed over RGB, the rest as is."""
    from dmscale.core._compat import ensure_torchvision

    ensure_torchvision()
    import torchvision

    torch.manual_seed(5)
    library = torchvision.models.resnet18().state_dict()
    torch.save(library, tmp_path / "resnet18-imagenet.pth")
    cfg = _tv_cfg(weights=str(tmp_path / "resnet18-imagenet.pth"))
    model = _model(cfg, 0)
    head = model.fc.weight.detach().clone()
    text = load_start_weights(model, cfg, IMAGE)
    assert "fc.weight, fc.bias kept random (10 classes, not 1000)" in text
    assert "conv1.weight adapted to 1 channel" in text
    assert torch.equal(model.fc.weight, head)
    torch.testing.assert_close(model.conv1.weight, library["conv1.weight"].sum(1, keepdim=True))
    assert torch.equal(model.layer4[1].conv2.weight, library["layer4.1.conv2.weight"])
    # the same file without --pretrained must fit exactly: refused, with the way out
    with pytest.raises(ConfigError, match="add --pretrained"):
        load_start_weights(_model(cfg, 0), replace(cfg, pretrained=False), IMAGE)


def test_library_weights_for_three_channels_of_another_count_are_repeated_and_scaled() -> None:
    net = torch.nn.Sequential(torch.nn.Conv2d(5, 2, 1))
    lib = {"0.weight": torch.arange(6.0).reshape(2, 3, 1, 1), "0.bias": torch.zeros(2)}
    state, notes = pretrained.fit_library_state(net, lib, {"num_classes": 2, "in_channels": 5})
    assert notes == ["0.weight adapted to 5 channels"]
    torch.testing.assert_close(state["0.weight"][0, :, 0, 0], torch.tensor([0.0, 1, 2, 0, 1]) * 3 / 5)


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[str]:
    """No cached weights, no offline variables, and every host unreachable (the probe is
    replaced: the test never touches the network and finishes at once)."""
    probed: list[str] = []
    for var in pretrained.OFFLINE_ENV:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))
    monkeypatch.setattr(pretrained, "_hub_cached", lambda repo, filename: False)
    monkeypatch.setattr(pretrained, "network_reachable", lambda url, timeout=3.0: probed.append(url) or False)
    return probed


@pytest.mark.parametrize("name, host", [("tv:resnet18", "download.pytorch.org"),
                                        ("timm:resnet18", "huggingface.co")])
def test_pretrained_offline_fails_at_once_and_suggests_a_local_file(offline: list[str], name: str,
                                                                    host: str) -> None:
    cfg = RunConfig(task="digits", model=name, pretrained=True).resolved()
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as err:
        load_start_weights(_model(cfg, 0), cfg, IMAGE)
    text = str(err.value)
    assert time.monotonic() - t0 < 10
    assert text.startswith(f"--pretrained: the pretrained weights of --model {name} could not be fetched")
    assert f"this machine seems offline ({host} cannot be reached)" in text
    assert "--weights PATH" in text and "\n" not in text
    assert offline and host in offline[0]


def test_an_offline_variable_skips_the_probe(offline: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = _tv_cfg()
    with pytest.raises(ConfigError, match="seems offline \\(HF_HUB_OFFLINE=1 is set\\)"):
        load_start_weights(_model(cfg, 0), cfg, IMAGE)
    assert offline == []


def test_the_network_probe_gives_up_quickly() -> None:
    t0 = time.monotonic()
    assert pretrained.network_reachable("https://dmscale-probe.invalid/x", timeout=1.0) is False
    assert time.monotonic() - t0 < 5
