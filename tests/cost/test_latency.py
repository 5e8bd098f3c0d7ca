"""The latency constraint (paper App. A.1.2, Eq. 9): dmscale.cost.latency.LatencyCostModel.

Timing on a shared 2-core machine is noisy, so no test compares two measured times. What is
checked instead:

* the fitting maths on synthetic data (exact recovery, the monotone refit, the anchor);
* the whole pipeline (grid slicing, inputs, fit, keep ratios, depth, the constant) with a
  deterministic timer whose "latency" is the FLOP count: then the predicted latency of a hard
  structure must equal that of the exported model exactly;
* on a real profile of resnet20: F(1, 1) = 1, monotone predictions, gradients for every
  structural parameter through ``dms.prepare(..., resource="latency")``, resource_loss, and a
  profile that round-trips through ``state_dict``.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import dmscale as dms
import dmscale.cost.latency_profile as latency_profile
import dmscale.cost.polyfit as polyfit
from dmscale.trace.discover import discover
from dmscale.cost.latency import LatencyCostModel, fit_monotone_poly, measure_latency
from zoo import ZOO


def _grid(n: int = 6) -> np.ndarray:
    r = np.linspace(0.25, 1.0, n)
    return np.array([[a, b] for a in r for b in r])


# ------------------------------------------------------------------------------ fitting maths


def test_fit_recovers_an_anchored_quadratic_exactly() -> None:
    x = _grid(4)
    c_true = np.array([0.05, 0.1, 0.2, 0.3, 0.15, 0.2])  # sums to 1: F(1, 1) = 1
    ki, ko = x[:, 0], x[:, 1]
    y = c_true[0] + c_true[1] * ki + c_true[2] * ko + c_true[3] * ki * ko + c_true[4] * ki**2 + c_true[5] * ko**2
    exps, coef, constrained = fit_monotone_poly(x, y, [2, 2])
    assert exps == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (0, 2)]
    assert not constrained
    np.testing.assert_allclose(coef, c_true, atol=1e-9)


def test_fit_is_anchored_at_full_width_even_when_the_data_is_not() -> None:
    x = np.array([[0.25], [0.5], [0.75], [1.0]])
    y = np.array([0.5, 0.7, 0.9, 1.3])  # a noisy "full" point
    exps, coef, _ = fit_monotone_poly(x, y, [2])
    assert coef.sum() == pytest.approx(1.0, abs=1e-9)
    _, free, _ = fit_monotone_poly(x, y, [2], anchor=False)
    assert free.sum() != pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize("y", [
    [1.4, 0.8, 0.9, 1.0],          # decreasing at the small end (noise)
    [0.2, 1.3, 0.6, 1.0],          # zig-zag
    [1.0, 1.0, 1.0, 1.0],          # flat (overhead-bound layer)
    [0.9, 0.95, 1.2, 1.0],         # overshoot before full width
])
def test_fit_is_monotone_and_nonnegative_in_one_variable(y: list[float]) -> None:
    x = np.array([[0.25], [0.5], [0.75], [1.0]])
    exps, coef, _ = fit_monotone_poly(x, np.array(y), [2])
    k = np.linspace(0, 1, 201)[:, None]
    f = polyfit._basis(exps, k) @ coef
    assert np.all(np.diff(f) >= -1e-9)
    assert f[0] >= -1e-9
    assert f[-1] == pytest.approx(1.0, abs=1e-7)


def test_fit_is_monotone_in_two_variables_on_noisy_data() -> None:
    rng = np.random.default_rng(0)
    x = _grid(4)
    for _ in range(20):
        y = x[:, 0] * x[:, 1] + rng.normal(0, 0.3, len(x))
        exps, coef, _ = fit_monotone_poly(x, y, [2, 2])
        r = np.linspace(0, 1, 21)
        f = (polyfit._basis(exps, np.array([[a, b] for a in r for b in r])) @ coef).reshape(21, 21)
        assert np.all(np.diff(f, axis=0) >= -1e-7) and np.all(np.diff(f, axis=1) >= -1e-7)
        assert f[0, 0] >= -1e-7 and f[-1, -1] == pytest.approx(1.0, abs=1e-6)


def test_measure_latency_is_positive_and_validates() -> None:
    assert measure_latency(torch.nn.Linear(4, 4), torch.randn(1, 4), repeats=3) > 0
    with pytest.raises(ValueError, match="quantile"):
        measure_latency(torch.nn.Linear(4, 4), torch.randn(1, 4), quantile=2.0)


def test_bad_arguments_are_clear_errors() -> None:
    net = ZOO["small_cnn"].build()
    x = torch.randn(*ZOO["small_cnn"].input_shape)
    space = discover(net, x)
    with pytest.raises(ValueError, match="ratios"):
        LatencyCostModel(net, space, x, ratios=(0.0, 1.0))
    with pytest.raises(ValueError, match="format"):
        LatencyCostModel(net, space, x, profile={"layers": {}})


# ------------------------------------------------------------------------------ deterministic timer


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Profile with 1 thread: on a busy 2-core machine, 2-thread timings are erratic."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class _FlopTimer:
    """A fake clock for ``latency_profile._time_block``: a FLOP takes 0.1 ns, nothing else takes time."""

    def __init__(self) -> None:
        self.cache: dict[int, tuple[object, float]] = {}

    def __call__(self, fn, n, device) -> float:  # noqa: ANN001 - mirrors latency_profile._time_block
        hit = self.cache.get(id(fn))
        if hit is not None and hit[0] is fn:
            return hit[1]
        with FlopCounterMode(display=False) as counter:
            fn()
        t = counter.get_total_flops() * 1e-10
        self.cache[id(fn)] = (fn, t)
        return t


@pytest.mark.parametrize("name", ["small_cnn", "resnet20"])
def test_prediction_is_exact_when_latency_is_proportional_to_flops(name: str, monkeypatch) -> None:
    monkeypatch.setattr(latency_profile, "_time_block", _FlopTimer())
    entry = ZOO[name]
    net = entry.build()
    x = torch.randn(*entry.input_shape)
    # untrained: channels kept by position (only the counts matter to the cost)
    searcher = dms.prepare(net, x, dms.SearchConfig(resource="macs", target=0.5, importance="index"))
    cost = LatencyCostModel(net, searcher.space, x, repeats=1, warmup=0)
    report = cost.fit_report()
    assert report["constant_us"] == pytest.approx(0.0, abs=1e-6)
    assert report["fit_rmse_rel"] < 1e-6
    flops_us = lambda m: 2 * dms.count(m, x)["macs"] * 1e-10 * 1e6  # noqa: E731
    with torch.no_grad():
        assert float(cost(*searcher.costs.masks("open"))) == pytest.approx(flops_us(net), rel=1e-6)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        with torch.no_grad():
            for t in list(searcher.gates.width) + list(searcher.gates.depth):
                t.a.fill_(float(torch.rand((), generator=gen)) * t.max_ratio)
            predicted = float(cost(*searcher.costs.masks("hard")))
        assert predicted == pytest.approx(flops_us(searcher.export()), rel=1e-6)
    dms.detach(net)


def test_a_layer_that_cannot_run_alone_is_skipped_and_its_time_kept(monkeypatch) -> None:
    from dmscale.trace.handlers.base import HANDLERS_BY_NAME

    def refuse(m, in_keep, out_keep):  # noqa: ANN001
        raise RuntimeError("cannot slice this layer")

    monkeypatch.setattr(latency_profile, "_time_block", _FlopTimer())
    monkeypatch.setattr(HANDLERS_BY_NAME["linear"], "prune", refuse)
    entry = ZOO["small_cnn"]
    net = entry.build()
    x = torch.randn(*entry.input_shape)
    space = discover(net, x)
    with pytest.warns(UserWarning, match="not profiled"):
        cost = LatencyCostModel(net, space, x, repeats=1)
    report = cost.fit_report()
    assert set(report["skipped"]) == {"fc1", "fc2"}
    assert "fc1" not in report["layers"] and "stem.0" in report["layers"]
    fc_us = 2 * (net.fc1.weight.numel() + net.fc2.weight.numel()) * 1e-10 * 1e6
    assert report["constant_us"] == pytest.approx(fc_us, rel=1e-6)  # timed in the rest
    ones = torch.ones(space.n_slots + 1)
    depth = torch.ones(sum(len(d.blocks) for d in space.depth))
    model_us = 2 * dms.count(net, x)["macs"] * 1e-10 * 1e6
    assert float(cost(ones, depth)) == pytest.approx(model_us, rel=1e-6)


# ------------------------------------------------------------------------------ a real profile


@pytest.fixture(scope="module")
def prepared():
    """resnet20 at 32x32 prepared for a latency search (profiled once), and its outputs
    (eval mode) before and after prepare."""
    entry = ZOO["resnet20"]
    net = entry.build()
    x = torch.randn(*entry.input_shape)
    net.eval()
    with torch.no_grad():
        before = net(x)
    net.train()
    searcher = dms.prepare(net, x, dms.SearchConfig(resource="latency", target=0.6))
    training = net.training
    net.eval()
    with searcher.gates.use(enabled=False), torch.no_grad():
        after = net(x)
    net.train()
    yield net, x, searcher, (training, before, after)


def test_profile_report(prepared) -> None:
    net, x, searcher, _ = prepared
    report = searcher.costs.model_of().fit_report()
    assert report["unit"] == "us" and report["device"] == "cpu"
    assert report["profile_s"] < 60
    convs = [n for n, m in net.named_modules() if isinstance(m, torch.nn.Conv2d)]
    assert set(convs) <= set(report["layers"])  # every conv is searchable in resnet20
    assert report["layers"]["fc"]["sides"] == ["in"]
    assert report["layers"]["conv1"]["sides"] == ["out"]
    assert report["layers"]["layer1.0.conv1"]["sides"] == ["in", "out"]
    for name, layer in report["layers"].items():
        assert layer["latency_full_us"] > 0
        assert abs(layer["f_full"] - 1.0) < 0.15, name
        assert np.isfinite(layer["rmse_rel"])
    assert np.isfinite(report["fit_rmse_rel"])
    parts = report["layers_latency_us"] + report["blocks_inner_us"] + report["constant_us"]
    assert parts == pytest.approx(report["parts_full_us"])
    assert report["calibration"] > 0
    # calibrated: the supernet costs its timed latency
    assert report["predicted_full_us"] == pytest.approx(report["calibration"] * parts)
    assert report["predicted_full_us"] == pytest.approx(report["model_latency_us"], rel=1e-9)
    assert searcher.supernet_cost == pytest.approx(report["predicted_full_us"], rel=1e-9)


def test_layer_fits_are_monotone_on_a_grid(prepared) -> None:
    _, _, searcher, _ = prepared
    cost = searcher.costs.model_of()
    r = np.linspace(0.0, 1.0, 11)
    for name, fit in cost.fits.items():
        if len(fit.sides) == 2:
            f = fit(np.array([[a, b] for a in r for b in r])).reshape(11, 11)
            assert np.all(np.diff(f, axis=0) >= -1e-7) and np.all(np.diff(f, axis=1) >= -1e-7), name
        else:
            assert np.all(np.diff(fit(r[:, None])) >= -1e-7), name
        assert cost.predict_layer(name) == pytest.approx(fit.latency_full, rel=1e-6)


def test_total_cost_grows_with_width_and_depth(prepared) -> None:
    _, _, searcher, _ = prepared
    cost = searcher.costs.model_of()
    n_slots, n_blocks = searcher.space.n_slots, sum(len(d.blocks) for d in searcher.space.depth)
    values = []
    with torch.no_grad():
        for keep in np.linspace(0.05, 1.0, 12):
            w = torch.full((n_slots + 1,), float(keep))
            w[-1] = 1.0
            values.append([float(cost(w, torch.full((n_blocks,), float(d)))) for d in (0.0, 0.5, 1.0)])
    values = np.array(values)
    assert np.all(np.diff(values, axis=0) >= -1e-6)  # wider never costs less
    assert np.all(np.diff(values, axis=1) >= -1e-6)  # deeper never costs less
    assert values[0, 0] < values[-1, -1]
    profile = searcher.costs.profile()
    assert profile["min"] < 0.6 * profile["max"] <= profile["max"]


def test_soft_cost_is_differentiable_in_every_structural_parameter(prepared) -> None:
    net, x, searcher, _ = prepared
    params = list(searcher.structure_parameters())
    for p in params:
        p.grad = None
    r_c = searcher.costs.soft()
    assert r_c.dtype == torch.float64 and r_c.requires_grad
    r_c.backward()
    for p in params:
        assert p.grad is not None and torch.isfinite(p.grad).all()
    # raising a (pruning more) never makes the model slower
    assert all(bool((p.grad <= 1e-9).all()) for p in params)
    assert any(bool((p.grad < 0).any()) for p in params)


def test_resource_loss_with_latency(prepared) -> None:
    net, x, searcher, _ = prepared
    assert searcher.resource_loss(progress=0.0).item() == pytest.approx(0.0, abs=1e-6)
    loss = net(x).pow(2).mean() + searcher.resource_loss(progress=1.0)
    assert torch.isfinite(loss)
    params = list(searcher.structure_parameters())
    for p in params:
        p.grad = None
    searcher.resource_loss(progress=0.5).backward()  # r_c = supernet > r_t: log(r_c / r_t) > 0
    assert all(p.grad is not None for p in params)
    for p in params:
        p.grad = None
    searcher.resource_loss(progress=1.0).backward()  # settle phase: the band loss on the exact latency
    assert all(float(t.ratio_grad) <= 0 for t in searcher.gates.width) and searcher.budget.settled_at is None
    searcher.freeze_depth(False)
    res = searcher.resources()
    assert res["resource"] == "latency" and res["target"] == pytest.approx(0.6 * res["supernet"])


def test_profiling_leaves_the_model_alone(prepared) -> None:
    net, x, searcher, (training, before, after) = prepared
    assert training  # the training flag is the user's
    assert hasattr(net, "dms_gates")  # hooks and gates still attached
    torch.testing.assert_close(after, before)  # weights and BN statistics untouched


def test_profile_round_trips_through_state_dict(prepared) -> None:
    net, x, searcher, _ = prepared
    cost = searcher.costs.model_of()
    state = json.loads(json.dumps(cost.state_dict()))  # JSON-able: can be saved with a search
    again = LatencyCostModel(net, searcher.space, x, profile=state)
    with torch.no_grad():
        for kind in ("open", "hard", "min"):
            w, d = searcher.costs.masks(kind)
            assert float(again(w, d)) == float(cost(w, d))
    assert again.fit_report()["layers"] == cost.fit_report()["layers"]
    bad = copy.deepcopy(cost.state_dict())
    bad["layers"]["no.such.layer"] = bad["layers"]["fc"]
    with pytest.raises(ValueError, match="no.such.layer"):
        LatencyCostModel(net, searcher.space, x, profile=bad)


# ------------------------------------------------------------------------------ transformers


def test_gpt2_attention_children_are_profiled_and_every_dim_gets_a_gradient() -> None:
    pytest.importorskip("transformers")
    from transformer_zoo import TZOO

    entry = TZOO["hf_gpt2"]
    net = entry.build()
    x = entry.make_inputs()
    searcher = dms.prepare(net, x, dms.SearchConfig(resource="params", target=0.5))
    cost = LatencyCostModel(net, searcher.space, x, budget_s=2.0)
    report = cost.fit_report()
    assert not report["skipped"]
    assert {"transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj",
            "transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj"} <= set(report["layers"])
    assert not any(n.endswith(".core") for n in report["layers"])  # virtual: in the rest
    assert set(report["blocks"]) == {"transformer.h.0", "transformer.h.1", "transformer.h.2"}
    w, d = searcher.costs.masks("soft")
    cost(w, d).backward()
    for p in searcher.structure_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all()
    dms.detach(net)


def test_searcher_state_dict_carries_the_latency_profile(prepared) -> None:
    """A resumed latency search keeps the measured cost scale instead of re-profiling."""
    _, x, searcher, _ = prepared
    state = searcher.state_dict()
    assert "latency_profile" in state
    model2 = ZOO["resnet20"].build().eval()
    resumed = dms.prepare(model2, x, dms.SearchConfig(resource="latency", target=searcher.config.target,
                                                      latency_options={"profile": state["latency_profile"]}))
    resumed.load_state_dict(state)
    assert float(resumed.costs.soft().detach()) == pytest.approx(float(searcher.costs.soft().detach()))


def test_searcher_reports_the_latency_fit(prepared) -> None:
    _, _, searcher, _ = prepared
    fit = searcher.costs.latency_fit()
    assert 0 <= fit["fit_rmse_rel"] < 0.5 and fit["calibration"] > 0
    assert set(fit["layers"]) <= set(searcher.space.layers)


def test_latency_fit_needs_a_latency_search() -> None:
    entry = ZOO["small_cnn"]
    searcher = dms.prepare(entry.build(), torch.randn(*entry.input_shape))
    with pytest.raises(ValueError, match="needs resource='latency'"):
        searcher.costs.latency_fit()
