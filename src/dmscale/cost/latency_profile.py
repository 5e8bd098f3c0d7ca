"""Measuring the latency model of :mod:`dmscale.cost.latency`: profile a model, fit every layer.

:class:`LatencyProfiler` times standalone copies of every profiled layer sliced to a grid of
keep ratios, every depth block, the whole model and the "rest" (the model with its profiled
layers stubbed out), interleaved over shuffled rounds, and fits per layer the monotone
quadratic F(k_in, k_out) of :func:`~dmscale.cost.polyfit.fit_monotone_poly`. Its result is the
JSON-able profile that :class:`~dmscale.cost.latency.LatencyCostModel` evaluates (format
``dmscale.cost.latency/1``); the method and its limits are described there.
"""

from __future__ import annotations

import copy
import itertools
import random
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from dmscale.trace.discover import SearchSpace
from dmscale.trace.handlers.base import Handler, handler_for
from dmscale.core.masks import detach
from dmscale.cost.polyfit import LayerFit, _basis, fit_monotone_poly
from dmscale.cost.timing import _calls_per_block, _device_of, _time_block
from dmscale.trace.values import split_inputs

__all__ = ["LatencyProfiler", "capture_inputs", "with_channels"]


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


def capture_inputs(model: nn.Module, names: list[str], outputs_of: list[str],
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


def with_channels(x: torch.Tensor, dim: int, c: int) -> torch.Tensor:
    """A tensor like x with ``c`` entries on ``dim``: random for floats, sliced otherwise."""
    shape = list(x.shape)
    shape[dim] = c
    if x.is_floating_point():
        return torch.randn(shape, dtype=x.dtype, device=x.device)
    return x.narrow(dim, 0, c).clone()



# ---------------------------------------------------------------------- profiling and fitting


class LatencyProfiler:
    """Times the parts of a model and fits the per-layer latency model (a profile).

    Args:
        space: the model's :class:`~dmscale.trace.discover.SearchSpace`.
        ratios: keep ratios of the grid on each searchable side (sorted, 1.0 included).
        quantile: the statistic of each timing's samples.

    :meth:`profile` returns the profile (see :meth:`~dmscale.cost.latency.LatencyCostModel.fit_report`
    for its keys); the raw samples (s) of the last profile are kept in ``timings``.
    """

    def __init__(self, space: SearchSpace, ratios: tuple[float, ...], quantile: float) -> None:
        self.space = space
        self.ratios = ratios
        self.quantile = quantile
        self.timings: dict[tuple[str, Any], list[float]] = {}  # raw samples (s) of the last profile

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
            x = with_channels(x, plan.handler.channel_dim, c)
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

    def profile(self, model: nn.Module, example_inputs: Any, repeats: int, warmup: int,
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
        inputs, outputs = capture_inputs(work, profiled + blocks, profiled, example_inputs)
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
        return {"format": "dmscale.cost.latency/1", "unit": "us", "layers": layers, "blocks": blocks,
                "model_latency_us": model_us, "constant_us": constant, "rest_method": method,
                "skipped": dict(skipped)}
