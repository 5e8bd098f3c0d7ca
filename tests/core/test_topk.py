"""Properties of the differentiable top-k operator (paper Sec. 3.1, Eq. 1-3, App. A.1.1).

Every test checks a property the paper states (or that the module documents) against an
independent brute-force or closed-form computation, so each one can fail.

The ``regression`` tests pin down bugs found (and fixed) in ``src/dmscale/core/topk.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

from dmscale.core.topk import DifferentiableTopK, normalized_rank

def _sizes(*ns: int) -> list:
    return list(ns)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _set_a(topk: DifferentiableTopK, value) -> None:
    with torch.no_grad():
        topk.a.copy_(torch.as_tensor(value, dtype=topk.a.dtype))


def _brute_rank(c: list[float]) -> list[int]:
    """Integer rank with ties broken by index: #{j: c_j < c_i} + #{j > i: c_j == c_i}."""
    n = len(c)
    return [
        sum(1 for j in range(n) if c[j] < c[i]) + sum(1 for j in range(i + 1, n) if c[j] == c[i])
        for i in range(n)
    ]


def _brute_topk(c: list[float], k: int) -> set[int]:
    """The k most important indices; among equal importances the lower index wins."""
    return set(sorted(range(len(c)), key=lambda i: (-c[i], i))[:k])


# ============================================================================================
# Importance normalisation (Eq. 2)
# ============================================================================================


@pytest.mark.parametrize("n", [1, 2, 3, 7, 16, 33, 100])
@pytest.mark.parametrize("kind", ["distinct", "ties", "all_equal"])
def test_normalized_rank_is_a_permutation_of_even_grid(n: int, kind: str) -> None:
    g = _gen(n)
    if kind == "distinct":
        c = torch.randn(n, generator=g)
    elif kind == "ties":
        c = torch.randint(0, 3, (n,), generator=g).float()
    else:
        c = torch.zeros(n)
    rank = normalized_rank(c)
    grid = torch.arange(n, dtype=c.dtype) / n  # {0, 1/N, ..., (N-1)/N}
    assert rank.shape == (n,)
    assert torch.equal(torch.sort(rank).values, grid)
    # exactly N distinct values, all in [0, 1)
    assert torch.unique(rank).numel() == n
    assert float(rank.min()) == 0.0 and float(rank.max()) < 1.0


@pytest.mark.parametrize("n", [2, 5, 13, 40, 97])
def test_normalized_rank_ties_lower_index_ranks_higher(n: int) -> None:
    c = torch.randint(0, 4, (n,), generator=_gen(100 + n)).float()
    rank = normalized_rank(c)
    expected = torch.tensor(_brute_rank(c.tolist()), dtype=c.dtype) / n
    assert torch.equal(rank, expected)
    cl, rl = c.tolist(), rank.tolist()
    for i in range(n):
        for j in range(i + 1, n):
            if cl[i] == cl[j]:
                assert rl[i] > rl[j]
    # deterministic: the same input gives the same output every time
    assert torch.equal(normalized_rank(c.clone()), rank)


@pytest.mark.parametrize("n", [1, 4, 9])
def test_normalized_rank_all_zero_keeps_first_elements(n: int) -> None:
    """The start of a search (zero importance) ranks element 0 highest, N-1 lowest."""
    rank = normalized_rank(torch.zeros(n))
    assert torch.equal(rank, torch.arange(n - 1, -1, -1, dtype=torch.float32) / n)


@pytest.mark.parametrize("n", [1, 2, 8, 31, 64, 129])
@pytest.mark.parametrize("seed", [0, 1])
def test_normalized_rank_matches_paper_definition_for_distinct_values(n: int, seed: int) -> None:
    c = torch.randn(n, generator=_gen(1000 * seed + n), dtype=torch.float64)
    assert torch.unique(c).numel() == n
    vals = c.tolist()
    # Eq. 2: c'_i = (1/N) #{j : c_i > c_j}
    expected = torch.tensor([sum(vi > vj for vj in vals) for vi in vals], dtype=c.dtype) / n
    rank = normalized_rank(c)
    assert rank.dtype == torch.float64
    assert torch.equal(rank, expected)


def test_normalized_rank_docstring_example_and_no_grad() -> None:
    c = torch.tensor([0.3, 0.1, 0.3, 0.9], requires_grad=True)
    rank = normalized_rank(c)
    assert rank.tolist() == [0.5, 0.0, 0.25, 0.75]
    assert not rank.requires_grad  # c' is a rank: it carries no gradient to c


# ============================================================================================
# Soft mask (Eq. 3): the +-3/N band and the gradient
# ============================================================================================


@pytest.mark.parametrize("n", [10, 64, 100, 257])
def test_soft_mask_polarised_outside_3_over_n_band(n: int) -> None:
    topk = DifferentiableTopK(n, min_keep=0, centered=False)  # a may reach any value in [0, 1)
    assert topk.lam == n  # lambda = N for widths
    topk.importance.copy_(torch.randn(n, generator=_gen(n)))
    c_norm = normalized_rank(topk.importance).double()
    sweep = torch.cat([torch.linspace(0, 1, 61)[:-1], torch.rand(20, generator=_gen(7 * n))])
    for a in sweep.tolist():
        _set_a(topk, a)
        m = topk.soft_mask().detach().double()
        a_val = float(topk.a.detach())
        assert a_val == pytest.approx(a)  # no clamping inside [0, 1)
        far = (c_norm - a_val).abs() > 3.0 / n
        err = (m - m.round()).abs()
        assert bool((err[far] < 0.05).all()), (a, err[far].max())
        # "except for the six elements whose importance values are around the pruning ratio":
        # the fuzzy area 0.05 < m < 0.95 holds at most 6 elements ...
        fuzzy = (m > 0.05) & (m < 0.95)
        assert int(fuzzy.sum()) <= 6
        # ... and is not empty when a is inside the grid (lambda = N is not a hard step)
        nearest = (c_norm - a_val).abs().argmin()
        if abs(float(c_norm[nearest]) - a_val) < 1.0 / n:
            assert 0.05 < float(m[nearest]) < 0.95


@pytest.mark.parametrize(
    ("temperature", "n"), [(1.0, 10), (1.0, 37), (4.0, 4), (4.0, 12)], ids=["w10", "w37", "d4", "d12"]
)
@pytest.mark.parametrize("a", [0.0, 0.13, 0.5, 0.71])
def test_dm_da_equals_minus_lambda_m_one_minus_m(temperature: float, n: int, a: float) -> None:
    """dm_i/da = -lambda m_i (1 - m_i); lambda = N (width) or 4N (depth/heads)."""
    topk = DifferentiableTopK(n, temperature=temperature, min_keep=0)
    assert topk.lam == temperature * n
    topk.importance.copy_(torch.randn(n, generator=_gen(n)))
    _set_a(topk, a)
    m = topk.soft_mask()
    assert m.requires_grad
    expected = -topk.lam * m.detach() * (1 - m.detach())
    got = torch.stack(
        [torch.autograd.grad(m[i], topk.a, retain_graph=True)[0] for i in range(n)]
    )
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6 * topk.lam), (got, expected)
    assert bool((got <= 0).all())  # raising the pruning ratio never raises a mask
    # the total derivative of sum(m) accumulates into a.grad; importance gets no gradient
    m.sum().backward()
    assert torch.allclose(topk.ratio_grad, expected.sum(), rtol=1e-5, atol=1e-5 * topk.lam)
    assert not topk.importance.requires_grad


def test_soft_mask_matches_eq3_closed_form() -> None:
    n = 20
    topk = DifferentiableTopK(n, temperature=4.0, min_keep=0, centered=False)
    topk.importance.copy_(torch.randn(n, generator=_gen(3)))
    _set_a(topk, 0.4)
    c_norm = torch.tensor(_brute_rank(topk.importance.tolist()), dtype=torch.float64) / n
    expected = 1.0 / (1.0 + torch.exp(-(4 * n) * (c_norm - float(topk.a.detach()))))
    assert torch.allclose(topk.soft_mask().detach().double(), expected, rtol=1e-5, atol=1e-6)


# ============================================================================================
# Hard count k = round((1 - a) N) and the hard mask
# ============================================================================================


@pytest.mark.parametrize("n", _sizes(1, 2, 7, 10, 22, 64, 100, 257))
def test_hard_count_and_hard_mask_are_topk(n: int) -> None:
    """For a = (j + f)/N: k = N - j if f < 1/2 else N - j - 1 (= round((1 - a) N))."""
    topk = DifferentiableTopK(n, min_keep=0)
    topk.importance.copy_(torch.randint(0, max(2, n // 3), (n,), generator=_gen(n)).float())
    c = topk.importance.tolist()
    for j in range(0, n, 1 if n <= 100 else 7):
        for f in (0.0, 0.3, 0.7):
            a = (j + f) / n
            _set_a(topk, a)
            k_expected = n - j if f < 0.5 else n - j - 1
            assert round((1 - a) * n) == k_expected  # the paper's formula, in float64
            assert topk.hard_count() == k_expected, (j, f)
            hard = topk.hard_mask().tolist()
            kept = {i for i, h in enumerate(hard) if h == 1.0}
            assert sum(h in (0.0, 1.0) for h in hard) == n  # a 0/1 mask
            assert len(kept) == k_expected, (j, f)
            assert kept == _brute_topk(c, k_expected), (j, f)


@pytest.mark.parametrize(
    ("n", "k"), [(22, 9), (37, 13), (100, 47), (100, 41)]
)
def test_hard_mask_regression_float_rank_roundtrip(n: int, k: int) -> None:
    topk = DifferentiableTopK(n, min_keep=0)
    _set_a(topk, (n - k) / n)
    assert topk.hard_count() == k
    assert int(topk.hard_mask().sum()) == k


@pytest.mark.parametrize(("n", "min_keep"), [(10, 3), (10, 10), (7, 1), (64, 5)])
def test_hard_count_respects_min_keep(n: int, min_keep: int) -> None:
    topk = DifferentiableTopK(n, min_keep=min_keep)
    assert topk.max_ratio == pytest.approx(1 - min_keep / n)
    for a in torch.linspace(0, 1, 51).tolist() + [1.5, 7.0]:
        _set_a(topk, a)
        k = topk.hard_count()
        assert min_keep <= k <= n
        assert float(topk.a.detach()) <= topk.max_ratio + 1e-7  # a projected to [0, 1 - n_min/N]
        assert int(topk.hard_mask().sum()) == k
    _set_a(topk, 1.0)
    assert topk.hard_count() == min_keep
    assert float(topk.a.detach()) == pytest.approx(1 - min_keep / n)


# ============================================================================================
# Monotonicity
# ============================================================================================


@pytest.mark.parametrize("n", [5, 16, 100])
def test_monotone_in_a(n: int) -> None:
    topk = DifferentiableTopK(n, min_keep=0)
    topk.importance.copy_(torch.randn(n, generator=_gen(n)))
    masks, counts, kept = [], [], []
    for a in torch.linspace(0, 1, 2 * n + 1).tolist():
        _set_a(topk, a)
        masks.append(topk.soft_mask().detach())
        counts.append(topk.hard_count())
        kept.append(set(topk.kept_elements()))
    soft = torch.stack(masks)  # (n_a, N), a ascending
    assert bool((soft[1:] <= soft[:-1]).all())  # every m_i non-increasing in a
    assert bool((soft[0] > soft[-1]).all())  # and actually decreasing over [0, 1]
    assert all(k1 >= k2 for k1, k2 in zip(counts, counts[1:]))
    assert counts[0] == n and counts[-1] == 0
    assert all(s2 <= s1 for s1, s2 in zip(kept, kept[1:]))  # kept sets are nested


@pytest.mark.parametrize("n", [6, 33])
@pytest.mark.parametrize("a", [0.0, 0.3, 0.5, 0.9])
def test_soft_mask_increasing_in_rank(n: int, a: float) -> None:
    topk = DifferentiableTopK(n, min_keep=0)
    topk.importance.copy_(torch.randn(n, generator=_gen(n)))
    _set_a(topk, a)
    m = topk.soft_mask().detach()
    order = torch.argsort(normalized_rank(topk.importance))  # least -> most important
    m_sorted = m[order]
    assert bool((m_sorted[1:] >= m_sorted[:-1]).all())
    # strictly increasing where sigmoid is not saturated in float32
    c_sorted = normalized_rank(topk.importance)[order]
    near = (c_sorted - a).abs() < 5.0 / n
    idx = torch.nonzero(near[1:] & near[:-1]).flatten()
    assert bool((m_sorted[idx + 1] > m_sorted[idx]).all())


# ============================================================================================
# Soft mask vs hard mask
#
# With s = aN and integer ranks r_i = N c'_i in {0, ..., N-1}:
#   m_i > 1/2  <=>  c'_i > a  <=>  r_i > s,  so  #{m_i > 1/2} = N - 1 - floor(s)   (0 <= s < N)
#   hard k = round(N - s).
# These agree iff frac(s) > 1/2 (frac(s) = 1/2 is a rounding tie).  For frac(s) < 1/2 the hard
# mask keeps exactly one more element, the one of rank floor(s), whose soft mask is
# sigmoid(-frac(s)) in (sigmoid(-1/2), 1/2] (= 1/2 exactly at a = j/N, e.g. the least
# important element at a = 0).  So a = (j + 0.5)/N is the worst choice; a = (j + 0.75)/N agrees.
# ============================================================================================


@pytest.mark.parametrize("n", _sizes(1, 2, 5, 10, 22, 64, 100))
def test_soft_mask_agrees_with_hard_mask_when_frac_above_half(n: int) -> None:
    topk = DifferentiableTopK(n, min_keep=0, centered=False)
    topk.importance.copy_(torch.randn(n, generator=_gen(n)))
    for j in range(n):
        for f in (0.55, 0.95):
            _set_a(topk, (j + f) / n)
            soft_on = topk.soft_mask().detach() > 0.5
            hard_on = topk.hard_mask() == 1
            assert torch.equal(soft_on, hard_on), (j, f)
            assert int(soft_on.sum()) == n - 1 - j


@pytest.mark.parametrize("n", _sizes(1, 3, 10, 22, 64, 100))
def test_soft_mask_one_short_of_hard_mask_when_frac_below_half(n: int) -> None:
    topk = DifferentiableTopK(n, min_keep=0, centered=False)
    topk.importance.copy_(torch.randn(n, generator=_gen(n + 1)))
    rank = torch.tensor(_brute_rank(topk.importance.tolist()))
    lo = 1.0 / (1.0 + math.exp(0.5))  # sigmoid(-1/2)
    for j in range(n):
        for f in (0.0, 0.4):
            # a = j/N computed in float32 exactly like c' so that c'_i - a = 0 when f = 0
            a = (torch.tensor(float(j)) + f) / n
            _set_a(topk, a)
            soft = topk.soft_mask().detach()
            hard = topk.hard_mask()
            assert int(hard.sum()) == n - j
            assert int((soft > 0.5).sum()) == n - j - 1
            extra = torch.nonzero((hard == 1) & ~(soft > 0.5)).flatten().tolist()
            assert extra == [int(torch.nonzero(rank == j))]
            assert lo < float(soft[extra[0]]) <= 0.5
            if f == 0.0:
                assert float(soft[extra[0]]) == 0.5


# ============================================================================================
# Coarse search space (App. A.1.1)
# ============================================================================================

UNIT_SIZES_18_4 = [4, 4, 4, 4, 2]


def test_coarse_units_shape_and_constant_masks() -> None:
    topk = DifferentiableTopK(18, step=4, min_keep=0)
    assert topk.n_units == 5
    assert topk.lam == 5  # lambda counts units
    assert topk.importance.shape == (5,)
    counts = torch.bincount(topk.unit_of_element, minlength=5).tolist()
    assert counts == UNIT_SIZES_18_4  # the last unit is shorter
    assert topk.unit_of_element.tolist() == sorted(topk.unit_of_element.tolist())  # contiguous
    topk.importance.copy_(torch.tensor([0.3, 2.0, 0.1, 1.0, 5.0]))
    for a in (0.0, 0.1, 0.35, 0.5, 0.75, 0.99):
        _set_a(topk, a)
        soft, hard = topk.soft_mask(), topk.hard_mask()
        usoft, uhard = topk.unit_soft_mask(), topk.unit_hard_mask()
        assert soft.shape == hard.shape == (18,)
        start = 0
        for u, size in enumerate(UNIT_SIZES_18_4):
            seg = slice(start, start + size)
            assert bool((soft[seg] == usoft[u]).all()) and bool((hard[seg] == uhard[u]).all())
            start += size
    # soft mask still differentiable through the expansion
    _set_a(topk, 0.5)
    topk.soft_mask().sum().backward()
    assert topk.ratio_grad is not None and float(topk.ratio_grad) < 0


def test_coarse_kept_elements_equal_sum_of_kept_unit_sizes() -> None:
    topk = DifferentiableTopK(18, step=4, min_keep=0)
    unit_c = [0.3, 2.0, 0.1, 1.0, 5.0]  # unit 4 (2 elements) is the most important
    topk.importance.copy_(torch.tensor(unit_c))
    for k in range(6):
        _set_a(topk, (5 - k) / 5)
        assert topk.hard_count() == k
        kept_units = _brute_topk(unit_c, k)
        kept = topk.kept_elements()
        assert len(kept) == sum(UNIT_SIZES_18_4[u] for u in kept_units)
        assert set(kept) == {e for e in range(18) if e // 4 in kept_units}
        assert int(topk.hard_mask().sum()) == len(kept)


@pytest.mark.parametrize("min_keep", list(range(0, 19)))
def test_coarse_min_keep_rounds_up_to_units(min_keep: int) -> None:
    topk = DifferentiableTopK(18, step=4, min_keep=min_keep)
    # fewest units whose worst choice (the 2-element last unit plus full units) has min_keep
    min_units = 0 if min_keep == 0 else 1 if min_keep <= 2 else 1 + math.ceil((min_keep - 2) / 4)
    assert topk.min_units == min_units
    assert topk.max_ratio == pytest.approx(1 - min_units / 5)
    _set_a(topk, 1.0)
    assert topk.hard_count() == min_units
    assert float(topk.a.detach()) == pytest.approx(1 - min_units / 5)
    # with the default (zero) importance the first units are kept: full-size units
    assert len(topk.kept_elements()) == min(18, 4 * min_units) >= min_keep


@pytest.mark.parametrize("min_keep", [3, 15])
def test_coarse_min_keep_elements_with_short_last_unit(min_keep: int) -> None:
    topk = DifferentiableTopK(18, step=4, min_keep=min_keep)
    topk.importance.copy_(torch.tensor([5.0, 4.0, 3.0, 2.0, 10.0]))  # short unit ranks first
    _set_a(topk, 1.0)
    assert len(topk.kept_elements()) >= min_keep


@pytest.mark.parametrize(("size", "step", "units"), [(3, 8, 1), (8, 8, 1), (9, 8, 2), (64, 16, 4)])
def test_coarse_unit_count(size: int, step: int, units: int) -> None:
    topk = DifferentiableTopK(size, step=step)
    assert topk.n_units == units
    assert topk.soft_mask().shape == (size,)
    assert topk.hard_mask().shape == (size,)


# ============================================================================================
# Ablation: normalize=False (c' = c)
# ============================================================================================


def test_normalize_false_uses_raw_importance() -> None:
    n = 12
    topk = DifferentiableTopK(n, normalize=False, min_keep=0)
    c = torch.rand(n, generator=_gen(5))
    c[3] = c[7]  # ties are fine: nothing is ranked
    topk.importance.copy_(c)
    assert torch.equal(topk.normalized_importance(), c)
    for a in (0.0, 0.2, 0.5, 0.8):
        _set_a(topk, a)
        expected_soft = torch.sigmoid(n * (c - float(topk.a.detach())))
        assert torch.allclose(topk.soft_mask().detach(), expected_soft, rtol=1e-6, atol=1e-7)
        assert torch.equal(topk.hard_mask(), (c > float(topk.a.detach())).float())
    # differs from the normalised operator for unevenly spread importance
    ref = DifferentiableTopK(n, min_keep=0)
    ref.importance.copy_(c)
    _set_a(ref, 0.5)
    assert not torch.allclose(ref.soft_mask().detach(), topk.soft_mask().detach())


def test_normalize_false_hard_count_matches_hard_mask() -> None:
    topk = DifferentiableTopK(8, normalize=False)
    topk.importance.copy_(torch.tensor([0.9, 0.8, 0.7, 0.1, 0.05, 0.02, 0.01, 0.0]))
    _set_a(topk, 0.5)
    assert topk.hard_count() == int(topk.hard_mask().sum())


# ============================================================================================
# Clamp of a
# ============================================================================================


@pytest.mark.parametrize(
    ("raw", "min_keep", "expected"),
    [(-0.5, 1, 0.0), (-3.0, 0, 0.0), (2.0, 1, 0.9), (1.0, 0, 1.0), (0.95, 4, 0.6), (0.42, 1, 0.42)],
)
@pytest.mark.parametrize("method", ["soft_mask", "hard_mask", "hard_count"])
def test_a_is_clamped_on_next_mask(raw: float, min_keep: int, expected: float, method: str) -> None:
    n = 10
    topk = DifferentiableTopK(n, min_keep=min_keep)
    topk.importance.copy_(torch.randn(n, generator=_gen(11)))
    _set_a(topk, raw)
    assert float(topk.a.detach()) == pytest.approx(raw)  # setting does not clamp by itself
    out = getattr(topk, method)()
    assert float(topk.a.detach()) == pytest.approx(expected)
    ref = DifferentiableTopK(n, min_keep=min_keep)
    ref.importance.copy_(topk.importance)
    _set_a(ref, expected)
    ref_out = getattr(ref, method)()
    if isinstance(out, torch.Tensor):
        assert torch.equal(out.detach(), ref_out.detach())
    else:
        assert out == ref_out


def test_clamp_keeps_parameter_identity_and_grad() -> None:
    topk = DifferentiableTopK(6)
    param = topk.a
    _set_a(topk, 5.0)
    m = topk.soft_mask()
    assert topk.a is param and topk.a.requires_grad
    m.sum().backward()
    assert topk.ratio_grad is not None


# ============================================================================================
# Constructor validation
# ============================================================================================


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"size": 0}, r"size >= 1, got 0"),
        ({"size": -3}, r"size >= 1, got -3"),
        ({"size": 8, "step": 0}, r"step must be >= 1, got 0"),
        ({"size": 8, "step": -2}, r"step must be >= 1, got -2"),
        ({"size": 8, "min_keep": -1}, r"min_keep must be in \[0, 8\], got -1"),
        ({"size": 8, "min_keep": 9}, r"min_keep must be in \[0, 8\], got 9"),
        ({"size": 8, "importance": "l1"}, r"importance must be one of .*'taylor'.*, got 'l1'"),
    ],
)
def test_invalid_constructor_arguments(kwargs: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        DifferentiableTopK(**kwargs)


@pytest.mark.parametrize(
    "kwargs", [{"temperature": 0.0}, {"temperature": -1.0}, {"decay": 1.5}, {"decay": -0.1}]
)
def test_invalid_temperature_and_decay(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="got"):
        DifferentiableTopK(8, **kwargs)


@pytest.mark.parametrize("importance", ["taylor", "snip", "fisher", "index"])
def test_valid_constructor_defaults(importance: str) -> None:
    topk = DifferentiableTopK(8, importance=importance)
    assert float(topk.a.detach()) == 0.0 and topk.a.requires_grad
    assert not topk.importance.requires_grad
    assert "importance" in topk.state_dict() and "a" in dict(topk.named_parameters())
    assert topk.hard_count() == 8 and int(topk.hard_mask().sum()) == 8


# ============================================================================================
# Centring (default): c' + 1/(2N) so the soft count equals the hard count
# ============================================================================================


@pytest.mark.parametrize("n", [1, 3, 10, 22, 64, 100])
def test_centered_soft_mask_agrees_with_hard_mask_for_every_a(n: int) -> None:
    topk = DifferentiableTopK(n, min_keep=0)
    topk.importance.copy_(torch.randn(n, generator=_gen(n + 2)))
    for j in range(n):
        for f in (0.05, 0.3, 0.7, 0.95):  # every fractional part except the 0.5 rounding tie
            _set_a(topk, (j + f) / n)
            soft_on = topk.soft_mask().detach() > 0.5
            assert torch.equal(soft_on, topk.hard_mask() == 1), (j, f)


@pytest.mark.parametrize("n", [24, 64, 256])
def test_centered_soft_count_equals_hard_count(n: int) -> None:
    """Verbatim Eq. 3 sums to k - 1/2 (a minimum-width layer would be costed at half its
    size); centred it sums to k, to within the sigmoid tails."""
    centred = DifferentiableTopK(n, min_keep=0)
    verbatim = DifferentiableTopK(n, min_keep=0, centered=False)
    for k in range(8, n - 8):
        for t in (centred, verbatim):
            _set_a(t, 1.0 - k / n)
            assert t.hard_count() == k
        assert float(centred.soft_mask().sum()) == pytest.approx(k, abs=0.02)
        assert float(verbatim.soft_mask().sum()) == pytest.approx(k - 0.5, abs=0.02)


def test_differentiable_topk_satisfies_the_gate_protocol() -> None:
    from dmscale.core.topk import StructuralGate

    assert isinstance(DifferentiableTopK(4), StructuralGate)
