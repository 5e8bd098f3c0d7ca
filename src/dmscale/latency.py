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

with ``keep`` defined as in :class:`~dmscale.resources.CostModel` (mean mask over the
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
(:meth:`LatencyCostModel.fit_report`; ``bench/latency_fit.py`` measures it). The rest only
scales with depth: the time of element-wise ops and of attention cores (QK^T, AV: virtual
layers, whose heads are searched) does not shrink with width in this model. On a busy
machine, time with fewer threads than free cores: oversubscribed OpenMP threads make every
timing erratic.

Searches use it through ``dms.prepare(model, x, dms.SearchConfig(resource="latency", ...))``.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from dmscale.discover import discover
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
import itertools
import math
import random
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from .discover import LayerSlots, SearchSpace
from .resources import DeviceCache
from .tracer import split_inputs
from .handlers import Handler, handler_for
from .masks import detach
from .polyfit import LayerFit, _basis, fit_monotone_poly
from .timing import _calls_per_block, _device_of, _time_block, measure_latency

__all__ = ["LatencyCostModel", "LayerFit", "measure_latency", "fit_monotone_poly"]

_US = 1e6  # seconds -> microseconds
# Samples per round of the whole model, of each block and of the stubbed rest: longer calls
# are hit by more of a busy machine's pauses, so they get more samples (cheap: few jobs).
_LONG_SAMPLES = 5


# ---------------------------------------------------------------------- profiling plan


def _searchable(slots: np.ndarray | None) -> bool:
    return slots is not None and bool((np.asarray(slots) >= 0).any())


@dataclass
class _LayerPlan:
    name: str
    handler: Handler
    module: nn.Module  # in the detached copy
    sides: tuple[str, ...]
    tied: bool  # input channels follow the output keep (depthwise conv, norms)
    c_in: int | None
    c_out: int | None
    counts: list[tuple[int, ...]]  # per grid point, kept channels per side


@dataclass
class _Job:
    key: tuple[str, Any]
    make: Callable[[], Callable[[], Any]]
    n: int = 1
    per_round: int = 1  # timed samples per round
    round_s: float = 0.0  # estimated wall time of one round of this job
    fn: Callable[[], Any] | None = None  # the built callable, kept between rounds when cached
    samples: list[float] = field(default_factory=list)
    error: str | None = None


def _capture(model: nn.Module, names: list[str], outputs_of: list[str],
             example_inputs: Any) -> tuple[dict[str, tuple[tuple, dict]], dict[str, Any]]:
    """First-call (args, kwargs) of the ``names`` submodules, and outputs of ``outputs_of``."""
    modules = dict(model.named_modules())
    seen: dict[str, tuple[tuple, dict]] = {}
    outs: dict[str, Any] = {}
    handles = []
    clone = lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v  # noqa: E731

    def pre(name: str) -> Callable[..., None]:
        def record(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if name not in seen:  # cloned: later in-place ops of the model must not touch them
                seen[name] = (tuple(clone(a) for a in args), {k: clone(v) for k, v in kwargs.items()})
        return record

    def post(name: str) -> Callable[..., None]:
        def record(module: nn.Module, args: tuple, out: Any) -> None:
            if name not in outs:
                outs[name] = clone(out) if isinstance(out, torch.Tensor) else out
        return record

    for n in names:
        handles.append(modules[n].register_forward_pre_hook(pre(n), with_kwargs=True))
    for n in outputs_of:
        handles.append(modules[n].register_forward_hook(post(n)))
    args, kwargs = split_inputs(example_inputs)
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return seen, outs


class _Stub(nn.Module):
    """Stands in for a profiled layer: returns the layer's recorded output at no cost."""

    def __init__(self, out: Any) -> None:
        super().__init__()
        self.out = out

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.out


def _stubbed(model: nn.Module, outputs: dict[str, Any]) -> nn.Module:
    """A copy of ``model`` whose named layers are replaced by :class:`_Stub`."""
    rest = copy.deepcopy(model)
    for name, out in outputs.items():
        if not name:
            continue
        parent, _, child = name.rpartition(".")
        setattr(rest.get_submodule(parent) if parent else rest, child, _Stub(out))
    return rest


def _with_channels(x: torch.Tensor, dim: int, c: int) -> torch.Tensor:
    """A tensor like x with ``c`` entries on ``dim``: random for floats, sliced otherwise."""
    shape = list(x.shape)
    shape[dim] = c
    if x.is_floating_point():
        return torch.randn(shape, dtype=x.dtype, device=x.device)
    return x.narrow(dim, 0, c).clone()


# ---------------------------------------------------------------------- the cost model


class LatencyCostModel(DeviceCache):
    """Differentiable latency ``r_c`` (µs) of a search, fitted from per-layer measurements.

    Same call convention as :class:`~dmscale.resources.CostModel`: :meth:`__call__` takes the
    width mask (n_slots + 1, last entry 1) and the flat depth mask (n_blocks) and returns a
    float64 scalar.

    Args:
        model: the model (dmscale hooks may be attached; a detached deep copy is timed, in
            eval mode, on the model's device, with the current number of torch threads).
        space: its :class:`~dmscale.discover.SearchSpace`.
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
            raise ValueError(f"ratios must lie in (0, 1], got {ratios}")
        if repeats < 1 or warmup < 0 or budget_s <= 0 or min_block_s <= 0 or not 0 <= quantile <= 1:
            raise ValueError("need repeats >= 1, warmup >= 0, budget_s > 0, min_block_s > 0, "
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
            profile = self._profile(model, example_inputs, repeats, warmup, budget_s, min_block_s, seed)
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

    # ------------------------------------------------------------------ measuring
    def _plans(self, copy_model: nn.Module) -> list[_LayerPlan]:
        modules = dict(copy_model.named_modules())
        plans = []
        for name, layer in self.space.layers.items():
            module = modules.get(name)
            handler = None if module is None or getattr(layer, "virtual", False) else handler_for(module)
            if handler is None:  # a virtual layer (attention core): its time is in the rest
                continue
            dims = getattr(layer, "macs_sides", None)
            if dims is None:
                dims = handler.macs_dims(module)
            slots = {"in": layer.in_slots, "out": layer.out_slots}
            sides = tuple(s for s in ("in", "out") if s in dims and _searchable(slots[s]))
            if not sides:
                continue
            tied = ("in" not in sides and _searchable(layer.in_slots) and layer.out_slots is not None
                    and np.array_equal(layer.in_slots, layer.out_slots))
            c_in = None if layer.in_slots is None else len(layer.in_slots)
            c_out = None if layer.out_slots is None else len(layer.out_slots)
            sizes = [c_in if s == "in" else c_out for s in sides]
            per_side = [sorted({max(1, round(r * c)) for r in self.ratios}) for c in sizes]
            plans.append(_LayerPlan(name, handler, module, sides, tied, c_in, c_out,
                                    list(itertools.product(*per_side))))
        return plans

    def _layer_job(self, plan: _LayerPlan, counts: tuple[int, ...], inputs: tuple[tuple, dict]) -> _Job:
        args, kwargs = inputs
        k = dict(zip(plan.sides, counts))

        def make() -> Callable[[], Any]:
            m = copy.deepcopy(plan.module)
            keep_out = torch.arange(k["out"]) if "out" in k else None
            keep_in = torch.arange(k["in"]) if "in" in k else (keep_out if plan.tied else None)
            plan.handler.prune(m, keep_in, keep_out)
            x = args[0]
            c = keep_in.numel() if keep_in is not None else x.shape[plan.handler.channel_dim]
            x = _with_channels(x, plan.handler.channel_dim, c)
            rest = args[1:]
            return lambda: m(x, *rest, **kwargs)

        return _Job(("layer", (plan.name, counts)), make)

    @staticmethod
    def _cache_ok(plans: list[_LayerPlan], inputs: dict[str, tuple[tuple, dict]], limit: int = 1 << 30) -> bool:
        """Keep every sliced copy (and its input) alive between rounds if that fits in ``limit``."""
        total = 0
        for plan in plans:
            weights = sum(p.numel() * p.element_size() for p in plan.module.parameters())
            x = inputs.get(plan.name, ((None,), {}))[0]
            act = x[0].numel() * x[0].element_size() if x and isinstance(x[0], torch.Tensor) else 0
            total += (weights + act) * len(plan.counts)
        return total <= limit

    def _profile(self, model: nn.Module, example_inputs: Any, repeats: int, warmup: int,
                 budget_s: float, min_block_s: float, seed: int) -> dict[str, Any]:
        start = time.perf_counter()
        work = detach(copy.deepcopy(model))
        work.eval()
        for p in work.parameters():
            p.requires_grad_(False)
        device = _device_of(work, *split_inputs(example_inputs))
        plans = self._plans(work)
        blocks = [b.name for d in self.space.depth for b in d.blocks]
        profiled = [p.name for p in plans]
        inputs, outputs = _capture(work, profiled + blocks, profiled, example_inputs)
        jobs: list[_Job] = []
        skipped: dict[str, str] = {}
        for plan in plans:
            if plan.name not in inputs or not inputs[plan.name][0]:
                skipped[plan.name] = "not called with a positional input on the example inputs"
                continue
            jobs += [self._layer_job(plan, c, inputs[plan.name]) for c in plan.counts]
        margs, mkw = split_inputs(example_inputs)
        long = dict(per_round=_LONG_SAMPLES)
        jobs.append(_Job(("model", ""), lambda: (lambda: work(*margs, **mkw)), **long))
        # what is not a profiled layer, timed directly: the model and its blocks with every
        # profiled layer stubbed out, and the cost of one stub call
        stubs = {n: outputs[n] for n in profiled if n and n in outputs and n not in skipped}
        rest = _stubbed(work, stubs)
        jobs.append(_Job(("rest", ""), lambda: (lambda: rest(*margs, **mkw)), **long))
        for b in blocks:
            if b in inputs:
                (bargs, bkw), full_b, rest_b = inputs[b], work.get_submodule(b), rest.get_submodule(b)
                jobs.append(_Job(("block", b), lambda m=full_b, a=bargs, k=bkw: (lambda: m(*a, **k)), **long))
                jobs.append(_Job(("rest_block", b), lambda m=rest_b, a=bargs, k=bkw: (lambda: m(*a, **k)), **long))
        probe, probe_in = _Stub(torch.zeros(1)), torch.zeros(1)
        jobs.append(_Job(("stub", ""), lambda: (lambda: probe(probe_in)), **long))

        torch.manual_seed(seed)
        rng = random.Random(seed)
        cache = self._cache_ok(plans, inputs)
        with torch.no_grad():
            for job in jobs:  # calibration: build, warm up, choose the calls per sample
                try:
                    t0 = time.perf_counter()
                    fn = job.make()
                    make_s = time.perf_counter() - t0
                    for _ in range(max(1, warmup)):
                        fn()
                    t1 = _time_block(fn, 1, device)
                    job.n = _calls_per_block(t1, min_block_s)
                    job.round_s = (0.0 if cache else make_s) + (warmup + job.per_round * job.n) * t1
                    job.fn = fn if cache else None
                except Exception as exc:  # noqa: BLE001 - a layer we cannot run standalone
                    job.error = f"{type(exc).__name__}: {exc}"
            failed = {j.key[1][0] for j in jobs if j.error is not None and j.key[0] == "layer"}
            if failed & set(stubs):  # not profiled after all: put them back, their time is rest
                for name in failed & set(stubs):
                    parent, _, child = name.rpartition(".")
                    setattr(rest.get_submodule(parent) if parent else rest, child,
                            copy.deepcopy(work.get_submodule(name)))
                    del stubs[name]
                for job in jobs:  # and calibrate the rest again
                    if job.key[0] in ("rest", "rest_block") and job.error is None:
                        fn = job.make()
                        fn()
                        t1 = _time_block(fn, 1, device)
                        job.n = _calls_per_block(t1, min_block_s)
                        job.round_s = (warmup + job.per_round * job.n) * t1
                        job.fn = fn if cache else None
            live = [j for j in jobs if j.error is None and not (j.key[0] == "layer" and j.key[1][0] in failed)]
            per_round = max(sum(j.round_s for j in live), 1e-6)
            left = budget_s - (time.perf_counter() - start)
            rounds = int(max(min(3, repeats), min(repeats, left // per_round)))
            done = 0
            while done < rounds:
                rng.shuffle(live)
                for job in live:
                    fn = job.fn if job.fn is not None else job.make()
                    for _ in range(warmup):
                        fn()
                    for _ in range(job.per_round):
                        job.samples.append(_time_block(fn, job.n, device))
                done += 1
                if done >= min(2, rounds) and time.perf_counter() - start > budget_s:
                    break  # the machine is slower than calibration said: stop at the budget
            rounds = done
        for job in jobs:
            if job.error is not None and job.key[0] == "layer":
                skipped.setdefault(job.key[1][0], job.error)
            job.fn = None
        self.timings = {j.key: list(j.samples) for j in jobs if j.samples}
        lat = {k: float(np.quantile(v, self.quantile)) * _US for k, v in self.timings.items()}
        if ("model", "") not in lat:
            raise RuntimeError("latency profiling failed: the model itself could not be timed")
        state = self._fit(plans, lat, skipped, list(stubs))
        state.update({
            "device": str(device), "threads": torch.get_num_threads(), "rounds": rounds,
            "profile_s": time.perf_counter() - start, "ratios": list(self.ratios),
            "n_timings": len(live), "quantile": self.quantile, "cached": cache,
        })
        if skipped:
            warnings.warn(f"latency: {len(skipped)} layer(s) not profiled (their time is in the "
                          f"constant): {dict(list(skipped.items())[:3])}", stacklevel=3)
        return state

    def _fit(self, plans: list[_LayerPlan], lat: dict[tuple[str, Any], float],
             skipped: dict[str, str], stubbed: list[str]) -> dict[str, Any]:
        layers: dict[str, dict[str, Any]] = {}
        for plan in plans:
            if plan.name in skipped:
                continue
            full_counts = tuple(plan.c_in if s == "in" else plan.c_out for s in plan.sides)
            full = lat[("layer", (plan.name, full_counts))]
            if not full > 0:  # nothing measurable (a timer that reports 0): no cost
                continue
            sizes = np.array(full_counts, dtype=np.float64)
            x = np.array([np.array(c, dtype=np.float64) / sizes for c in plan.counts])
            y = np.array([lat[("layer", (plan.name, c))] / full for c in plan.counts])
            degrees = [min(2, len(set(x[:, v].tolist())) - 1) for v in range(len(plan.sides))]
            # Fit the shape on every point, then take the full-width latency from the fit
            # (F(1, 1) = 1 by renormalising): less noisy than its single measurement.
            exps, coef, constrained = fit_monotone_poly(x, y, degrees, anchor=False)
            f1 = float(coef.sum())  # every monomial is 1 at full width
            if f1 > 0:
                coef, y, full = coef / f1, y / f1, full * f1
            else:
                exps, coef, constrained = fit_monotone_poly(x, y, degrees, anchor=True)
            rmse = float(np.sqrt(np.mean((_basis(exps, x) @ coef - y) ** 2)))
            points = [tuple(row) + (float(v),) for row, v in zip(x.tolist(), y.tolist())]
            fit = LayerFit(plan.name, plan.sides, full, exps, coef, rmse, constrained, points).to_dict()
            fit["latency_full_measured_us"] = lat[("layer", (plan.name, full_counts))]
            layers[plan.name] = fit
        model_us = lat[("model", "")]
        block_of = {b.name: self.space.block_of(b.name) for d in self.space.depth for b in d.blocks}
        blocks: dict[str, float] = {}
        if ("rest", "") in lat:  # measured directly on the stubbed model
            stub = lat.get(("stub", ""), 0.0)
            n_in = {b: sum(1 for n in stubbed if self.space.block_of(n) == jb) for b, jb in block_of.items()}
            for b in block_of:
                if ("rest_block", b) in lat:
                    blocks[b] = max(0.0, lat[("rest_block", b)] - n_in[b] * stub)
            outside = len(stubbed) - sum(n_in[b] for b in blocks)
            rest_blocks = sum(lat[("rest_block", b)] for b in blocks)
            constant = max(0.0, lat[("rest", "")] - rest_blocks - outside * stub)
            method = "stubbed"
        else:  # the stubbed model could not run: whole minus parts
            for b, jb in block_of.items():
                if ("block", b) in lat:
                    inside = sum(v["latency_full_us"] for n, v in layers.items() if self.space.block_of(n) == jb)
                    blocks[b] = max(0.0, lat[("block", b)] - inside)
            attributed = sum(v["latency_full_us"] for v in layers.values()) + sum(blocks.values())
            constant = max(0.0, model_us - attributed)
            method = "subtracted"
        return {"format": "dmscale.latency/1", "unit": "us", "layers": layers, "blocks": blocks,
                "model_latency_us": model_us, "constant_us": constant, "rest_method": method,
                "skipped": dict(skipped)}

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The measured profile and fits (JSON-able); pass it back as ``profile=``."""
        return copy.deepcopy(self._state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Use a profile (from :meth:`state_dict`) instead of measuring."""
        if not isinstance(state, dict) or state.get("format") != "dmscale.latency/1":
            got = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"expected a latency profile with format 'dmscale.latency/1', got {got!r}")
        unknown = [n for n in state["layers"] if n not in self.space.layers]
        if unknown:
            raise ValueError(f"latency profile names layers {unknown[:5]} that the search space does not have")
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
