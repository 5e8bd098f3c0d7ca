"""A resource registered in this file alone (``layer_params``: the parameters of linear and
convolution layers, norms and biases of other modules left out) is a resource everywhere:
``dmscale search --help``, a library search, a command-line search, its summary and its
``structure.json``; nothing outside this file names it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dmscale as dms
from dmscale.cli import main
from dmscale.core.errors import ConfigError
from dmscale.cost.budgets import Budgets
from dmscale.cost.registry import (TermResource, format_value, register_resource, resource_named,
                                   resources, unregister_resource)
from dmscale.run.report import format_summary

NAME = "layer_params"
_LAYERS = (nn.Linear, nn.Conv2d)


def _layer(name: str, module: nn.Module) -> bool:
    return isinstance(module, _LAYERS)


def _count(model: nn.Module, example_inputs: Any) -> float:
    return float(sum(p.numel() for m in model.modules() if isinstance(m, _LAYERS)
                     for p in m.parameters(recurse=False)))


class LayerParams(TermResource):
    """Its own display: a count with a unit, so the summary shows whose format it is."""

    def format(self, value: float | None) -> str:
        return format_value(value) + " lp"


@pytest.fixture(autouse=True)
def layer_params():
    res = register_resource(LayerParams(NAME, "parameters of linear and convolution layers", "parameters",
                                        rows=lambda cm, model, space: cm.params_rows(model, space, where=_layer),
                                        counter=_count))
    yield res
    unregister_resource(NAME)
    assert NAME not in [r.name for r in resources()]


def _mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 4)), torch.randn(4, 8)


def test_it_is_a_choice_of_search_help(capsys):
    with pytest.raises(SystemExit):
        main(["search", "--help"])
    assert "--resource {macs,params,latency,kv_cache,layer_params}" in capsys.readouterr().out


def test_a_library_search_lands_on_it_and_its_count_is_the_exports():
    net, x = _mlp()
    searcher = dms.prepare(net, x, dms.SearchConfig(resource=NAME, target=0.5))
    res = searcher.resources()
    assert res["resource"] == NAME and res["supernet"] == _count(net, x)  # the norm is not counted
    assert res["supernet"] == 8 * 32 + 32 + 32 * 4 + 4
    y = torch.randint(0, 4, (4,))
    opt = searcher.optimizer(torch.optim.SGD(list(searcher.model_parameters()), lr=0.1), total_steps=30,
                             structure_lr=0.05)
    for step in range(30):
        loss = nn.functional.cross_entropy(net(x), y) + searcher.resource_loss(step / 30)
        opt.zero_grad()
        loss.backward()
        opt.step()
    searcher.meet_target()
    res = searcher.resources()
    assert res["hard"] <= res["target"] * (1 + 1e-9)
    small = searcher.export()
    assert resource_named(NAME).count(small, x) == res["hard"]
    assert searcher.structure()["resource"]["resource"] == NAME


def test_it_is_a_budget_among_others():
    budgets = Budgets.of("macs", f"params=0.8,{NAME}=0.6")
    assert list(budgets) == ["params", NAME]
    net, x = _mlp()
    searcher = dms.prepare(net, x, dms.SearchConfig(targets=dict(budgets)))
    assert sorted(searcher.resources()["budgets"]) == sorted(["params", NAME])
    dms.detach(net)
    unregister_resource(NAME)
    with pytest.raises(ConfigError, match=f"unknown resource '{NAME}'"):
        dms.SearchConfig(resource=NAME)


def test_a_command_line_search_lands_on_it_in_its_summary_and_structure(tmp_path: Path, capsys):
    out = tmp_path / "run"
    rc = main(["search", "--task", "digits", "--model", "smallcnn", "--model-args", "width=4,blocks=2",
               "--train-limit", "128", "--test-limit", "64", "--batch-size", "32", "--epochs", "1",
               "--retrain-epochs", "0", "--structure-lr", "0.05", "--threads", "1", "--quiet",
               "--resource", NAME, "--target", "0.6", "--out", str(out)])
    assert rc == 0
    structure = json.loads((out / "structure.json").read_text())
    assert structure["resource"]["resource"] == NAME
    assert structure["resource"]["hard"] <= structure["resource"]["target"] * (1 + 1e-9)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resource"] == NAME and summary["resources"]["resource"] == NAME
    printed = format_summary(summary)
    assert f"budget        {NAME} " in printed and " lp" in printed


def test_the_docs_table_of_resources_reads_the_registry():
    """docs/cli.md's table of resources is the registry's: with this file's resource registered
    it is stale (and names it once written), without it it is what the document holds."""
    import importlib.util
    import sys

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("cli_tables_registry", root / "scripts" / "cli_tables.py")
    ct = importlib.util.module_from_spec(spec)
    sys.modules["cli_tables_registry"] = ct
    spec.loader.exec_module(ct)
    assert sorted(p.group for p in ct.check()) == ["resources", "search"]  # and --resource's choices
    assert f"| `{NAME}` | parameters | parameters of linear and convolution layers |" in ct.resource_table()
    unregister_resource(NAME)
    assert ct.check() == []
