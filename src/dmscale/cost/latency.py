"""The latency constraint of DMS (paper App. A.1.2, Eq. 9): measured, then fitted.

For every handled layer whose cost scales with a searchable channel side (conv, linear,
and the per-channel norms), :class:`LatencyCostModel` times standalone copies of the layer
sliced to a grid of keep ratios (``ratios`` on each searchable side; a depthwise conv or a
norm has one ratio), on random inputs of the sliced shape, on the model's device and with
the current ``torch.get_num_threads()``. Per layer it fits, by least squares,

    F(k_in, k_out) = c0 + c1 k_in + c2 k_out + c3 k_in k_out + c4 k_in^2 + c5 k_out^2

to ``latency_pruned / latency_full`` (fewer terms for one-ratio layers or too few distinct
ratios). If the least-squares fit is not non-decreasing on [0, 1]^2 (timing noise, or
kernels that are faster at some widths), it is refitted under the constraints "dF/dk >= 0
at every corner" (exact for a quadratic, whose derivatives are affine) and F(0, 0) >= 0.
The fit is then renormalised to F(1, 1) = 1 and ``latency_full`` taken from it (the fitted
latency at full width uses every grid point, so it is less noisy than its one timing).
Timings are a low quantile (default 0.1) of single calls interleaved over rounds: on a busy
machine pauses only ever add time. The differentiable cost is

    r_c = sum_layers latency_full x F(keep_in, keep_out) x m_depth(block)
        + sum_blocks latency_rest(block) x m_depth(block)
        + latency_rest(outside the blocks)

with ``keep`` defined as in :class:`~dmscale.cost.resources.CostModel` (mean mask over the
layer's channel slots, fixed channels count as 1). The unit is **microseconds**, so an
absolute target (``SearchConfig.target > 1``) is a latency in µs.

The "rest" (activations, adds, pooling, attention cores, Python overhead: everything that is
not a profiled layer) is timed directly on a copy of the model whose profiled layers are
stubbed out (they return their recorded output), less the stubs' own call overhead, and
clamped at >= 0. Timing it directly, rather than as "whole model minus layers", keeps the
noise of the long whole-model call out of it (if the stubbed model cannot run, e.g. a fused
fast path that reads the layers' weights, the rest is "whole minus parts",
``rest_method: "subtracted"``). Parts timed alone add up to less than the whole model (on a
CPU, 5-30 % less for resnet20, 30-45 % for MobileNetV2 at 64x64: caches, and the work between
layers); with ``calibrate`` (default) every term is multiplied by ``timed whole / sum of
parts``, so the cost of the unpruned model is its timed latency and the in-model slowdown
scales with what is kept.

Limits: latency is a fitted model, not an exact count; at hard masks it predicts the
exported model's latency only up to the fit and the timing noise of the machine
(:meth:`LatencyCostModel.fit_report` measures it). The rest only
scales with depth: the time of element-wise ops and of attention cores (QK^T, AV: virtual
layers, whose heads are searched) does not shrink with width in this model. On a busy
machine, time with fewer threads than free cores: oversubscribed OpenMP threads make every
timing erratic.

The measuring and fitting live in :mod:`dmscale.cost.latency_profile`
(:class:`~dmscale.cost.latency_profile.LatencyProfiler`); this module evaluates the fitted profile.

Searches use it through ``dms.prepare(model, x, dms.SearchConfig(resource="latency", ...))``.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from dmscale.trace.discover import discover
    >>> net = nn.Sequential(nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 8, 3))
    >>> x = torch.randn(1, 3, 16, 16)
    >>> space = discover(net, x)
    >>> cost = LatencyCostModel(net, space, x, budget_s=2.0)
    >>> report = cost.fit_report()
    >>> report["unit"], sorted(report["layers"]), report["layers"]["0"]["sides"]
    ('us', ['0', '1', '3'], ['out'])
    >>> width = torch.ones(space.n_slots + 1, requires_grad=True)
    >>> r = cost(width, torch.ones(0))  # all kept: the measured latency of the model
    >>> abs(r.item() - report["predicted_full_us"]) < 1e-6 * r.item()
    True
    >>> r.backward()  # differentiable; wider never costs less
    >>> bool((width.grad > -1e-9).all())
    True
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any

import numpy as np
import torch
from torch import nn

from dmscale.core.errors import ConfigError, DataError
from dmscale.trace.space import LayerSlots, SearchSpace
from dmscale.cost.latency_profile import LatencyProfiler, _searchable
from dmscale.cost.polyfit import LayerFit, fit_monotone_poly
from dmscale.cost.resources import DeviceCache
from dmscale.cost.timing import measure_latency

__all__ = ["LatencyCostModel", "LayerFit", "measure_latency", "fit_monotone_poly"]


# ---------------------------------------------------------------------- the cost model


class LatencyCostModel(DeviceCache):
    """Differentiable latency ``r_c`` (µs) of a search, fitted from per-layer measurements.

    Same call convention as :class:`~dmscale.cost.resources.CostModel`: :meth:`__call__` takes the
    width mask (n_slots + 1, last entry 1) and the flat depth mask (n_blocks) and returns a
    float64 scalar.

    Args:
        model: the model (dmscale hooks may be attached; a detached deep copy is timed, in
            eval mode, on the model's device, with the current number of torch threads).
        space: its :class:`~dmscale.trace.discover.SearchSpace`.
        example_inputs: the inputs latency is measured for (batch size, resolution).
        ratios: keep ratios of the grid on each searchable side (1.0 is always added).
        repeats: at most this many timed rounds. Every grid point of every layer, every
            block and the whole model is timed once per round (one call, after ``warmup``
            untimed calls), in a shuffled order, so a slow spell of the machine is spread
            over all of them. Fewer rounds are run when ``budget_s`` would be exceeded (at
            least ``min(3, repeats)`` planned, and at least 2 run). Everything is called once
            before the rounds.
        warmup: untimed calls before every timed call. 0 (default): every timed call follows
            other work, so weights are about as cold in the cache as inside the model; with
            warm caches the layers add up to noticeably less than the whole model.
        budget_s: target wall time of the whole profile (seconds).
        quantile: the statistic of each timing's samples (0.5: median; lower values are
            more robust on a busy machine, where pauses only ever add time).
        min_block_s: calls shorter than this are repeated back to back and averaged.
        calibrate: scale every term so the parts add up to the timed whole model.
        profile: a :meth:`state_dict` from an earlier profile (e.g. measured on the target
            device): nothing is measured.
        seed: seed of the shuffling and of the random inputs.
    """

    resource = "latency"
    unit = "us"

    def __init__(self, model: nn.Module, space: SearchSpace, example_inputs: Any,
                 ratios: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0), repeats: int = 15, warmup: int = 0,
                 budget_s: float = 10.0, quantile: float = 0.1, min_block_s: float = 5e-5,
                 calibrate: bool = True, profile: dict[str, Any] | None = None, seed: int = 0) -> None:
        ratios = tuple(sorted({float(r) for r in ratios} | {1.0}))
        if not all(0.0 < r <= 1.0 for r in ratios):
            raise ConfigError(f"ratios must lie in (0, 1], got {ratios}")
        if repeats < 1 or warmup < 0 or budget_s <= 0 or min_block_s <= 0 or not 0 <= quantile <= 1:
            raise ConfigError("need repeats >= 1, warmup >= 0, budget_s > 0, min_block_s > 0, "
                              f"0 <= quantile <= 1; got repeats={repeats}, warmup={warmup}, "
                              f"budget_s={budget_s}, min_block_s={min_block_s}, quantile={quantile}")
        self.space = space
        self.ratios = ratios
        self.quantile = quantile
        self.timings: dict[tuple[str, Any], list[float]] = {}  # raw samples (s) of the last profile
        self._block_index = {}
        for j, d in enumerate(space.depth):
            for i, _ in enumerate(d.blocks):
                self._block_index[(j, i)] = len(self._block_index)
        if profile is None:
            profiler = LatencyProfiler(space, ratios, quantile)
            profile = profiler.profile(model, example_inputs, repeats, warmup, budget_s, min_block_s, seed)
            self.timings = profiler.timings
            parts = (sum(v["latency_full_us"] for v in profile["layers"].values())
                     + sum(profile["blocks"].values()) + profile["constant_us"])
            ratio = profile["model_latency_us"] / parts if parts > 0 else 1.0
            profile["calibration"] = ratio if calibrate else 1.0
            if not 0.5 <= ratio <= 2.0:
                warnings.warn(
                    f"latency: the timed parts of the model add up to {1 / ratio:.0%} of the timed "
                    f"whole model ({parts:,.0f} vs {profile['model_latency_us']:,.0f} us); the "
                    "timings may be unreliable (a busy machine, or more torch threads than free "
                    "cores?)", stacklevel=2)
        self.load_state_dict(profile)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The measured profile and fits (JSON-able); pass it back as ``profile=``."""
        return copy.deepcopy(self._state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Use a profile (from :meth:`state_dict`) instead of measuring."""
        if not isinstance(state, dict) or state.get("format") != "dmscale.cost.latency/1":
            got = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise DataError(f"expected a latency profile with format 'dmscale.cost.latency/1', got {got!r}")
        unknown = [n for n in state["layers"] if n not in self.space.layers]
        if unknown:
            raise DataError(f"latency profile names layers {unknown[:5]} that the search space does not have")
        self._state = copy.deepcopy(state)
        self.fits = {n: LayerFit.from_dict(n, d) for n, d in state["layers"].items()}
        self.calibration = float(state.get("calibration", 1.0))
        self.constant = float(state["constant_us"]) * self.calibration
        self._build_terms()

    def _build_terms(self) -> None:
        groups: list[np.ndarray] = []
        keys: dict[bytes, int] = {}

        def group(slots: np.ndarray | None) -> int:
            if not _searchable(slots):
                return -1
            idx = np.asarray(slots, dtype=np.int64).copy()
            idx[idx < 0] = self.space.n_slots
            key = idx.tobytes()
            if key not in keys:
                keys[key] = len(groups)
                groups.append(idx)
            return keys[key]

        rows = []
        for name, fit in self.fits.items():
            layer: LayerSlots = self.space.layers[name]
            gi = group(layer.in_slots) if "in" in fit.sides else -1
            go = group(layer.out_slots) if "out" in fit.sides else -1
            rows.append((fit.latency_full, fit.coef6(), gi, go, self._block(name)))
        for name, inner in self._state["blocks"].items():
            rows.append((inner, [1.0, 0, 0, 0, 0, 0], -1, -1, self._block(name)))
        g, b = len(groups), len(self._block_index)
        self._lat = torch.tensor([r[0] for r in rows], dtype=torch.float64) * self.calibration
        self._coef = torch.tensor([r[1] for r in rows], dtype=torch.float64).reshape(-1, 6)
        self._gi = torch.tensor([r[2] if r[2] >= 0 else g for r in rows], dtype=torch.long)
        self._go = torch.tensor([r[3] if r[3] >= 0 else g for r in rows], dtype=torch.long)
        self._depth = torch.tensor([r[4] if r[4] >= 0 else b for r in rows], dtype=torch.long)
        lengths = [len(x) for x in groups]
        self._flat = torch.from_numpy(np.concatenate(groups)) if groups else torch.zeros(0, dtype=torch.long)
        self._seg = torch.repeat_interleave(torch.arange(g), torch.tensor(lengths, dtype=torch.long)) if g \
            else torch.zeros(0, dtype=torch.long)
        self._len = torch.tensor(lengths, dtype=torch.float64)
        self._n_groups = g

    def _block(self, name: str) -> int:
        jb = self.space.block_of(name)
        return -1 if jb is None else self._block_index[jb]

    # ------------------------------------------------------------------ evaluation
    def __call__(self, width_mask: torch.Tensor, depth_mask: torch.Tensor) -> torch.Tensor:
        """Predicted latency (µs) from the width mask (n_slots + 1,) and depth mask (n_blocks,)."""
        w = width_mask.to(torch.float64)
        dev = w.device
        seg, flat, length, gi, go, coef, lat, depth = self.on(
            dev, self._seg, self._flat, self._len, self._gi, self._go, self._coef, self._lat, self._depth)
        keep = torch.zeros(self._n_groups, dtype=torch.float64, device=dev).index_add(0, seg, w[flat]) / length
        keep = torch.cat([keep, torch.ones(1, dtype=torch.float64, device=dev)])
        d = torch.cat([depth_mask.to(torch.float64).reshape(-1), torch.ones(1, dtype=torch.float64, device=dev)])
        ki, ko = keep[gi], keep[go]
        basis = torch.stack([torch.ones_like(ki), ki, ko, ki * ko, ki * ki, ko * ko], dim=1)
        f = (basis * coef).sum(dim=1)
        return (lat * f * d[depth]).sum() + self.constant

    def predict_layer(self, name: str, keep_in: float = 1.0, keep_out: float = 1.0) -> float:
        """Fitted latency (µs) of one layer at the given keep ratios (depth mask 1)."""
        fit = self.fits[name]
        keeps = [keep_in if s == "in" else keep_out for s in fit.sides]
        return float(fit.latency_full * fit(np.array([keeps]))[0])

    def fit_report(self) -> dict[str, Any]:
        """Quality of the fit and where the time goes.

        Keys: ``unit`` ("us"); ``model_latency_us`` (the whole model, timed),
        ``layers_latency_us`` / ``blocks_inner_us`` / ``constant_us`` (the parts of the
        cost at full width and depth before calibration, see the module docstring);
        ``parts_full_us`` (their sum) and ``parts_rel_error`` (its relative error against
        the timed whole model: how well the parts add up); ``calibration`` (the factor every
        term is multiplied by, 1.0 without calibration); ``predicted_full_us`` (the cost of
        the supernet) and ``full_rel_error`` (against the timed model); ``fit_rmse_rel`` (relative RMSE of
        every fitted layer latency over every grid point, in µs, pooled),
        ``fit_rmse_rel_mean`` / ``fit_rmse_rel_max`` (over layers, the mean weighted by full
        latency and the max); ``layers`` (per layer: sides, latency_full_us, rmse_rel,
        f_full = F(1, 1), the coefficients, constrained, the measured points); ``blocks``
        (each block's rest, µs); ``skipped`` (layers that could not be timed alone, whose
        time is then in the rest); ``rest_method``; and the measurement settings (device,
        threads, rounds, quantile, profile_s, ratios).
        """
        s = self._state
        layers = s["layers"]
        lat_layers = sum(v["latency_full_us"] for v in layers.values())
        lat_blocks = sum(s["blocks"].values())
        parts = lat_layers + lat_blocks + s["constant_us"]
        predicted = parts * self.calibration
        num = den = 0.0
        for n, v in layers.items():
            fit = self.fits[n]
            pts = np.array(v["points"], dtype=np.float64)
            pred = fit(pts[:, :-1])
            num += float(np.sum((v["latency_full_us"] * (pred - pts[:, -1])) ** 2))
            den += float(np.sum((v["latency_full_us"] * pts[:, -1]) ** 2))
        weights = np.array([v["latency_full_us"] for v in layers.values()])
        rmses = np.array([v["rmse_rel"] for v in layers.values()])
        out = {k: v for k, v in s.items() if k not in ("layers", "blocks", "skipped", "format")}
        out.update({
            "layers_latency_us": lat_layers,
            "blocks_inner_us": lat_blocks,
            "parts_full_us": parts,
            "calibration": self.calibration,
            "predicted_full_us": predicted,
            "full_rel_error": predicted / s["model_latency_us"] - 1.0,
            "parts_rel_error": parts / s["model_latency_us"] - 1.0,
            "fit_rmse_rel": math.sqrt(num / den) if den > 0 else 0.0,
            "fit_rmse_rel_mean": (float((weights * rmses).sum() / weights.sum())
                                  if len(weights) and weights.sum() > 0 else 0.0),
            "fit_rmse_rel_max": float(rmses.max()) if len(rmses) else 0.0,
            "layers": copy.deepcopy(layers),
            "blocks": dict(s["blocks"]),
            "skipped": dict(s["skipped"]),
        })
        return out
