"""The Searcher: config validation, target bounds, schedule (Eq. 10), loss (Eq. 6), state."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from zoo import ZOO

import dmscale as dms
from dmscale.tasks.models import SmallCNN


def _all_topks(searcher) -> list:
    """Every dim's gate, width then depth (each has its own ratio here: no tied dims)."""
    return [*searcher.gates.width, *searcher.gates.depth]


def _resnet20():
    entry = ZOO["resnet20"]
    return entry.build(), torch.randn(2, *entry.input_shape[1:])


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"resource": "flops"}, r"unknown resource 'flops': expected one of"),
        ({"target": 0}, r"target must be a finite number > 0, got 0"),
        ({"target": -1.0}, r"target must be a finite number > 0, got -1.0"),
        ({"schedule": "linear"}, r"schedule: expected 'exp' or 'constant', got 'linear'"),
        ({"schedule_end": 0.0}, r"schedule_end: expected a number in \(0, 1\], got 0.0"),
        ({"schedule_end": 1.5}, r"schedule_end: expected a number in \(0, 1\], got 1.5"),
        ({"importance": "l2"}, r"importance: unknown importance 'l2': expected one of"),
        ({"min_width": 0}, r"min_width: expected a positive integer, got 0"),
        ({"width_only_from": 1.5}, r"width_only_from: expected a number in \[0, 1\], got 1.5"),
        ({"search_width": False, "search_depth": False}, r"nothing to search"),
        ({"cost_forward": "hard"}, r"cost_forward: expected one of \('soft', 'exact'\), got 'hard'"),
        ({"resource_weight": None}, r"resource_weight: expected a value \(auto is resolved by a dmscale run"),
        ({"width_temperature": 0}, r"width_temperature: expected a number > 0, got 0"),
        ({"gate_factory": 3}, r"gate_factory: expected a callable that builds a StructuralGate"),
        ({"verify": "maybe"}, r"verify: expected true or false, got 'maybe'"),
    ],
)
def test_config_validation(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        dms.SearchConfig(**kwargs)


def test_infeasible_target_states_both_bounds_and_leaves_model_untouched():
    model, x = _resnet20()
    keys = list(model.state_dict())
    supernet = dms.count(model, x)["macs"]
    with pytest.raises(ValueError) as err:
        dms.prepare(model, x, dms.SearchConfig(target=10.0))  # absolute: 10 MACs
    msg = str(err.value)
    assert "smallest" in msg and "supernet" in msg and f"{supernet:,}" in msg
    assert list(model.state_dict()) == keys and not hasattr(model, "dms_gates")
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    with pytest.raises(ValueError, match="outside what this search space can reach"):
        dms.prepare(model, x, dms.SearchConfig(target=float(supernet * 2)))


def test_profile_bounds_and_absolute_target():
    model, x = _resnet20()
    searcher = dms.prepare(model, x, dms.SearchConfig(target=0.5))
    prof = searcher.costs.profile()
    assert prof["max"] == dms.count(model, x)["macs"] == searcher.supernet_cost
    assert 0 < prof["min"] < 0.1 * prof["max"]
    dms.detach(model)
    absolute = dms.prepare(model, x, dms.SearchConfig(target=3_000_000.0))
    assert absolute.target_cost == 3_000_000.0


def test_schedule_matches_eq10_and_constant():
    model, x = _resnet20()
    searcher = dms.prepare(model, x, dms.SearchConfig(target=0.25, settle=0.0))
    rs, rf = searcher.supernet_cost, searcher.target_cost
    assert rf == pytest.approx(0.25 * rs)
    for p in (0.0, 0.1, 0.5, 0.9, 1.0):
        assert searcher.budget.target_at(p) == pytest.approx((rf / rs) ** p * rs)
    assert searcher.budget.target_at(2.0) == pytest.approx(rf)  # clamped progress
    searcher.config.schedule = "constant"
    assert searcher.budget.target_at(0.0) == pytest.approx(rf)


def test_schedule_end_decays_then_holds_and_default_is_eq10():
    model, x = _resnet20()
    searcher = dms.prepare(model, x, dms.SearchConfig(target=0.25, settle=0.0))
    assert searcher.config.schedule_end == 1.0
    rs, rf = searcher.supernet_cost, searcher.target_cost
    eq10 = [searcher.budget.target_at(p) for p in (0.0, 0.3, 0.6, 1.0)]
    searcher.config.schedule_end = 0.6
    assert searcher.budget.target_at(0.0) == pytest.approx(rs)
    assert searcher.budget.target_at(0.3) == pytest.approx((rf / rs) ** 0.5 * rs)  # halfway through the decay
    for p in (0.6, 0.8, 1.0, 2.0):
        assert searcher.budget.target_at(p) == pytest.approx(rf)  # held at the final target
    assert searcher.budget.target_at(0.3) < eq10[1]  # a shorter decay is ahead of Eq. 10
    searcher.config.schedule_end = 1.0
    assert [searcher.budget.target_at(p) for p in (0.0, 0.3, 0.6, 1.0)] == eq10


def test_state_saved_before_schedule_end_existed_resumes_and_another_end_is_refused():
    model, x = _resnet20()
    searcher = dms.prepare(model, x, dms.SearchConfig(target=0.5))
    state = searcher.state_dict()
    del state["config"]["schedule_end"]  # a checkpoint from before the option: Eq. 10 over the whole search
    searcher.load_state_dict(state)
    other = dms.prepare(_resnet20()[0], x, dms.SearchConfig(target=0.5, schedule_end=0.6))
    with pytest.raises(ValueError, match="searcher config differs"):
        other.load_state_dict(state)


def test_resource_loss_eq6_and_it_does_not_feed_importance():
    model, x = _resnet20()
    searcher = dms.prepare(model, x, dms.SearchConfig(target=0.5, resource_weight=2.0, settle=0.0))
    model.train()
    r_c = float(searcher.costs.soft().detach())
    loss = searcher.resource_loss(progress=1.0)
    assert float(loss) == pytest.approx(2.0 * math.log(r_c / searcher.target_cost), rel=1e-5)
    loss.backward()
    grads = [t.ratio_grad for t in _all_topks(searcher)]
    assert all(g is not None and float(g) < 0 for g in grads), "loss must push every a up"
    importance = [t.importance.clone() for t in searcher.gates.width]
    assert all(float(c.abs().sum()) == 0 for c in importance)  # the resource loss fed nothing
    assert float(searcher.resource_loss(progress=0.0)) == 0.0  # r_t = supernet cost at start


def test_exact_cost_forward_is_the_hard_cost_with_the_soft_gradient():
    model, x = _resnet20()
    soft = dms.prepare(model, x, dms.SearchConfig(target=0.5, settle=0.0))
    with torch.no_grad():
        for p in soft.structure_parameters():
            p.fill_(0.1)  # soft and hard cost differ, both above the target
    res = soft.resources()
    assert abs(res["soft"] - res["hard"]) > 0.01 * res["hard"]
    assert min(res["soft"], res["hard"]) > res["target"]
    soft_loss = soft.resource_loss(progress=1.0)
    soft_loss.backward()
    soft_grads = [float(t.ratio_grad) for t in _all_topks(soft)]
    dms.detach(model)

    exact = dms.prepare(model, x, dms.SearchConfig(target=0.5, cost_forward="exact", settle=0.0))
    with torch.no_grad():
        for p in exact.structure_parameters():
            p.fill_(0.1)
    loss = exact.resource_loss(progress=1.0)
    assert float(loss) == pytest.approx(math.log(res["hard"] / exact.target_cost), rel=1e-5)
    loss.backward()
    # d log(r_c) = d soft / r_c: the soft gradient, scaled by soft / hard
    scale = res["soft"] / res["hard"]
    for g_soft, t in zip(soft_grads, _all_topks(exact)):
        assert float(t.ratio_grad) == pytest.approx(g_soft * scale, rel=1e-4)


def test_soft_cost_differentiable_in_every_structural_parameter():
    model, x = _resnet20()
    for resource in ("macs", "params"):
        searcher = dms.prepare(model, x, dms.SearchConfig(resource=resource, target=0.5))
        searcher.costs.soft().backward()
        for t in _all_topks(searcher):
            assert t.ratio_grad is not None and float(t.ratio_grad) != 0
        dms.detach(model)


def test_width_only_phase_freezes_depth():
    model, x = _resnet20()
    searcher = dms.prepare(model, x, dms.SearchConfig(target=0.5, width_only_from=0.5))
    searcher.resource_loss(progress=0.6).backward()
    assert all(t.ratio_grad is None for t in searcher.gates.depth)
    assert all(t.ratio_grad is not None for t in searcher.gates.width)
    searcher.resource_loss(progress=0.1)
    assert all(t.a.requires_grad for t in searcher.gates.depth)


def test_meet_target_lands_just_under_the_target():
    model, x = _resnet20()
    searcher = dms.prepare(model, x, dms.SearchConfig(target=0.4))
    searcher.randomize_importance(0)  # an untrained search has none: export() would refuse
    res = searcher.meet_target()
    exact = dms.count(searcher.export(), x)["macs"]
    assert exact == round(res["hard"]) <= searcher.target_cost
    assert exact >= 0.98 * searcher.target_cost


def _search_steps(model, searcher, opt, data, steps, start=0, total=20):
    model.train()
    for step in range(start, start + steps):
        x, y = data[step % len(data)]
        loss = nn.functional.cross_entropy(model(x), y) + searcher.resource_loss(progress=step / total)
        opt.zero_grad()
        loss.backward()
        opt.step()


def _fresh(seed=0):
    torch.manual_seed(seed)
    model = SmallCNN(width=8)
    x = torch.randn(2, 1, 28, 28)
    searcher = dms.prepare(model, x, dms.SearchConfig(target=0.4))
    opt = torch.optim.SGD([
        {"params": list(searcher.model_parameters()), "lr": 0.05, "momentum": 0.9},
        {"params": list(searcher.structure_parameters()), "lr": 0.05, "momentum": 0.9},
    ])
    return model, searcher, opt


def test_state_dict_round_trip_resumes_to_the_same_structure():
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(16, 1, 28, 28, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(5)]
    model, searcher, opt = _fresh()
    _search_steps(model, searcher, opt, data, 20)
    expected = searcher.structure()
    # same search, interrupted after 8 steps and resumed in a new process-like setup
    model, searcher, opt = _fresh()
    _search_steps(model, searcher, opt, data, 8)
    saved = {"model": {k: v.clone() for k, v in model.state_dict().items()},
             "search": searcher.state_dict(), "opt": opt.state_dict()}
    model2, searcher2, opt2 = _fresh(seed=123)  # different init: everything comes from the state
    model2.load_state_dict(saved["model"])
    searcher2.load_state_dict(saved["search"])
    opt2.load_state_dict(saved["opt"])
    _search_steps(model2, searcher2, opt2, data, 12, start=8)
    assert searcher2.structure()["layers"] == expected["layers"]
    assert searcher2.structure()["removed_blocks"] == expected["removed_blocks"]


# ----------------------------------------------------------------------------- issue 8


def test_width_step_and_min_width_do_not_group_attention_heads():
    """Defect 5: coarse steps are for channels; heads keep their own unit."""
    dms.ensure_torchvision()
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=4, head_dim=16)
    model = transformers.LlamaForCausalLM(config).eval()
    x = {"input_ids": torch.randint(0, 64, (1, 8))}
    searcher = dms.prepare(model, x, dms.SearchConfig(resource="params", target=0.7,
                                                      width_step=32, min_width=8))
    by_name = dict(zip([d.name for d in searcher.space.width], searcher.gates.width))
    heads = by_name["model.layers.0.self_attn.heads"]
    assert (heads.step, heads.n_units, heads.min_units) == (1, 4, 1)
    ffn = by_name["model.layers.0.mlp.gate_proj"]
    assert (ffn.step, ffn.n_units) == (32, 4)


def test_profile_min_counts_the_short_last_unit():
    """Defect 7: a width of 10 in steps of 4 can keep just its last 2 channels."""
    net = nn.Sequential(nn.Linear(4, 10), nn.ReLU(), nn.Linear(10, 2))
    x = torch.randn(1, 4)
    searcher = dms.prepare(net, x, dms.SearchConfig(resource="macs", target=0.9, width_step=4))
    topk = searcher.gates.width[0]
    with torch.no_grad():
        topk.importance.copy_(torch.tensor([0.0, 0.0, 1.0]))  # the short last unit ranks first
        topk.set_count(1)
    assert searcher.resources()["hard"] == 4 * 2 + 2 * 2
    assert searcher.costs.profile()["min"] == 4 * 2 + 2 * 2
    again = dms.prepare(nn.Sequential(nn.Linear(4, 10), nn.ReLU(), nn.Linear(10, 2)), x,
                        dms.SearchConfig(resource="macs", target=12.0, width_step=4))
    assert again.target_cost == pytest.approx(12.0)


def test_state_saved_before_an_option_existed_loads_and_a_changed_option_is_named():
    """A searcher state written by an older dmscale lacks the newer SearchConfig fields: they
    take their defaults (a resume across versions works); a field that really differs is
    named in the error."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(2, 8)
    state = dms.prepare(net, x, dms.SearchConfig(target=0.5)).state_dict()
    for newer in ("layer_uniform", "gate_factory", "cost_forward", "width_only_from"):
        state["config"].pop(newer)
    fresh = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    dms.prepare(fresh, x, dms.SearchConfig(target=0.5)).load_state_dict(state)
    other = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with pytest.raises(ValueError, match=r"target: saved 0\.5, now 0\.6"):
        dms.prepare(other, x, dms.SearchConfig(target=0.6)).load_state_dict(state)
