"""``keep_width`` / ``--keep-width`` (src/dmscale/search/setup.py:held_whole): widths the search
never narrows, by layer name or as every residual stream, on torchvision's ResNet-18."""

from __future__ import annotations

import pytest
import torch

import dmscale as dms
from dmscale.core.errors import ConfigError
from dmscale.trace.naming import residual_stream

torchvision = pytest.importorskip("torchvision")
X = torch.randn(2, 3, 32, 32)


def _search(keep: list[str]) -> dict:
    model = torchvision.models.resnet18(num_classes=10)
    searcher = dms.prepare(model, X, dms.SearchConfig(target=0.3, keep_width=keep))
    loss = model(X).logsumexp(1).mean() + searcher.resource_loss(1.0)
    loss.backward()
    res = searcher.meet_target()
    structure = searcher.structure()
    small = searcher.export()  # verified against the hardened supernet
    assert dms.count(small, X)["macs"] == res["hard"] <= res["target"] * (1 + 1e-9)
    return structure


def test_residual_streams_stay_whole_and_the_rest_meets_the_budget():
    structure = _search(["residual"])
    streams = [w for w in structure["width"] if residual_stream(w["producers"]) is not None]
    assert [w["name"] for w in streams] == ["conv1", "layer2.0.conv2", "layer3.0.conv2", "layer4.0.conv2"]
    assert all(w["kept"] == w["size"] for w in streams)
    inner = [w for w in structure["width"] if residual_stream(w["producers"]) is None]
    assert sum(w["kept"] for w in inner) < sum(w["size"] for w in inner)  # the budget came from them


def test_without_it_the_same_search_thins_a_stream():
    """The check of the check: the same budget with nothing held narrows some residual stream."""
    structure = _search([])
    streams = [w for w in structure["width"] if residual_stream(w["producers"]) is not None]
    assert any(w["kept"] < w["size"] for w in streams)


def test_a_layer_name_holds_the_dim_it_writes():
    structure = _search(["layer3.1.conv1", "layer4.*.conv2"])
    kept = {w["name"]: (w["kept"], w["size"]) for w in structure["width"]}
    assert kept["layer3.1.conv1"] == (256, 256) and kept["layer4.0.conv2"] == (512, 512)


@pytest.mark.parametrize("keep, says", [(["layer9.conv"], "'layer9.conv'")])
def test_a_pattern_that_holds_nothing_is_refused_and_the_model_is_left_alone(keep, says):
    model = torchvision.models.resnet18(num_classes=10)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match=says):
        dms.prepare(model, X, dms.SearchConfig(keep_width=keep))
    assert "dms_gates" not in dict(model.named_modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_string_is_read_as_the_command_line_reads_it():
    # one converter for the library, --keep-width and a config file: comma-separated names
    assert dms.SearchConfig(keep_width="residual").keep_width == ["residual"]
    assert dms.SearchConfig(keep_depth="layer1.0, layer2.1").keep_depth == ["layer1.0", "layer2.1"]


def test_residual_on_a_model_without_streams_names_the_reason():
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    with pytest.raises(ConfigError, match="no width dim is written by two or more blocks"):
        dms.prepare(mlp, torch.randn(2, 8), dms.SearchConfig(keep_width=["residual"]))
