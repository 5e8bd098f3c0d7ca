"""The search phase: search a supernet's structure under the run's budget, finish it on the
budget, export the found model.

:class:`SearchPhase` builds the supernet (pipeline np: a new one; p / p-: the pretrained one)
and its teacher, the searcher (:func:`dmscale.prepare` of the run's
:class:`~dmscale.SearchConfig`), the optimisers (the weights' SGD or AdamW; the structural
parameters' Adam, its lr annealed to 0 by the settle phase; in ``p-`` only the structural
parameters train) and runs the search's steps. Then the *finish* (:meth:`SearchPhase.finish`):
structure-only steps at the final target until the hard cost is under it (at most
:data:`FINISH_STEPS`), then the budget solver (``searcher.meet_target()``) when the cost is
still over the target or under the low end of the search's ``budget_band`` (default 0.98) x
target. The exported model's BatchNorm statistics are re-estimated
(:func:`~dmscale.run.training.calibrate_on_task`) before it is evaluated; the phase writes
``structure.json`` and ``model.safetensors`` (and ``RUN/hf`` for an ``hf:`` run without a
retraining).

Two extension points, for a caller that runs the pipeline with another search (a baseline's
gate, another importance metric) or records what the search does:

* ``overrides``: fields of the run's :class:`~dmscale.SearchConfig` to replace
  (``{"gate_factory": ...}``);
* ``hooks``: a :class:`SearchHooks`, each called with the searcher: after it is built,
  before the finish, before the budget solver, after the finish.

Example:
    >>> calls = []
    >>> hooks = SearchHooks(built=lambda s: calls.append("built"), solver=lambda s: calls.append("solver"))
    >>> phase = SearchPhase(overrides={"importance": "taylor"}, hooks=hooks)
    >>> phase.name, phase.overrides, hooks.finished is None
    ('search', {'importance': 'taylor'}, True)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from torch import nn

import dmscale as dms

from dmscale.core.errors import NoImportanceError
from dmscale.engine.fsdp import export_search
from dmscale.engine.rundir import fmt_count
from dmscale.run.context import PhaseResult, RunContext
from dmscale.run.model_checks import check_hf, check_teacher, save_hf
from dmscale.run.report import posthoc_line, reach_hint
from dmscale.run.saved_runs import load_teacher, make_searcher, new_supernet
from dmscale.run.supernets import evaluate_original, pretrained_supernet, record_supernet, start_weights
from dmscale.run.training import calibrate_on_task, cosine_schedule, shard, train, weight_optimizer
from dmscale.tasks.hf_model import is_hf_model
from dmscale.tasks.start_weights import starts_from_weights

__all__ = ["FINISH_STEPS", "SearchHooks", "SearchPhase", "record_resource_extras", "run_search_config"]

FINISH_STEPS = 300  # structure-only steps allowed after the search to get under the target

SearcherHook = Callable[[dms.Searcher], None]


@dataclass
class SearchHooks:
    """Observers of a run's search, each called with the searcher (None: not called). They
    may read the searcher (or wrap its methods on the instance); the run must compute what
    it computes without them."""

    built: SearcherHook | None = None  # the searcher is built, before the first step
    finish: SearcherHook | None = None  # the search's steps are done, before the finish steps
    solver: SearcherHook | None = None  # the budget solver is about to run
    finished: SearcherHook | None = None  # the structure is final, before the export


def run_search_config(cfg: Any, exclude: list[str], overrides: dict[str, Any] | None = None) -> dms.SearchConfig:
    """The library config of the search of ``cfg`` (its options by name), with ``overrides``
    (fields of :class:`~dmscale.SearchConfig`) replaced."""
    scfg = cfg.search_config(exclude)
    return replace(scfg, **overrides) if overrides else scfg


def record_resource_extras(ctx: RunContext, searcher: dms.Searcher) -> None:
    """What each budgeted resource adds to the run's state after the search (its registry entry's
    ``run_note``: for latency the fit of its model, ``state["latency_fit"]``), said on stderr."""
    for note in searcher.costs.run_notes():
        ctx.state[note.key] = note.state
        ctx.log(note.line)


class SearchPhase:
    """The search of a run, its finish and its export (see the module text).

    Args:
        overrides: fields of the run's :class:`~dmscale.SearchConfig` to replace.
        hooks: observers of the searcher (:class:`SearchHooks`).
    """

    name = "search"

    def __init__(self, overrides: dict[str, Any] | None = None, hooks: SearchHooks | None = None) -> None:
        self.overrides = dict(overrides or {})
        self.hooks = hooks or SearchHooks()

    def _call(self, hook: SearcherHook | None, searcher: dms.Searcher) -> None:
        if hook is not None:
            hook(searcher)

    def make_searcher(self, ctx: RunContext, model: nn.Module, extra_exclude: list[str]) -> dms.Searcher:
        """The searcher of ``model`` with the run's search options (and ``overrides``)."""
        searcher = make_searcher(ctx.cfg, model, ctx.example, extra_exclude,
                                 lambda exclude: run_search_config(ctx.cfg, exclude, self.overrides))
        self._call(self.hooks.built, searcher)
        return searcher

    def _supernet(self, ctx: RunContext) -> tuple[nn.Module, list[str]]:
        """The supernet the search starts from and the model's own exclusions."""
        cfg = ctx.cfg
        if cfg.pipeline in ("p", "p-"):
            model, extra_exclude = pretrained_supernet(ctx)
            as_loaded = cfg.init is None and "pretrain" not in ctx.phases and not starts_from_weights(cfg)
            evaluate_original(ctx, model if as_loaded else None)
            return model, extra_exclude
        model, extra_exclude = new_supernet(cfg, ctx.task.info, cfg.seed)
        if ctx.checkpoint_for("search") is None and ctx.checkpoint_for("finish") is None:
            evaluate_original(ctx, model)
            start_weights(ctx, model)
        return model, extra_exclude

    def _teacher(self, ctx: RunContext, model: nn.Module) -> nn.Module | None:
        """The frozen teacher (``--teacher`` with a distillation term), kept in ``ctx`` for the
        retrain phase of this run: one frozen copy."""
        cfg = ctx.cfg
        if not (cfg.teacher and cfg.distills):
            return None
        teacher = load_teacher(cfg.teacher, ctx.device, supernet=model if cfg.pipeline in ("p", "p-") else None)
        check_teacher(ctx, teacher, model)
        ctx.teacher = teacher
        return teacher

    def run(self, ctx: RunContext) -> PhaseResult:
        cfg = ctx.cfg
        model, extra_exclude = self._supernet(ctx)
        check_hf(cfg, model)
        model.to(ctx.device)
        record_supernet(ctx, model)
        teacher = self._teacher(ctx, model)
        searcher = self.make_searcher(ctx, model, extra_exclude)
        shard(cfg, model, searcher, teacher)
        s_opt = torch.optim.Adam(list(searcher.structure_parameters()), lr=cfg.structure_lr, weight_decay=0.0)
        total = ctx.steps(cfg.epochs)
        # settle phase: the structural lr anneals to 0 (step k uses the factor of progress k / total)
        s_sched = torch.optim.lr_scheduler.LambdaLR(
            s_opt, lambda k: searcher.structure_lr_scale((k + 1) / max(1, total)))
        if cfg.pipeline == "p-":
            for prm in searcher.model_parameters():
                prm.requires_grad_(False)
            optimizers, schedulers = [s_opt], [s_sched]
        else:
            w_opt = weight_optimizer(cfg, list(searcher.model_parameters()))
            optimizers, schedulers = [w_opt, s_opt], [cosine_schedule(cfg, w_opt, total), s_sched]
        if ctx.checkpoint_for("finish") is None:
            train(ctx, "search", model, total, optimizers, schedulers, searcher, teacher)
        self.finish(ctx, model, searcher, teacher, s_opt)
        if not searcher.has_importance():  # every step skipped (non-finite loss or gradients)
            raise NoImportanceError(
                f"the search ran {total} steps but none updated importance (each was skipped for a "
                "non-finite loss or gradient, see metrics.jsonl), so it found no structure (an "
                "export would keep the first channels of every layer); no structure.json was written: "
                "search again with more --epochs, a lower --lr or --precision 32")
        return self._export(ctx, searcher, total)

    def _export(self, ctx: RunContext, searcher: dms.Searcher, total: int) -> PhaseResult:
        """``structure.json``, the found model (BatchNorm re-estimated, evaluated) and the
        resources it costs."""
        cfg, result = ctx.cfg, PhaseResult(wrote=["structure.json"])
        ctx.rd.write_json("structure.json", searcher.structure())
        small = export_search(searcher)  # --shard fsdp: on rank 0 only, gathered on the CPU
        if small is not None:
            small.to(ctx.device)
            calibrate_on_task(small, ctx.task, cfg.batch_size, cfg.seed * 10 + 5, ctx.device)
            metrics = ctx.watch.phase_result(ctx, "search", small, total, ctx.evaluate("search", small, None, total))
            ctx.state["evals"]["search"] = metrics
            ctx.state["evals"]["final"] = metrics
            ctx.save_weights(small, "model.safetensors")
            ctx.state["counts"]["found"] = dms.count(small, ctx.example)
            result.metrics = metrics
            result.wrote.append("model.safetensors")
        if is_hf_model(cfg.model) and "retrain" not in ctx.phases:
            save_hf(ctx, small)  # on every rank (rank 0 writes)
            result.wrote.append("hf")
        ctx.state["resources"] = searcher.resources()
        record_resource_extras(ctx, searcher)
        return result

    def finish(self, ctx: RunContext, model: nn.Module, searcher: dms.Searcher, teacher: nn.Module | None,
               s_opt: torch.optim.Optimizer) -> None:
        """Structure-only steps at the final target until the hard cost is under it; then the
        budget solver when the cost is still over, or under ``budget_band[0]`` x target (a
        budget left unused is capacity the found model could have had)."""
        self._call(self.hooks.finish, searcher)
        under = searcher.budget.within  # every budget at or under its target
        if ctx.checkpoint_for("finish") is None:
            end = ctx.state["resources_search_end"] = searcher.resources()
            hint = reach_hint(ctx.cfg.structure_lr, ctx.steps(ctx.cfg.epochs), end["hard"] / end["target"])
            if hint:
                ctx.state["warnings"].append(hint)
        if ctx.checkpoint_for("finish") is not None or not under():
            self._finish_steps(ctx, model, searcher, teacher, s_opt)
        if not under() or not searcher.budget.fills():  # common shift of every ratio, then refill
            self._call(self.hooks.solver, searcher)
            searcher.meet_target()
        moved = posthoc_line(ctx.state.get("resources_search_end"), searcher.resources())
        if moved:
            ctx.log(moved)
        if not under():
            _warn_over_budget(ctx, searcher.resources())
        self._call(self.hooks.finished, searcher)

    def _finish_steps(self, ctx: RunContext, model: nn.Module, searcher: dms.Searcher,
                      teacher: nn.Module | None, s_opt: torch.optim.Optimizer) -> None:
        """At most :data:`FINISH_STEPS` structure-only steps (weights frozen, the structural lr
        restored), until every budget is met."""
        for group in s_opt.param_groups:  # the settle phase annealed it to 0
            group["lr"] = ctx.cfg.structure_lr
        frozen = [p for p in searcher.model_parameters() if p.requires_grad]
        for prm in frozen:
            prm.requires_grad_(False)
        try:
            train(ctx, "finish", model, FINISH_STEPS, [s_opt], [], searcher, teacher, until=searcher.budget.within)
        finally:
            for prm in frozen:
                prm.requires_grad_(True)


def _warn_over_budget(ctx: RunContext, res: dict[str, Any]) -> None:
    """A warning for each budget the found model is still over."""
    for name, b in res.get("budgets", {res["resource"]: res}).items():
        if b["hard"] > b["target"] * (1 + 1e-9):
            ctx.state["warnings"].append(
                f"the found model costs {fmt_count(b['hard'])} {name}, over the target "
                f"{fmt_count(b['target'])}: raise --resource-weight or --structure-lr, or search longer")
