"""Several budgets at once (``SearchConfig(targets={...})``): each its own resource loss term,
every one met by the settle phase and the budget solver, carried by ``state_dict``; the
single-budget form unchanged."""

from __future__ import annotations

import math

import pytest
import torch

import dmscale as dms
from dmscale.core.errors import ConfigError
from dmscale.search.config_state import config_state


def _llama(seed: int = 0):
    dms.ensure_torchvision()
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, head_dim=8, tie_word_embeddings=False))


def _search(model, x, searcher, steps: int = 40, lr: float = 0.05) -> None:
    opt = torch.optim.Adam([{"params": list(searcher.model_parameters()), "lr": 1e-3},
                            {"params": list(searcher.structure_parameters()), "lr": lr}])
    for step in range(steps):
        progress = step / steps
        loss = model(input_ids=x, labels=x).loss + searcher.resource_loss(progress)
        opt.zero_grad()
        loss.backward()
        opt.param_groups[1]["lr"] = lr * searcher.structure_lr_scale(progress)
        opt.step()


@pytest.mark.parametrize("seed", [0, 3])
def test_two_budgets_on_a_small_llama_both_land_in_the_band(seed):
    model = _llama(seed)
    x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(seed))
    searcher = dms.prepare(model, x, dms.SearchConfig(targets={"params": 0.7, "kv_cache": 0.5}))
    _search(model, x, searcher)
    res = searcher.meet_target()
    assert list(res["budgets"]) == ["params", "kv_cache"] and res["resource"] == "params"
    small = searcher.export()
    counts = dms.count(small, x)
    for name, b in res["budgets"].items():
        assert b["target"] == pytest.approx({"params": 0.7, "kv_cache": 0.5}[name] * b["supernet"])
        assert 0.98 * b["target"] <= b["hard"] <= b["target"], (name, b["hard"] / b["target"])
        assert counts[name] == round(b["hard"])  # the export costs what the solver measured
    assert searcher.budget.within() and searcher.budget.fills()


def test_each_budget_has_its_own_loss_term():
    model = _llama()
    x = torch.randint(0, 64, (2, 8))
    both = dms.prepare(model, x, dms.SearchConfig(targets={"params": 0.7, "kv_cache": 0.5}, settle=0.0,
                                                   cost_forward="exact"))
    # all open (r_c the exact cost), at the end of the schedule: each term is log(supernet / target)
    assert float(both.resource_loss(1.0).detach()) == pytest.approx(math.log(1 / 0.7) + math.log(1 / 0.5), rel=1e-5)
    assert both.budget.target_at(0.0, "kv_cache") == both.budget.supernet_costs["kv_cache"]
    assert both.budget.target_at(1.0, "kv_cache") == pytest.approx(both.budget.target_costs["kv_cache"])
    dms.detach(model)
    one = dms.prepare(model, x, dms.SearchConfig("params", 0.7, settle=0.0, cost_forward="exact"))
    assert float(one.resource_loss(1.0).detach()) == pytest.approx(math.log(1 / 0.7), rel=1e-5)


def test_the_solver_meets_every_budget_even_from_far_off():
    model = _llama()
    x = torch.randint(0, 64, (2, 8))
    searcher = dms.prepare(model, x, dms.SearchConfig(targets={"kv_cache": 0.25, "params": 0.6},
                                                      importance="index"))
    res = searcher.meet_target()  # from every width and layer kept
    for name, b in res["budgets"].items():
        assert 0.98 * b["target"] <= b["hard"] <= b["target"], (name, b["hard"] / b["target"])


def test_state_dict_carries_every_budget_and_a_single_budget_state_is_unchanged():
    model = _llama()
    x = torch.randint(0, 64, (2, 8))
    cfg = dms.SearchConfig(targets={"params": 0.7, "kv_cache": 0.5})
    a = dms.prepare(model, x, cfg)
    a.budget.settle_states["kv_cache"].weight = 7.0
    a.budget.target_costs["kv_cache"] = 123.0
    state = a.state_dict()
    assert set(state["budgets"]) == {"params", "kv_cache"} and state["config"]["targets"] == cfg.targets
    dms.detach(model)
    b = dms.prepare(model, x, cfg)
    b.load_state_dict(state)
    assert b.budget.settle_states["kv_cache"].weight == 7.0 and b.budget.target_costs["kv_cache"] == 123.0
    assert b.target_cost == a.target_cost
    dms.detach(model)
    with pytest.raises(ValueError, match="targets"):  # a resume with other budgets is refused
        dms.prepare(model, x, dms.SearchConfig("params", 0.7)).load_state_dict(state)
    dms.detach(model)
    single = dms.prepare(model, x, dms.SearchConfig("params", 0.7)).state_dict()
    assert "budgets" not in single and "targets" not in single["config"]
    assert "targets" not in config_state(dms.SearchConfig("params", 0.7))


@pytest.mark.parametrize("kwargs, needle", [
    ({"targets": {"flops": 0.5}}, "unknown resource 'flops'"),
    ({"targets": {"params": 0.0}}, r"the target of params must be a number > 0 \(finite"),
    ({"targets": {"params": -2}}, r"the target of params must be a number > 0 \(finite"),
    ({"resource": "kv_cache", "targets": {"params": 0.5}}, "'kv_cache' is not among the budgets"),
    ({"targets": {"params": 0.5, "latency": 0.5}, "depth_unit": "sublayer"}, "depth_unit='sublayer' with resource='latency'"),
    ({"targets": {}}, "non-empty dict"),
    ({"resource": "kv_cache", "target": 0.3, "targets": {"params": 0.5}}, "not both"),
    ({"resource": "tokens"}, "unknown resource 'tokens'"),
])
def test_bad_budgets_are_refused_by_name(kwargs, needle):
    with pytest.raises(ConfigError, match=needle):
        dms.SearchConfig(**kwargs)
