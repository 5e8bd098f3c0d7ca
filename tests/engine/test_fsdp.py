"""FSDP2 (``dmscale.engine.fsdp``): the sharding plan, the one-process no-op, the refusals, and
two CPU ranks on gloo (``fsdp_worker.worker``, one spawn per module) searching a tiny Llama
sharded per decoder layer, compared with :func:`fsdp_worker.search` in this process on the
whole global batches.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dmscale as dms
from spawn_ranks import spawn_ranks
import fsdp_worker
from dmscale.core.errors import ConfigError
from dmscale.engine import fsdp
from dmscale.engine.fsdp import (
    export_search,
    model_state,
    plan_shards,
    shard_model,
    sharded,
    sync_replicated_grads,
    unsharded,
)
from dmscale.engine.fsdp_plan import fsdp_unavailable
from zoo import ResidualMLP

WORLD, DEADLINE_S = 2, 300.0


def _residual() -> nn.Module:
    torch.manual_seed(0)
    return ResidualMLP(3)


# ---------------------------------------------------------------------- one process
def test_plan_of_a_llama_shards_its_decoder_layers_and_keeps_the_gates_replicated():
    model = fsdp_worker.build()
    searcher = dms.prepare(model, {"input_ids": fsdp_worker.probe_ids()}, dms.SearchConfig("params", 0.6))
    plan = plan_shards(model, space=searcher.space)
    assert plan.blocks == ("model.layers.0", "model.layers.1", "model.layers.2")  # _no_split_modules
    gates = {n for n, _ in model.named_parameters() if n.startswith("dms_gates.")}
    assert set(plan.replicated) == gates and len(gates) == len(list(searcher.structure_parameters()))


def test_plan_from_the_search_space_else_the_longest_module_list():
    net = _residual()
    searcher = dms.prepare(net, torch.randn(4, 8), dms.SearchConfig("params", 0.5))
    assert [b.name for d in searcher.space.depth for b in d.blocks] == ["blocks.0", "blocks.1", "blocks.2"]
    assert plan_shards(net, space=searcher.space).blocks == ("blocks.0", "blocks.1", "blocks.2")
    assert plan_shards(_residual()).blocks == ("blocks.0", "blocks.1", "blocks.2")  # no space: the list
    assert plan_shards(nn.Linear(2, 2)).blocks == ()  # nothing to split: the root alone
    assert plan_shards(net, blocks=["blocks", "blocks.1.fc1"]).blocks == ("blocks.1.fc1", "blocks")


@pytest.mark.parametrize("block, why", [("nope", "not a submodule"), ("", "not a submodule"),
                                        ("dms_gates", "structural parameters"),
                                        ("blocks.0.fc1.missing", "not a submodule")])
def test_plan_refuses_blocks_it_cannot_shard(block, why):
    net = _residual()
    dms.prepare(net, torch.randn(4, 8), dms.SearchConfig("params", 0.5))
    with pytest.raises(ConfigError, match=why):
        plan_shards(net, blocks=[block])
    with pytest.raises(ConfigError, match="no parameters"):
        plan_shards(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), blocks=["1"])


def test_one_process_shards_nothing_and_every_helper_passes_through():
    net = _residual()
    x = torch.randn(4, 8)
    searcher = dms.prepare(net, x, dms.SearchConfig("params", 0.5))
    handle = shard_model(net, space=searcher.space)
    assert not handle.active and sharded(net) is None and unsharded(net) is net
    net(x).pow(2).mean().backward()
    assert sync_replicated_grads(net) == 0 and handle.sync_grads() == 0
    assert model_state(net).keys() == net.state_dict().keys()
    small = export_search(searcher)
    assert dms.count(small, x)["params"] == searcher.resources()["hard"]


def test_the_frame_takes_no_weights_and_is_filled_with_ties_kept():
    """What rank 0 gathers into: a copy of the prepared model on the meta device, filled
    from a full state dict, computes what the model computes (tied embeddings stay tied)."""
    model = fsdp_worker.build(layers=2)
    ids = fsdp_worker.probe_ids()
    dms.prepare(model, {"input_ids": ids}, dms.SearchConfig("params", 0.6))
    frame = fsdp._skeleton(model)
    assert all(p.is_meta for p in frame.parameters())
    full = fsdp._materialize(frame, {k: v.clone() for k, v in model.state_dict().items()})
    assert full.lm_head.weight is full.model.embed_tokens.weight
    with torch.no_grad():
        torch.testing.assert_close(full.eval()(input_ids=ids).logits, model.eval()(input_ids=ids).logits)


def test_an_fsdp_without_ignored_params_is_refused_by_name(monkeypatch):
    import torch.distributed.fsdp as tfsdp

    monkeypatch.setattr(tfsdp, "fully_shard", lambda module, mesh=None: module)
    why = fsdp_unavailable()
    assert why is not None and "ignored_params" in why and torch.__version__ in why
    monkeypatch.setattr(fsdp, "is_distributed", lambda group=None: True)
    with pytest.raises(ConfigError, match="cannot shard with FSDP: .*ignored_params.*upgrade torch"):
        shard_model(nn.Sequential(nn.Linear(2, 2)))


# ---------------------------------------------------------------------- two ranks, gloo
def _spawn(tmp_path, cases: tuple[str, ...]) -> list[dict]:
    return spawn_ranks(fsdp_worker.worker, WORLD, tmp_path, cases, deadline_s=DEADLINE_S)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with the gloo backend is not available in this torch build")
    out = tmp_path_factory.mktemp("fsdp")
    return _spawn(out, ("fold",)), out


@pytest.fixture(scope="module")
def single():
    return fsdp_worker.search(True)


def _assert_identical(r0: dict, r1: dict) -> None:
    assert r0["active"] and r1["active"] and r0["sharded_types"] == ["DTensor"]
    assert torch.equal(r0["a"], r1["a"])
    assert all(torch.equal(a, b) for a, b in zip(r0["importance"], r1["importance"]))
    assert r0["width"] == r1["width"] and r0["depth"] == r1["depth"]


def _assert_matches(got: dict, ref: dict) -> None:
    torch.testing.assert_close(got["a"], ref["a"], rtol=1e-5, atol=1e-6)
    for a, b in zip(got["importance"], ref["importance"]):  # relative to its scale
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()))
    assert got["width"] == ref["width"] and got["depth"] == ref["depth"]
    assert got["state"].keys() == ref["state"].keys()
    for k, v in ref["state"].items():
        torch.testing.assert_close(got["state"][k], v, rtol=1e-5, atol=1e-6)


def test_every_rank_ends_with_the_same_search(ranks):
    (r0, r1), _ = ranks
    assert r0["fold"]["blocks"] == ["model.layers.0", "model.layers.1", "model.layers.2"]
    _assert_identical(r0["fold"], r1["fold"])


def test_fsdp_equals_one_process_on_the_global_batch(ranks, single):
    """Structure, ``a``, importance and every weight (gathered on rank 0) as one process
    computes them on the whole batch: the masks folded into the unsharded weights inside the
    forward give the same function and gradients."""
    (r0, _), _ = ranks
    _assert_matches(r0["fold"], single)


def test_the_export_is_made_on_rank_0_and_is_the_one_process_export(ranks, single):
    (r0, r1), _ = ranks
    got = r0["fold"]
    assert "export_logits" not in r1["fold"]  # the other ranks get None and go on
    assert got["export_shapes"] == single["export_shapes"]
    assert got["counted"] == got["hard"] == single["hard"]
    torch.testing.assert_close(got["export_logits"], single["export_logits"], rtol=1e-4, atol=1e-5)


def test_the_exported_llama_loads_with_from_pretrained(ranks):
    from hf_fresh import load_fresh

    (r0, _), out = ranks
    fmt = json.loads((out / "hf" / "dmscale.json").read_text())["format"]  # per-layer sizes: remote code
    loaded = load_fresh([(str(out / "hf"), fmt == "per_layer")], fsdp_worker.probe_ids(), new_tokens=2)[0]
    assert loaded["class"].endswith("ForCausalLM") and not loaded["dmscale_loaded"]
    torch.testing.assert_close(loaded["logits"], r0["fold"]["export_logits"], rtol=1e-4, atol=1e-5)


def test_a_gathered_checkpoint_resumes_into_a_fresh_sharded_model(ranks):
    """Model and optimizer state gathered to rank 0 and loaded into a new sharded copy (as a
    ``--resume`` does): both take the same next step on every rank."""
    (r0, r1), _ = ranks
    assert r0["fold"]["resumed"] and r1["fold"]["resumed"]


@pytest.mark.slow  # a second spawn (~1 min on 2 cores)
def test_masks_on_the_activations_give_the_same_search(tmp_path):
    r0, r1 = _spawn(tmp_path, ("activations",))
    _assert_identical(r0["activations"], r1["activations"])
    _assert_matches(r0["activations"], fsdp_worker.search(False))
