"""The step loop every phase of a run uses: one place for batches, forward and loss,
backward and optimizer steps, the non-finite skip, stop signals, checkpoints and metrics.

A :class:`StepLoop` trains one model for ``total`` steps of one phase (pretrain, search,
finish, retrain), resuming from the run's checkpoint of that phase. Its parts, in the order
of a step:

====================  ===================================================================
:meth:`batch`         batch ``step`` of the task, a pure function of ``(seed, step)``
:meth:`forward_loss`  forward and task loss (+ distillation) under the run's autocast,
                      then the resource loss (full precision, outside autocast)
:meth:`skip_non_finite`  a NaN / infinite loss: no backward, the step changes nothing
:meth:`backward_and_step`  zero grads, backward, optimizer steps (through the GradScaler
                      for fp16: an overflow skips *every* optimizer and leaves the
                      importance buffers as they were), schedulers
:meth:`checkpoint`    model, searcher, optimizers, schedulers, scaler, RNG states, step
====================  ===================================================================

Under torchrun (a process group of N > 1 ranks, :mod:`dmscale.engine.ddp`) :meth:`run`
trains through DistributedDataParallel (a model sharded by :mod:`dmscale.engine.fsdp` as it
is), :meth:`batch` takes this rank's B/N share of the global batch of B (so ``--batch-size``
and the learning rates mean what they mean in one process), :meth:`backward_and_step` calls
``searcher.sync_importance()`` after every backward (importance from the global batch's mask
gradients), the non-finite skip and the stop signals are decided by all ranks together, and
only rank 0 writes files or prints (:attr:`writes_files`). Every rank holds the same
structure and RNG state, and the same model (or its shard of it).

Evaluations during a phase (``--eval-every``, the best weights) are :mod:`dmscale.engine.evaluation`;
a ``host.logger`` (``--logger``) gets each record's scalars (:mod:`dmscale.engine.loggers`).

The loop talks to its run through :class:`LoopHost` (a :class:`dmscale.run.context.RunContext`):
configuration, task, device, precision, run directory, state and step counter.

Example:
    >>> import tempfile, torch
    >>> from dmscale.config.run_config import RunConfig
    >>> from dmscale.run.pipeline import Pipeline
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     cfg = RunConfig(command="pretrain", task="digits", train_limit=64, test_limit=32,
    ...                     model="smallcnn", model_args={"width": 4, "blocks": 1},
    ...                     batch_size=32, quiet=True, out=tmp + "/run", precision="bf16")
    ...     pipe = Pipeline(cfg)
    ...     pipe.ctx.rd.path.mkdir(parents=True)
    ...     model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    ...     opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ...     StepLoop(pipe.ctx, "pretrain", model, total=3, optimizers=[opt]).run()
    ...     pipe.ctx.global_step, model[1].weight.dtype
    (3, torch.float32)
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
from torch import nn

from dmscale.core.errors import NonFiniteLossError
from dmscale.engine.ddp import agreed_signal, any_rank, mean_over_ranks, shard_of_this_rank, wrap_model
from dmscale.engine.device import Precision, compiled_forward
from dmscale.engine.evaluation import PhaseWatch
from dmscale.engine.loggers import log_step
from dmscale.engine.fsdp import load_model_state, load_optimizer_state, model_state, optimizer_state, \
    sync_replicated_grads
from dmscale.engine.rundir import CHECKPOINT_VERSION, Progress, RunDir, StopOnSignals, Stopped, fmt_count, rng_state, \
    set_rng_state

__all__ = ["LoopHost", "MAX_NON_FINITE_STEPS", "StepLoop", "StepOutput"]

MAX_NON_FINITE_STEPS = 3  # a run stops after this many consecutive non-finite losses


class LoopHost(Protocol):
    """What a :class:`StepLoop` needs from its run (a :class:`dmscale.run.context.RunContext`)."""

    cfg: Any  # RunConfig: batch_size, seed, stop_after, checkpoint_every, compile, quiet
    task: Any  # Task: train_batch, forward, task_loss, batch_metric, steps_per_epoch
    device: torch.device
    precision: Precision
    rd: RunDir
    state: dict[str, Any]
    global_step: int

    def elapsed(self) -> float: ...

    def save_state(self, **updates: Any) -> None: ...

    def checkpoint_for(self, phase: str) -> dict[str, Any] | None: ...

    def evaluate(self, phase: str, model: nn.Module, searcher: Any, step: int,
                 limit: int | None = None, extra: dict[str, Any] | None = None) -> dict[str, float]: ...


@dataclass
class StepOutput:
    """What :meth:`StepLoop.forward_loss` computed for one step."""

    loss: torch.Tensor
    task_loss: torch.Tensor
    logits: torch.Tensor
    record: dict[str, Any]
    progress: float = 1.0
    resource_loss: torch.Tensor | None = None  # the search's term of ``loss`` (None: no search)


@dataclass
class StepLoop:
    """Train ``model`` for ``total`` steps of ``phase`` (see the module text).

    Args:
        host: the run (configuration, task, device, precision, files, step counter).
        phase: ``pretrain``, ``search``, ``finish`` or ``retrain``; ``search`` schedules the
            target with ``step / total``, ``finish`` pushes on the calibrated cost.
        optimizers / schedulers: stepped in this order every step.
        searcher: the :class:`dmscale.Searcher` of a search phase (adds the resource loss).
        distill: distillation from a frozen teacher, ``distill(task, model, x) -> (logits,
            [(name, weight, loss), ...])`` (a :class:`dmscale.tasks.registry.Distillation`):
            the weighted terms are added to the task loss, each recorded under its name.
        until: stop the phase early once this returns True (checked after every step).
        seed: batches are ``task.train_batch(step, batch_size, seed)``.
    """

    host: LoopHost
    phase: str
    model: nn.Module
    total: int
    optimizers: list[torch.optim.Optimizer]
    schedulers: list[Any] = field(default_factory=list)
    searcher: Any = None
    distill: Callable[[Any, nn.Module, torch.Tensor], tuple[torch.Tensor, list[tuple[str, float, torch.Tensor]]]] | None = None
    until: Callable[[], bool] | None = None
    seed: int = 0
    trace: Any = None  # a dmscale.search.search_trace.SearchTrace: .step() around traced backwards
    _non_finite: int = field(default=0, init=False)  # consecutive non-finite losses (skipped)
    _net: nn.Module | None = field(default=None, init=False)  # the model, in DDP under torchrun
    _wrapped_frozen: bool = field(default=False, init=False)  # depth frozen when _net was built

    @property
    def writes_files(self) -> bool:
        """Whether this process writes metrics and checkpoints (DDP: rank 0 only)."""
        return bool(getattr(self.host.rd, "writes", True))

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        """All remaining steps of the phase; raises :class:`Stopped` at ``--stop-after`` or
        on SIGINT / SIGTERM, after writing a checkpoint."""
        cfg, host = self.host.cfg, self.host
        start = self.restore()
        scaler = host.precision.scaler
        if self.searcher is not None and scaler is not None:
            self.searcher.use_grad_scaler(scaler)  # importance from unscaled gradients
        watch = PhaseWatch(host, self.phase, self.model, self.searcher, self.total)  # --eval-every
        log_every = max(1, self.total // 300)
        self.model.train()
        bar = Progress(self.phase, self.total, start, cfg.quiet or not self.writes_files)
        signals = StopOnSignals().__enter__()  # SIGINT/SIGTERM: checkpoint, then stop
        try:
            with compiled_forward(self.model, bool(getattr(cfg, "compile", False))):
                for step in range(start, self.total):
                    self.stop_if_asked(step, signals)
                    self.wrap_for(step)
                    x, y = self.batch(step)
                    out = self.forward_loss(step, x, y)
                    if self.skip_non_finite(out, step):
                        continue
                    with self.trace.step(self.phase, step + 1, self.total, out) if self.trace else nullcontext():
                        self.backward_and_step(out.loss, step)
                    host.global_step += 1
                    done = step + 1
                    if done % log_every == 0 or done == self.total or step == start:
                        self.log(out, y, done, bar)
                    watch.after_step(done)
                    if done % cfg.checkpoint_every == 0 and done < self.total:
                        self.checkpoint(done)
                    if self.until is not None and self.until():
                        bar.finish_early(done)
                        break
        finally:
            signals.__exit__()
            bar.close()
            # Drop the DDP wrapper while the process group lives: a Stopped run's traceback keeps it past
            # destroy_process_group, whose reducer then aborts at exit ("terminate called without ...").
            self._net = None

    def wrap_for(self, step: int) -> None:
        """The model in DDP (under torchrun) for ``step``, the structural ``a`` averaged with
        the weights. DDP leaves out what needs no gradient when it is built, so when the
        searcher freezes depth (the settle phase landed, or the width-only phase began; decided
        here, before the forward) the model is wrapped again without depth's ``a``: no step has
        a parameter without a gradient, and ``find_unused_parameters`` is never needed."""
        if self.searcher is not None and self.phase == "search":
            self.searcher.advance(step / self.total)
        frozen = self.searcher is not None and self.searcher.gates.depth_frozen
        if self._net is None or frozen != self._wrapped_frozen:
            self._net = None  # the old wrapper's reducer goes first
            self._net = wrap_model(self.model, self.host.device)
            self._wrapped_frozen = frozen

    def stop_if_asked(self, step: int, signals: StopOnSignals) -> None:
        """A signal arrived or ``--stop-after`` is reached: checkpoint, then :class:`Stopped`."""
        host = self.host
        stop_after = host.cfg.stop_after
        received = agreed_signal(signals.received)  # every rank stops at the same step
        if received is None and (stop_after is None or host.global_step < stop_after):
            return
        self.checkpoint(step)
        host.save_state(status="stopped")
        raise Stopped(host.rd.path, host.global_step, signal=received)

    # ------------------------------------------------------------------ one step
    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch ``step`` on the device (DDP: this rank's shard of it; a task with
        ``shards_by_rank`` returns only that shard, and it is not cut again)."""
        task = self.host.task
        x, y = task.train_batch(step, self.host.cfg.batch_size, self.seed)
        if not getattr(task, "shards_by_rank", False):
            x, y = shard_of_this_rank((x, y))
        device = self.host.device
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    def forward_loss(self, step: int, x: torch.Tensor, y: torch.Tensor) -> StepOutput:
        """Task loss (+ distillation) under autocast, + the resource loss of a search."""
        cfg, task = self.host.cfg, self.host.task
        record: dict[str, Any] = {}
        with self.host.precision.autocast():
            net = self._net if self._net is not None else self.model  # DDP-wrapped when distributed
            if self.distill is not None:
                logits, terms = self.distill(task, net, x)
            else:
                logits, terms = task.forward(net, x), []
            task_loss = task.task_loss(logits, y)
            loss = task_loss
            for name, weight, value in terms:
                loss = loss + weight * value
                record[name] = float(value.detach())
        progress, r_loss = 1.0, None
        if self.searcher is not None:
            progress = step / self.total if self.phase == "search" else 1.0
            if self.phase == "finish":
                r_loss = self.searcher.budget.calibrated_loss(cfg.resource_weight)
            else:
                r_loss = self.searcher.resource_loss(progress=progress)
            loss = loss + r_loss
            record["resource_loss"] = float(r_loss.detach())
        return StepOutput(loss, task_loss, logits, record, progress, r_loss)

    def skip_non_finite(self, out: StepOutput, step: int) -> bool:
        """A NaN or infinite loss: skip the step (no backward, so neither weights, importance
        nor structural parameters see it); stop when it keeps happening."""
        if not any_rank(not bool(torch.isfinite(out.loss.detach()).all())):  # skipped on all ranks
            self._non_finite = 0
            return False
        host = self.host
        self._non_finite += 1
        host.global_step += 1
        value = mean_over_ranks([float(out.loss.detach())])[0]  # all ranks are here: non-finite
        host.rd.append_metrics({"phase": self.phase, "event": "non_finite_loss", "step": step + 1,
                                "global_step": host.global_step, "loss": str(value)})
        if self._non_finite >= MAX_NON_FINITE_STEPS:
            raise NonFiniteLossError(
                f"the {self.phase} loss was not finite ({value}) for {self._non_finite} steps "
                f"in a row, up to step {step + 1}; those steps were skipped and changed nothing. "
                "Start again with a lower --lr (or --structure-lr, --resource-weight), or check "
                "the data for NaN or infinite values")
        return True

    def backward_and_step(self, loss: torch.Tensor, step: int) -> bool:
        """Backward and one step of every optimizer and scheduler; returns False when the
        GradScaler found non-finite gradients and no optimizer stepped."""
        for o in self.optimizers:
            o.zero_grad(set_to_none=True)
        if not loss.requires_grad:  # nothing trains this step: frozen weights and depth alone, settled
            for sch in self.schedulers:
                sch.step()
            return True
        scaler = self.host.precision.scaler
        stepped = True
        if scaler is None:
            loss.backward()
            self._sync_importance()
            for o in self.optimizers:
                o.step()
        else:
            stepped = self._scaled_step(loss, scaler, step)
        for sch in self.schedulers:
            sch.step()
        return stepped

    def _scaled_step(self, loss: torch.Tensor, scaler: Any, step: int) -> bool:
        """fp16: scaled backward; an overflow in *any* optimizer's gradients skips all of them
        (weights and structural parameters alike), restores the importance buffers the
        backward hooks may have updated, and lowers the scale."""
        kept = self._importance_snapshot()
        scaler.scale(loss).backward()
        self._sync_importance()  # before the overflow check: a restore must find nothing pending
        for o in self.optimizers:
            scaler.unscale_(o)
        checks = [scaler._found_inf_per_device(o) for o in self.optimizers]
        overflow = any(float(v.item()) > 0 for found in checks for v in found.values())
        if overflow:
            for buf, old in kept:
                buf.copy_(old)
        else:
            for o, found in zip(self.optimizers, checks):
                if found:  # an optimizer none of whose parameters got a gradient has nothing to do
                    scaler.step(o)
        scale = scaler.get_scale()
        if any(checks):
            scaler.update()
        else:  # nothing was unscaled: forget this step's (empty) bookkeeping
            scaler._per_optimizer_states.clear()
        if overflow:
            self.host.rd.append_metrics({"phase": self.phase, "event": "grad_overflow", "step": step + 1,
                                         "global_step": self.host.global_step + 1, "scale": scale,
                                         "new_scale": scaler.get_scale()})
        return not overflow

    def _sync_importance(self) -> None:
        """DDP / FSDP: importance from the global batch's mask gradients (one all-reduce; FSDP:
        one more averages the replicated ``a``'s gradients); a no-op in one process. An overflow
        is seen alike on all ranks (DDP averages the gradients before the scaler sees them)."""
        sync_replicated_grads(self.model)
        if self.searcher is not None:
            self.searcher.sync_importance()

    def _importance_snapshot(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self.searcher is None:
            return []
        return [(b, b.detach().clone()) for b in self.searcher.gates.buffers() if b.is_floating_point()]

    # ------------------------------------------------------------------ records
    def log(self, out: StepOutput, y: torch.Tensor, done: int, bar: Progress) -> None:
        """One line of ``metrics.jsonl`` and the progress bar's text."""
        host, task = self.host, self.host.task
        record = out.record
        loss, task_loss, acc = mean_over_ranks([float(out.loss.detach()), float(out.task_loss.detach()),
                                                task.batch_metric(out.logits.detach(), y)])
        record.update(phase=self.phase, step=done, global_step=host.global_step,
                      time=round(host.elapsed(), 2), loss=loss, task_loss=task_loss, train_acc=acc)
        if self.optimizers and self.optimizers[0].param_groups:
            record["lr"] = self.optimizers[0].param_groups[0]["lr"]
        text = f"loss {task_loss:.3f}"
        if self.searcher is not None:
            res = self.searcher.resources()
            record.update(cost_soft=res["soft"], cost_hard=res["hard"],
                          cost_target=self.searcher.budget.target_at(out.progress),
                          cost_final=res["target"], cost_supernet=res["supernet"])
            text += (f" | {res['resource']} {fmt_count(res['hard'])} "
                     f"(target now {fmt_count(record['cost_target'])}, "
                     f"final {fmt_count(res['target'])})")
            for name, b in (res.get("budgets") or {}).items():  # several budgets: every one's
                record[f"cost_hard_{name}"], record[f"cost_final_{name}"] = b["hard"], b["target"]
                if name != res["resource"]:
                    text += f", {name} {fmt_count(b['hard'])} (final {fmt_count(b['target'])})"
        if self.writes_files:
            host.rd.append_metrics(record)
            log_step(getattr(host, "logger", None), host.global_step, record, self.searcher)
        bar.update(done, text)

    # ------------------------------------------------------------------ checkpoints
    def checkpoint(self, step: int) -> None:
        """Write everything a resumed run needs to compute exactly what this one would."""
        host = self.host
        host.state["elapsed"] = host.elapsed()
        host.state["global_step"] = host.global_step
        model = model_state(self.model)  # FSDP: the full state, gathered on rank 0 (every rank takes part)
        optimizers = [optimizer_state(self.model, o) for o in self.optimizers]
        if not self.writes_files:
            return
        state = {
            "version": CHECKPOINT_VERSION, "phase": self.phase, "step": step,
            "global_step": host.global_step, "model": model,
            "searcher": self.searcher.state_dict() if self.searcher is not None else None,
            "optimizers": optimizers,
            "schedulers": [s.state_dict() for s in self.schedulers],
            "rng": rng_state(), "metrics_offset": host.rd.metrics_size(),
            "state": copy.deepcopy(host.state),
        }
        if host.precision.scaler is not None:
            state["scaler"] = host.precision.state_dict()
        host.rd.save_checkpoint(state)

    def restore(self) -> int:
        """Load this phase's checkpoint, if the run has one; returns the step to start at."""
        ck = self.host.checkpoint_for(self.phase)
        if ck is None:
            return 0
        load_model_state(self.model, ck["model"])
        if self.searcher is not None:
            self.searcher.load_state_dict(ck["searcher"])
        for o, s in zip(self.optimizers, ck["optimizers"]):
            load_optimizer_state(self.model, o, s)
        for sch, s in zip(self.schedulers, ck["schedulers"]):
            sch.load_state_dict(s)
        self.host.precision.load_state_dict(ck.get("scaler"))
        set_rng_state(ck["rng"])
        return int(ck["step"])
