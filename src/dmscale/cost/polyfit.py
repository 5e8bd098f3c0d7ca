"""Monotone polynomial fits of a layer's latency against its keep ratios (paper Eq. 9).

Part of the latency constraint (:mod:`dmscale.cost.latency`): ``fit_monotone_poly`` fits
``F(k_in, k_out)`` by least squares, refitting under "non-decreasing on [0, 1]^2"
constraints when timing noise makes the plain fit decrease somewhere; :class:`LayerFit`
holds one layer's fit.

Example:
    >>> import numpy as np
    >>> x = np.array([[0.25], [0.5], [0.75], [1.0]])
    >>> exps, coef, constrained = fit_monotone_poly(x, np.array([0.3, 0.5, 0.75, 1.0]), [2])
    >>> len(exps), constrained
    (3, False)
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["fit_monotone_poly", "LayerFit"]


# ---------------------------------------------------------------------- fitting


def _basis(exps: list[tuple[int, ...]], x: np.ndarray) -> np.ndarray:
    """(P, n_terms) monomials prod_v x_v^e_v of the points x (P, n_vars)."""
    cols = [np.prod([x[:, v] ** e[v] for v in range(x.shape[1])], axis=0) if x.shape[1] else np.ones(len(x))
            for e in exps]
    return np.stack(cols, axis=1)


def _basis_grad(exps: list[tuple[int, ...]], x: np.ndarray, var: int) -> np.ndarray:
    """(P, n_terms) derivative of each monomial w.r.t. variable ``var`` at the points x."""
    cols = []
    for e in exps:
        if e[var] == 0:
            cols.append(np.zeros(len(x)))
            continue
        col = e[var] * x[:, var] ** (e[var] - 1)
        for v in range(x.shape[1]):
            if v != var:
                col = col * x[:, v] ** e[v]
        cols.append(col)
    return np.stack(cols, axis=1)


def _exponents(degrees: list[int]) -> list[tuple[int, ...]]:
    """Monomials of total degree <= 2 with per-variable degree <= degrees[v], constant first."""
    out = [e for e in itertools.product(*[range(d + 1) for d in degrees]) if sum(e) <= 2]
    return sorted(out, key=lambda e: (sum(e), max(e), [-x for x in e]))  # 1, ki, ko, ki ko, ki^2, ko^2


def fit_monotone_poly(x: np.ndarray, y: np.ndarray, degrees: list[int],
                      anchor: bool = True) -> tuple[list[tuple[int, ...]], np.ndarray, bool]:
    """Least-squares polynomial (total degree <= 2) of y on x in [0, 1]^V, non-decreasing.

    Returns ``(exponents, coefficients, constrained)``. With ``anchor`` the fit passes
    through F(1, ..., 1) = 1 exactly (y is a latency relative to the unpruned layer, so the
    cost of the full model is its measured latency). The fit must be non-decreasing in every
    variable on [0, 1]^V and >= 0 at the origin; when the unconstrained solution is not, the
    quadratic program with those constraints (derivatives at the 2^V corners, which is exact
    for degree <= 2 since the derivatives are affine) is solved by enumerating active sets,
    and ``constrained`` is True.

    Example:
        >>> x = np.array([[0.25], [0.5], [0.75], [1.0]])
        >>> exps, c, constrained = fit_monotone_poly(x, np.array([0.3, 0.5, 0.75, 1.0]), [2])
        >>> exps, constrained, round(float(c.sum()), 6)
        ([(0,), (1,), (2,)], False, 1.0)
    """
    x = np.asarray(x, dtype=np.float64).reshape(len(y), -1)
    y = np.asarray(y, dtype=np.float64)
    exps = _exponents(degrees)
    p, n_vars = len(exps), x.shape[1]
    a = _basis(exps, x)
    corners = np.array(list(itertools.product([0.0, 1.0], repeat=n_vars))).reshape(-1, n_vars)
    g = np.concatenate([_basis(exps, np.zeros((1, n_vars)))]
                       + [_basis_grad(exps, corners, v) for v in range(n_vars)], axis=0)
    g = g[np.abs(g).sum(axis=1) > 0]  # rows "g @ c >= 0"
    eq = _basis(exps, np.ones((1, n_vars))) if anchor else np.zeros((0, p))  # rows "eq @ c = 1"
    ata, aty = a.T @ a, a.T @ y

    def solve(active: tuple[int, ...]) -> np.ndarray:
        cons = np.concatenate([eq, g[list(active)]], axis=0)
        m = len(cons)
        kkt = np.block([[2 * ata, cons.T], [cons, np.zeros((m, m))]])
        rhs = np.concatenate([2 * aty, np.ones(len(eq)), np.zeros(len(active))])
        return np.linalg.lstsq(kkt, rhs, rcond=None)[0][:p]

    coef = np.round(solve(()), 12)  # round away float dust (-1e-16 for an exact 0)
    if (g @ coef >= -1e-9).all():
        return exps, coef, False
    best, best_err = None, math.inf
    for size in range(1, min(len(g), p - len(eq)) + 1):
        for active in itertools.combinations(range(len(g)), size):
            c = solve(active)
            if not (g @ c >= -1e-7).all() or (anchor and abs(float((eq @ c)[0]) - 1.0) > 1e-7):
                continue
            err = float(np.sum((a @ c - y) ** 2))
            if err < best_err - 1e-15:
                best, best_err = c, err
    if best is None:  # the constant F = 1 (or 0) is always feasible
        best = np.zeros(p)
        best[0] = 1.0 if anchor else max(0.0, float(np.mean(y)))
    return exps, np.round(best, 12), True


# ---------------------------------------------------------------------- layer fits


@dataclass
class LayerFit:
    """The fitted latency model of one layer.

    Attributes:
        name: the layer's module name.
        sides: the fitted variables, a subset of ("in", "out") in that order.
        latency_full: latency of the unpruned layer (µs), from the fit.
        exponents: per monomial, the power of each fitted side.
        coef: the monomials' coefficients; F(1, ..., 1) = coef.sum().
        rmse_rel: RMSE of F against the measured latency_pruned / latency_full.
        constrained: True when the monotone refit was needed.
        points: measured (keep per side..., latency_pruned / latency_full).
    """

    name: str
    sides: tuple[str, ...]
    latency_full: float
    exponents: list[tuple[int, ...]]
    coef: np.ndarray
    rmse_rel: float
    constrained: bool
    points: list[tuple[float, ...]] = field(default_factory=list)

    def __call__(self, keeps: np.ndarray) -> np.ndarray:
        """F at keeps (P, len(sides))."""
        return _basis(self.exponents, np.asarray(keeps, dtype=np.float64).reshape(-1, len(self.sides))) @ self.coef

    def coef6(self) -> list[float]:
        """Coefficients of [1, ki, ko, ki ko, ki^2, ko^2] (0 for absent terms)."""
        order = {(0, 0): 0, (1, 0): 1, (0, 1): 2, (1, 1): 3, (2, 0): 4, (0, 2): 5}
        out = [0.0] * 6
        for e, c in zip(self.exponents, self.coef.tolist()):
            full = [0, 0]
            for side, power in zip(self.sides, e):
                full[0 if side == "in" else 1] = power
            out[order[tuple(full)]] += c
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"sides": list(self.sides), "latency_full_us": self.latency_full,
                "exponents": [list(e) for e in self.exponents], "coef": self.coef.tolist(),
                "rmse_rel": self.rmse_rel, "constrained": self.constrained,
                "f_full": float(self.coef.sum()), "points": [list(p) for p in self.points]}

    @classmethod
    def from_dict(cls, name: str, d: dict[str, Any]) -> "LayerFit":
        return cls(name, tuple(d["sides"]), float(d["latency_full_us"]), [tuple(e) for e in d["exponents"]],
                   np.asarray(d["coef"], dtype=np.float64), float(d["rmse_rel"]), bool(d["constrained"]),
                   [tuple(p) for p in d.get("points", [])])
