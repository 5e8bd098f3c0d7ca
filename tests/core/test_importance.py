"""Element importance as a moving average (paper Eq. 4, ablation of Sec. 5.1).

``c^{t+1} = decay * c^t + (1 - decay) * score(m^t, g^t)`` from ``c^0 = 0`` unrolls to the
closed form ``c^T = (1 - decay) * sum_t decay^(T-1-t) * score(m^t, g^t)``, which the tests
compare against; scores are taylor (m g)^2, snip |m g|, fisher g^2, and index (static).
"""

from __future__ import annotations

import pytest
import torch

from dmscale.core.importance import IMPORTANCE_METRICS, update_importance
from dmscale.core.topk import DifferentiableTopK

SCORES = {
    "taylor": lambda m, g: (m * g) ** 2,
    "snip": lambda m, g: (m * g).abs(),
    "fisher": lambda m, g: g**2,
}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _steps(n: int, steps: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = _gen(seed)
    return [
        (torch.rand(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64))
        for _ in range(steps)
    ]


def _closed_form(metric: str, history, decay: float) -> torch.Tensor:
    big_t = len(history)
    return sum(
        (1 - decay) * decay ** (big_t - 1 - t) * SCORES[metric](m, g)
        for t, (m, g) in enumerate(history)
    )


def test_metric_registry() -> None:
    assert set(IMPORTANCE_METRICS) == {"taylor", "snip", "fisher", "index"}
    assert IMPORTANCE_METRICS["index"] is None


@pytest.mark.parametrize("metric", ["taylor", "snip", "fisher"])
@pytest.mark.parametrize("decay", [0.99, 0.0])
@pytest.mark.parametrize("steps", [1, 12])
def test_moving_average_matches_closed_form(metric: str, decay: float, steps: int) -> None:
    n = 9
    history = _steps(n, steps, seed=steps)
    c = torch.zeros(n, dtype=torch.float64)  # c^0 = 0
    for m, g in history:
        update_importance(c, m, g, metric, decay)
    expected = _closed_form(metric, history, decay)
    assert torch.allclose(c, expected, rtol=1e-12, atol=1e-15), (c, expected)


@pytest.mark.parametrize("steps", [1, 10, 50])
def test_taylor_constant_score_saturates(steps: int) -> None:
    """A constant score s gives c^T = s (1 - 0.99^T) (default decay 0.99)."""
    m = torch.tensor([1.0, 0.5, 0.25, 0.0], dtype=torch.float64)
    g = torch.tensor([2.0, -4.0, 1.0, 3.0], dtype=torch.float64)
    c = torch.zeros(4, dtype=torch.float64)
    for _ in range(steps):
        update_importance(c, m, g, "taylor", 0.99)
    s = torch.tensor([4.0, 4.0, 0.0625, 0.0], dtype=torch.float64)
    assert torch.allclose(c, s * (1 - 0.99**steps), rtol=1e-12, atol=0.0)


def test_scores_differ_as_documented() -> None:
    """taylor and snip vanish with the mask, fisher ignores it; signs never matter."""
    m = torch.tensor([0.0, 0.5, 1.0])
    g = torch.tensor([3.0, -2.0, -0.5])
    out = {}
    for metric in ("taylor", "snip", "fisher"):
        c = torch.zeros(3)
        update_importance(c, m, g, metric, 0.0)  # decay 0: c is the raw score
        out[metric] = c.tolist()
    assert out["taylor"] == [0.0, 1.0, 0.25]  # (m g)^2
    assert out["snip"] == [0.0, 1.0, 0.5]  # |m g|
    assert out["fisher"] == [9.0, 4.0, 0.25]  # g^2


def test_docstring_example() -> None:
    c = torch.zeros(3)
    update_importance(c, torch.ones(3), torch.tensor([1.0, -2.0, 0.0]), "taylor", 0.99)
    assert torch.allclose(c, torch.tensor([0.01, 0.04, 0.0]), rtol=1e-6, atol=0.0)


def test_index_importance_never_changes() -> None:
    c = torch.tensor([3.0, 2.0, 1.0])
    before = c.clone()
    for m, g in _steps(3, 5, seed=1):
        update_importance(c, m.float(), g.float(), "index", 0.5)
    assert torch.equal(c, before)

    topk = DifferentiableTopK(6, importance="index")
    assert topk.importance.tolist() == [6.0, 5.0, 4.0, 3.0, 2.0, 1.0]  # earlier = more important
    for m, g in _steps(6, 5, seed=2):
        topk.update_importance(m.float(), 100 * g.float())
    assert topk.importance.tolist() == [6.0, 5.0, 4.0, 3.0, 2.0, 1.0]
    with torch.no_grad():
        topk.a.fill_(0.5)
    assert topk.kept_elements() == [0, 1, 2]


@pytest.mark.parametrize("metric", ["taylor", "snip", "fisher"])
def test_module_update_uses_its_decay_and_a_zero_start(metric: str) -> None:
    n, decay = 7, 0.9
    topk = DifferentiableTopK(n, importance=metric, decay=decay)
    assert torch.equal(topk.importance, torch.zeros(n))  # c^0 = 0
    history = _steps(n, 6, seed=3)
    for m, g in history:
        topk.update_importance(m.float(), g.float())
    expected = _closed_form(metric, history, decay).float()
    assert torch.allclose(topk.importance, expected, rtol=1e-5, atol=1e-7)
    assert topk.importance.dtype == torch.float32


def test_default_decay_is_paper_value() -> None:
    topk = DifferentiableTopK(4)
    assert topk.decay == 0.99 and topk.metric == "taylor"
    topk.update_importance(torch.ones(4), torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert torch.allclose(topk.importance, 0.01 * torch.tensor([1.0, 4.0, 9.0, 16.0]), rtol=1e-6)


@pytest.mark.parametrize("metric", ["taylor", "snip", "fisher", "index"])
def test_update_builds_no_graph_and_needs_no_grad(metric: str) -> None:
    """Importance is a buffer, never trained: the update is outside autograd."""
    n = 8
    topk = DifferentiableTopK(n, importance=metric)
    with torch.no_grad():
        topk.a.fill_(0.4)
    w = torch.randn(n, generator=_gen(4), requires_grad=True)
    with torch.enable_grad():
        m = topk.soft_mask()  # requires grad (depends on a)
        task_loss = (m * w).sum()
        (g,) = torch.autograd.grad(task_loss, m, create_graph=True)  # g requires grad too
        assert m.requires_grad and g.requires_grad
        buffer = topk.importance
        ptr = buffer.data_ptr()
        topk.update_importance(m, g)
    assert topk.importance is buffer and buffer.data_ptr() == ptr  # in place
    assert not topk.importance.requires_grad
    assert topk.importance.grad_fn is None
    assert topk.ratio_grad is None and w.grad is None  # nothing was back-propagated
    if metric != "index":
        expected = 0.01 * SCORES[metric](m.detach(), w.detach())  # g = dL/dm = w
        assert torch.allclose(topk.importance, expected, rtol=1e-5, atol=1e-8)
    # the graph of the task loss is still intact and unaffected by the update
    task_loss.backward()
    assert topk.ratio_grad is not None and w.grad is not None


def test_function_leaves_inputs_alone() -> None:
    m = torch.rand(5, generator=_gen(5), requires_grad=True)
    g = torch.randn(5, generator=_gen(6), requires_grad=True)
    m0, g0 = m.detach().clone(), g.detach().clone()
    c = torch.zeros(5)
    with torch.enable_grad():
        update_importance(c, m * 1.0, g * 1.0, "taylor", 0.99)
    assert c.grad_fn is None and not c.requires_grad
    assert torch.equal(m.detach(), m0) and torch.equal(g.detach(), g0)
    assert m.grad is None and g.grad is None


def test_taylor_importance_drives_the_ranking() -> None:
    """After updates, the hard mask keeps the elements with the largest (m g)^2 average."""
    n = 10
    topk = DifferentiableTopK(n)
    g_scale = torch.tensor([0.1, 5.0, 0.2, 4.0, 0.3, 3.0, 0.4, 2.0, 0.5, 1.0])
    noise = torch.Generator().manual_seed(7)
    for _ in range(20):  # |g| ordering fixed, sign and a 10% jitter random
        sign = torch.randint(0, 2, (n,), generator=noise) * 2 - 1
        jitter = 1 + 0.1 * torch.rand(n, generator=noise)
        topk.update_importance(torch.ones(n), sign * jitter * g_scale)
    with torch.no_grad():
        topk.a.fill_(0.5)
    assert topk.kept_elements() == [1, 3, 5, 7, 9]


# ----------------------------------------------------------------------------- issue 8, defect 4


def _prepared_mlp(seed: int = 0):
    import dmscale as dms

    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    x = torch.randn(8, 6)
    return net, x, dms.prepare(net, x, dms.SearchConfig(resource="macs", target=0.5))


def test_non_finite_gradient_leaves_importance_untouched() -> None:
    net, x, searcher = _prepared_mlp()
    net(x).pow(2).mean().backward()
    before = searcher.gates.width[0].importance.clone()
    assert before.abs().sum() > 0
    (net(x).pow(2).mean() * float("inf")).backward()  # an fp16 overflow, say
    after = searcher.gates.width[0].importance
    assert torch.isfinite(after).all()
    torch.testing.assert_close(after, before)
    net(x).pow(2).mean().backward()  # and later steps still update it
    assert not torch.equal(searcher.gates.width[0].importance, before)


def test_function_skips_a_non_finite_update() -> None:
    c = torch.tensor([1.0, 2.0])
    update_importance(c, torch.ones(2), torch.tensor([float("nan"), 1.0]), "taylor", 0.9)
    assert c.tolist() == [1.0, 2.0]


def test_grad_scaler_importance_is_computed_from_unscaled_gradients() -> None:
    net_a, x, plain = _prepared_mlp()
    net_a(x).pow(2).mean().backward()
    net_b, _, scaled = _prepared_mlp()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    scaled.use_grad_scaler(scaler)
    scaler.scale(net_b(x).pow(2).mean()).backward()
    torch.testing.assert_close(scaled.gates.width[0].importance, plain.gates.width[0].importance)
