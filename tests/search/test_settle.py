"""The settle phase (SearchConfig.settle): the last part of the search lands on the budget.

Schedule, band loss and learning-rate factor on a real ResNet-20; then the claim itself, on
the pipeline the CLI runs: the resource loss alone ends in [0.98, 1.00] x target, where the
paper's loss to the last step (settle=0) does not on the same seeds.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from zoo import ZOO

import dmscale as dms
from dmscale.config.run_config import RunConfig, load_run_config
from dmscale.run.pipeline import Pipeline


def _prepared(**kwargs):
    entry = ZOO["resnet20"]
    model = entry.build()
    x = torch.randn(2, *entry.input_shape[1:])
    return dms.prepare(model, x, dms.SearchConfig(**kwargs))


@pytest.mark.parametrize(("kwargs", "pattern"), [
    ({"settle": 1.0}, r"settle: expected a number in \[0, 1\), got 1.0"),
    ({"settle": -0.1}, r"settle: expected a number in \[0, 1\), got -0.1"),
    ({"budget_band": (0.99, 0.98)}, r"budget_band must be \(low, high\) with 0 < low <= high <= 1"),
    ({"budget_band": (0.9, 1.1)}, r"budget_band .* got \(0.9, 1.1\)"),
    ({"budget_band": 0.99}, r"budget_band must be \(low, high\)"),
])
def test_settle_config_validation(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        dms.SearchConfig(**kwargs)


def test_schedule_decays_before_the_settle_phase_and_holds_in_it():
    s = _prepared(target=0.25, settle=0.4)
    rs, rf = s.supernet_cost, s.target_cost
    assert s.budget.target_at(0.3) == pytest.approx((rf / rs) ** 0.5 * rs)  # halfway through 0.6 of decay
    for p in (0.6, 0.8, 1.0):
        assert s.budget.target_at(p) == pytest.approx(rf)
        assert s.budget.settling(p)
    assert not s.budget.settling(0.59)
    s.config.schedule_end = 0.3  # the shorter of the two decays wins
    assert s.budget.target_at(0.3) == pytest.approx(rf)


def test_structure_lr_scale_is_one_until_the_target_is_reached_then_a_cosine_to_zero():
    s = _prepared(target=0.5, settle=0.4)
    assert s.resource_loss(progress=0.7).requires_grad  # all open: over the target
    assert s.budget.settled_at is None and not s.gates.depth_frozen
    assert [s.structure_lr_scale(p) for p in (0.0, 0.7, 1.0)] == [1.0, 1.0, 1.0]  # too short: full lr
    _set_all(s, 0.6)
    assert s.resources()["hard"] <= s.target_cost
    s.resource_loss(progress=0.8)  # reached at 0.8: from here depth frozen, lr annealed
    assert s.budget.settled_at == 0.8 and s.gates.depth_frozen
    assert s.structure_lr_scale(0.5) == 1.0 and s.structure_lr_scale(0.8) == pytest.approx(1.0)
    assert s.structure_lr_scale(0.9) == pytest.approx(0.5)
    assert s.structure_lr_scale(1.0) == pytest.approx(0.0, abs=1e-12)
    state = s.state_dict()
    again = _prepared(target=0.5, settle=0.4)
    again.load_state_dict(state)
    assert again.budget.settled_at == 0.8 and again.structure_lr_scale(0.9) == pytest.approx(0.5)
    assert _prepared(target=0.5, settle=0.0).structure_lr_scale(1.0) == 1.0


def _set_all(searcher, value):
    with torch.no_grad():
        for p in searcher.structure_parameters():
            p.fill_(value)


def test_band_loss_is_zero_inside_and_pulls_towards_the_band_from_both_sides():
    s = _prepared(target=0.5, settle=0.4, budget_band=(0.98, 1.0))
    low, high = 0.98 * s.target_cost, s.target_cost
    # above the band: log(hard / high), pushes every width's a up (prune more)
    _set_all(s, 0.0)
    hard = s.resources()["hard"]
    assert hard > high
    loss = s.resource_loss(progress=0.9)
    assert float(loss) == pytest.approx(math.log(hard / high), rel=1e-5)
    loss.backward()
    assert all(float(t.ratio_grad) < 0 for t in s.gates.width)
    assert all(float(t.ratio_grad) < 0 for t in s.gates.depth)  # not at the target yet: depth moves
    assert not s.gates.depth_frozen and s.budget.settled_at is None
    assert s.budget.settle_state.weight == pytest.approx(1.1)  # over the band: the weight grows (dual ascent)
    # below it: log(low / hard), pulls every a down (keep more), where Eq. 6 gives 0
    for p in s.structure_parameters():
        p.grad = None
    _set_all(s, 0.8)
    hard = s.resources()["hard"]
    assert hard < low
    loss = s.resource_loss(progress=0.9)
    assert float(loss) == pytest.approx(1.1 * math.log(low / hard), rel=1e-5)
    assert s.budget.settle_state.weight == pytest.approx(1.1)  # under it: unchanged
    loss.backward()
    grads = [float(t.ratio_grad) for t in s.gates.width]  # 0 for the widths inside removed blocks
    assert all(g >= 0 for g in grads) and sum(g > 0 for g in grads) >= 6
    assert all(t.ratio_grad is None for t in s.gates.depth)  # at the target: depth frozen from here
    assert s.gates.depth_frozen and s.budget.settled_at == 0.9
    assert float(s.resource_loss(progress=0.5)) == 0.0  # before the phase: the hinge of Eq. 6
    # inside: no resource gradient at all
    s.meet_target()
    res = s.resources()
    if low <= res["hard"] <= high:
        assert float(s.resource_loss(progress=0.9)) == 0.0


def test_state_saved_before_settle_existed_resumes_as_it_searched():
    s = _prepared(target=0.5, settle=0.0)
    state = s.state_dict()
    del state["config"]["settle"], state["config"]["budget_band"]
    s.load_state_dict(state)  # such a run searched without the phase: settle 0, the band unused
    with pytest.raises(ValueError, match="settle: saved 0.0, now 0.4"):
        _prepared(target=0.5).load_state_dict(state)


def test_a_run_config_saved_before_settle_existed_loads_with_it_off(tmp_path):
    RunConfig(out=str(tmp_path), name="run").resolved()
    (tmp_path / "config.yaml").write_text("command: search\ntask: digits\n")
    assert load_run_config(tmp_path).settle == 0.0
    assert RunConfig().settle == 0.4
    (tmp_path / "config.yaml").write_text("command: search\ntask: digits\nsettle: 0.4\n")
    assert load_run_config(tmp_path).settle_hold is False  # saved before the hold: the anneal alone
    assert RunConfig().settle_hold is True


def _search_end(settle: float, seed: int, tmp_path, target: float = 0.5,
                hold: bool = True) -> tuple[float, float]:
    cfg = RunConfig(command="search", task="digits", pipeline="np", target=target, settle=settle,
                    settle_hold=hold, epochs=10, retrain_epochs=0, seed=seed, threads=1, quiet=True,
                    out=str(tmp_path / f"s{settle}-{seed}-{target}-{hold}"), name="run")
    summary = Pipeline(cfg.resolved()).run()
    end, final = summary["resources_search_end"], summary["resources"]
    return end["hard"] / end["target"], final["hard"] / final["target"]


@pytest.mark.slow  # four searches (~20 s on 2 cores); bench/results/budget.md measures it over 5 seeds
def test_the_loss_alone_lands_in_the_band_where_eq10_to_the_last_step_does_not(tmp_path):
    """Issue 10, table 6: measured in bench/results/budget.md over 5 seeds x 2 targets. Which
    seeds end outside the band with settle=0 depends on the last bits of the masks, and so on
    the CPU's arithmetic: with the batched masks of issue 29 seeds 1 and 4 end at 0.957 and
    0.962 x on one machine, 0.991 and 0.967 x on another. The settle phase must land both in
    the band; Eq. 10 alone must miss it on at least one, or the test could not fail."""
    olds = []
    for seed in (1, 4):
        end, exported = _search_end(0.4, seed, tmp_path)
        assert 0.98 <= end <= 1.0, f"settle: the search with seed {seed} ended at {end:.4f} x target"
        assert exported == pytest.approx(end)  # nothing post-hoc changed the structure
        olds.append(_search_end(0.0, seed, tmp_path)[0])
    assert not all(0.98 <= old <= 1.0 for old in olds), \
        f"settle=0 ended in the band with seeds 1 and 4 ({olds}): the test cannot fail"


def test_settle_weight_grows_while_over_the_band_and_resumes():
    s = _prepared(target=0.5, settle=0.4, resource_weight=2.0)
    losses = [float(s.resource_loss(progress=p)) for p in (0.7, 0.8, 0.9)]  # all open: over the band
    assert s.budget.settle_state.weight == pytest.approx(2.0 * 1.1 ** 3)
    s.resource_loss(progress=0.9)  # another micro-batch of the same step: no growth
    assert s.budget.settle_state.weight == pytest.approx(2.0 * 1.1 ** 3)
    assert losses[1] == pytest.approx(1.1 * losses[0]) and losses[2] == pytest.approx(1.21 * losses[0])
    again = _prepared(target=0.5, settle=0.4, resource_weight=2.0)
    again.load_state_dict(s.state_dict())
    assert again.budget.settle_state.weight == pytest.approx(s.budget.settle_state.weight)
    soft = float(s.costs.soft().detach())  # before the phase: Eq. 6 with the configured weight
    assert float(s.resource_loss(progress=0.5)) == pytest.approx(2.0 * math.log(soft / s.budget.target_at(0.5)), rel=1e-5)


def test_settle_hold_stops_the_ratios_inside_the_band():
    """Landed and inside the band: lr factor 0, so Adam leaves every ratio where it is, however
    hard the task loss pulls; outside the band (or with settle_hold=False) the cosine."""
    s = _prepared(target=0.5, settle=0.4)
    _set_all(s, 0.6)
    s.resource_loss(progress=0.8)  # landed at 0.8
    s.meet_target()  # the largest structure not over the target: inside [0.98, 1.00]
    assert s.budget.in_band() and s.structure_lr_scale(0.9) == 0.0
    opt = torch.optim.Adam(list(s.structure_parameters()), lr=0.05)
    before = [p.detach().clone() for p in s.structure_parameters()]
    for _ in range(5):
        for group in opt.param_groups:
            group["lr"] = 0.05 * s.structure_lr_scale(0.9)
        opt.zero_grad()
        sum(p.sum() for p in s.structure_parameters()).backward()  # a pull on every ratio
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, s.structure_parameters()))
    assert s.budget.in_band()
    _set_all(s, 0.0)  # everything kept: over the band, the cosine again
    assert not s.budget.in_band() and s.structure_lr_scale(0.9) == pytest.approx(0.5)
    off = _prepared(target=0.5, settle=0.4, settle_hold=False)
    _set_all(off, 0.6)
    off.resource_loss(progress=0.8)
    off.meet_target()
    assert off.budget.in_band() and off.structure_lr_scale(0.9) == pytest.approx(0.5)


@pytest.mark.slow  # a search per candidate seed (~11 s on 2 cores)
def test_settle_hold_lands_runs_the_anneal_alone_leaves_over_the_band(tmp_path):
    """Issue 10, table 6 at width 8 and 0.25 x MACs: the anneal alone can end a search just over
    the band (it keeps pulling after the structure entered it); holding the structure once inside
    lands it. Which seeds the anneal alone leaves over depends on the last bits of the mask
    gradients, and so on the CPU's arithmetic: seeds 6 and 7 at 1.006 and 1.010 x target on one
    machine (the hold: 0.995 and 0.991 x), seeds 4 and 11 at 1.0004 and 1.007 x on another (the
    hold: 0.990 and 0.980 x). The first candidate that the anneal alone leaves over the band must
    land with the hold; one must be left over, or the test could not fail."""
    for seed in (4, 6, 7, 11):
        old, _ = _search_end(0.4, seed, tmp_path, target=0.25, hold=False)
        if old > 1.0 + 1e-9:
            end, exported = _search_end(0.4, seed, tmp_path, target=0.25)
            assert 0.98 <= end <= 1.0, \
                f"settle_hold: seed {seed} ended at {end:.4f} x target (the anneal alone: {old:.4f})"
            assert exported == pytest.approx(end)
            return
    pytest.fail("the anneal alone ended every candidate seed in or under the band: the test cannot fail")


def test_settle_hold_validation_and_older_states():
    with pytest.raises(ValueError, match="settle_hold: expected true or false, got 'maybe'"):
        dms.SearchConfig(settle_hold="maybe")
    assert dms.SearchConfig(settle_hold="no").settle_hold is False  # as a config file's value
    s = _prepared(target=0.5, settle=0.4, settle_hold=False)
    state = s.state_dict()
    del state["config"]["settle_hold"]  # saved before the option: the anneal alone, as it searched
    s.load_state_dict(state)
    with pytest.raises(ValueError, match="settle_hold: saved False, now True"):
        _prepared(target=0.5, settle=0.4).load_state_dict(state)
    old = _prepared(target=0.5, settle=0.0, settle_hold=False).state_dict()
    del old["config"]["settle_hold"]
    _prepared(target=0.5, settle=0.0).load_state_dict(old)  # no settle phase: the hold never acts, no refusal


def test_budget_band_from_the_cli_sets_where_the_search_lands_and_the_solver_fills(tmp_path):
    """``--budget-band 0.9,1.0``: the settle phase lands the search in 0.90-1.00 x target and
    the solver leaves a model over 0.90 x alone; at the default band (0.98, 1.0) this run
    (seed 0, 0.25 x MACs) exports at >= 0.98 x, so a band that did not reach the search fails."""
    from dmscale.cli import main
    out = tmp_path / "wide"
    assert main(["search", "--task", "digits", "--pipeline", "np", "--target", "0.25", "--epochs", "10",
                 "--retrain-epochs", "0", "--seed", "0", "--threads", "1", "--quiet", "--out", str(out),
                 "--budget-band", "0.9,1.0"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    end, final = (summary[k]["hard"] / summary[k]["target"] for k in ("resources_search_end", "resources"))
    assert 0.9 <= end < 0.98, f"the search ended at {end:.4f} x target"
    assert final == pytest.approx(end)  # nothing post-hoc: over the band's low end, the solver keeps it
    assert tuple(load_run_config(out).budget_band) == (0.9, 1.0)
    _, exported = _search_end(0.4, 0, tmp_path, target=0.25)
    assert exported >= 0.98


@pytest.mark.parametrize("bad", ["0.99", "0.9,1.1", "1.0,0.9", "a,b"])
def test_budget_band_refuses_what_is_not_two_fractions_in_order(bad):
    from dmscale.cli import main
    with pytest.raises(SystemExit):
        main(["search", "--task", "digits", "--budget-band", bad, "--quiet"])


def test_a_settle_step_reads_the_device_twice_at_most():
    """The settle phase's decisions are the only host reads of a step: whether the exact cost
    reached the target (until it has) and where the cost is against the band; the exact cost
    itself, its straight-through term and the hard masks stay on the device (23 reads before)."""
    from torch.profiler import ProfilerActivity, profile

    entry = ZOO["resnet20"]
    model = entry.build()
    x = torch.randn(4, *entry.input_shape[1:])
    searcher = dms.prepare(model, x[:2], dms.SearchConfig(target=0.5, settle=0.3))
    for progress in (0.1, 0.8):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            loss = model(x).logsumexp(1).mean() + searcher.resource_loss(progress)
            loss.backward()
        reads = sum(e.name == "aten::_local_scalar_dense" for e in prof.events())
        assert reads == (0 if progress < 0.7 else 2), (progress, reads)
