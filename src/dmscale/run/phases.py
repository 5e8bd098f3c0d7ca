"""The phases of a ``dmscale`` run: pretrain, search (+ its finish), retrain.

:class:`Phases` is mixed into :class:`dmscale.run.pipeline.Pipeline`, which runs the phases in
order, keeps the run's state and checkpoints and owns the step loop; a phase builds its
models, optimisers and teacher, trains through ``self._train`` and writes its outputs. What a
phase reads from the pipeline: ``cfg``, ``task``, ``device``, ``example``, ``phases``,
``state``, ``rd`` (the :class:`~dmscale.engine.rundir.RunDir`), ``checkpoint_for``,
``_steps``, ``_weight_optimizer``, ``_schedule``, ``_train``, ``evaluate``, ``_phase_result``
(:mod:`dmscale.run.watching`: the best weights), ``_save_weights`` and ``_log``.

After the search, the *finish* (``Phases._finish_search``) runs structure-only steps at the
final target until the hard cost is under it (at most ``FINISH_STEPS``), then the budget
solver when the cost is still over the target or under the low end of the search's
``budget_band`` (default 0.98) x target; the exported model's
BatchNorm statistics are re-estimated (:func:`calibrate_on_task`: the library's
:func:`dmscale.recalibrate_batchnorm` on the task's training batches) before it is evaluated.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

import dmscale as dms

from dmscale.config.run_config import ConfigError, load_run_config
from dmscale.engine.fsdp import export_search, shard_frozen, shard_model, unsharded
from dmscale.core.distributed import all_reduce_mean
from dmscale.engine.rundir import RunDir, fmt_count
from dmscale.core.errors import NoImportanceError
from dmscale.run.report import posthoc_line, reach_hint
from dmscale.run.saved_runs import (
    load_run_model,
    load_teacher,
    load_weights,
    make_searcher,
    new_supernet,
    search_config,
)
from dmscale.engine.ddp import on_all_ranks
from dmscale.tasks.hf_model import check_gguf_run, check_hf_dir, is_hf_model, save_hf_outputs
from dmscale.tasks.distill import kept_hidden_channels
from dmscale.tasks.registry import Task
from dmscale.tasks.start_weights import load_start_weights, load_weights_file, starts_from_weights

__all__ = ["Phases", "calibrate_on_task", "FINISH_STEPS", "BN_CALIBRATION_BATCHES"]

FINISH_STEPS = 300  # structure-only steps allowed after the search to get under the target
BN_CALIBRATION_BATCHES = 20  # batches that re-estimate BatchNorm statistics of the export


def calibrate_on_task(model: nn.Module, task: Task, batch_size: int, seed: int,
                      device: torch.device | str = "cpu", n_batches: int = BN_CALIBRATION_BATCHES) -> int:
    """Re-estimate the running statistics of every BatchNorm layer of ``model`` on training
    batches (no gradients, weights untouched); returns the number of layers.

    The statistics a supernet collects during the search are those of soft masks (channels
    scaled by 0.5 - 0.9, blocks partly on); the exported model computes hard-masked
    activations, so its inherited running statistics are off until re-estimated.

    Under torchrun a task that loads only this rank's share of each batch
    (``task.shards_by_rank``) gives every rank the statistics of its shares; they are then
    averaged over the ranks (the means are the global batches' means), so every rank holds
    the same statistics.
    """
    def batches():
        for step in range(n_batches):
            x, _ = task.train_batch(step, batch_size, seed)
            yield x.to(device)

    with torch.random.fork_rng(devices=[]):
        n = dms.recalibrate_batchnorm(model, batches(), forward=task.forward)
    if getattr(task, "shards_by_rank", False):
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
                all_reduce_mean(m.running_mean)
                all_reduce_mean(m.running_var)
    return n



def load_init(model: nn.Module, init: str, model_name: str | None) -> nn.Module:
    """``model`` with the weights of ``--init``: a ``dmscale pretrain`` run directory's model,
    or a weights file."""
    p = Path(init)
    if p.is_dir():
        src = load_run_config(p)
        if src.command != "pretrain":
            raise ConfigError(f"--init {p}: expected a `dmscale pretrain` run, got a "
                              f"`dmscale {src.command}` run")
        return load_weights(model, p / "model.safetensors")
    return load_weights_file(model, str(p), "--init", f"--model {model_name}")

class Phases:
    """The phases of a run, as methods ``_phase_<name>`` of :class:`dmscale.run.pipeline.Pipeline`
    (see the module docstring for what they read from it)."""

    def _start_weights(self, model: nn.Module) -> None:
        """Load ``--weights`` / ``--pretrained`` into the supernet a phase starts from (never
        into one a checkpoint restores), and say so."""
        text = load_start_weights(model, self.cfg, self.task.info)
        if text:
            self._log(text)
            self.state["start_weights"] = text

    def _phase_pretrain(self) -> None:
        cfg = self.cfg
        model, _ = new_supernet(cfg, self.task.info, cfg.seed)
        if self.checkpoint_for("pretrain") is None:
            self._evaluate_original(model)  # an hf: model as loaded, before --weights
            self._start_weights(model)
        self._check_hf(model)
        model.to(self.device)
        self._record_supernet(model)
        self._shard(model)
        epochs = cfg.epochs if cfg.command == "pretrain" else cfg.pretrain_epochs
        total = self._steps(epochs)
        opt = self._weight_optimizer(list(model.parameters()))
        sch = self._schedule(opt, total)
        self._train("pretrain", model, total, [opt], [sch])
        metrics = self._phase_result("pretrain", model, total, self.evaluate("pretrain", model, None, total))
        self.state["evals"]["pretrain"] = metrics
        full = unsharded(model)  # --shard fsdp: gathered on rank 0, None on the other ranks
        self._save_weights(full, "supernet.safetensors")
        if cfg.command == "pretrain":
            self._save_weights(full, "model.safetensors")
            self.state["counts"]["found"] = self.state["counts"]["supernet"]

    def _evaluate_original(self, model: nn.Module | None = None) -> None:
        """An ``hf:`` run's original model -- the pretrained model as loaded, before any step --
        evaluated once on the same held-out tokens as the found model (``--test-limit``
        applies), so that the summary can say what pruning cost ("original -> found"). Kept
        in the state (and so in every checkpoint): a resumed run does not evaluate it again.
        ``model``: the model as loaded, when the phase holds it (else it is loaded here)."""
        if not is_hf_model(self.cfg.model) or "original" in self.state:
            return
        if model is None:
            with torch.random.fork_rng(devices=[]):
                model = new_supernet(self.cfg, self.task.info, self.cfg.seed)[0]
        model.to(self.device)
        self.state["original"] = self.evaluate("original", model, None, 0)
        self._log(f"original model: {self.task.format_metrics(self.state['original'])}")
        self.save_state()

    def _check_hf(self, model: nn.Module) -> None:
        """An ``hf:`` search or retrain ends by writing ``RUN/hf`` (and ``RUN/model.gguf``): refuse
        before the first step a model that could not be written (:func:`check_hf_dir`)."""
        if is_hf_model(self.cfg.model) and self.cfg.command != "pretrain":
            check_hf_dir(model, self.cfg.model, self.cfg.layer_uniform, self.cfg.depth_unit)
            if self.cfg.export == "gguf":
                check_gguf_run(model, self.cfg.model, self.cfg.layer_uniform)

    def _shard(self, model: nn.Module, searcher: dms.Searcher | None = None,
               teacher: nn.Module | None = None) -> None:
        """``--shard fsdp``: shard ``model`` in place, before its optimisers are built
        (:func:`~dmscale.engine.fsdp.shard_model`; in one process there is nothing to shard),
        and the frozen ``teacher`` (:func:`~dmscale.engine.fsdp.shard_frozen`, once per run).
        Under ``--precision bf16`` the model's weights are gathered in bfloat16 and the
        teacher's stored in bfloat16 (not for models with BatchNorm layers)."""
        if self.cfg.shard == "fsdp":
            dtype = torch.bfloat16 if self.cfg.precision == "bf16" else None
            shard_model(model, space=searcher.space if searcher is not None else None, param_dtype=dtype)
            if teacher is not None:
                shard_frozen(teacher, param_dtype=dtype)

    def _record_supernet(self, model: nn.Module) -> None:
        if "supernet" not in self.state["counts"]:
            c = dms.count(model, self.example)
            c["parameters_total"] = sum(p.numel() for p in model.parameters())
            self.state["counts"]["supernet"] = c

    def _pretrained_supernet(self) -> tuple[nn.Module, list[str]]:
        """The supernet with pretrained weights (pretrain phase output, --init, or without a
        pretraining the weights the run starts from), and the model's own exclusions."""
        cfg = self.cfg
        model, exclude = new_supernet(cfg, self.task.info, cfg.seed)
        if cfg.init is None and "pretrain" not in self.phases:
            if not starts_from_weights(cfg):  # hf:PATH, pretrained as loaded
                return model, exclude
            if not (self.rd / "supernet.safetensors").is_file():  # loaded once, then the run's own
                self._start_weights(model)
                self._save_weights(model, "supernet.safetensors")
                return model, exclude
        if cfg.init is None:
            return load_weights(model, self.rd / "supernet.safetensors"), exclude
        return load_init(model, cfg.init, cfg.model), exclude

    def _searched_supernet(self, source: RunDir) -> nn.Module:
        """``dmscale retrain RUN --retrain-init pretrained``: the pretrained supernet the p search
        ``RUN`` started from (its ``supernet.safetensors``, else the weights of its ``--init``)."""
        found = self._source_supernet(source)
        init = load_run_config(source.path).init
        if found is None and init is not None:
            found = load_init(new_supernet(self.cfg, self.task.info, self.cfg.seed)[0], init, self.cfg.model)
        if found is None:
            raise ConfigError(f"--retrain-init pretrained: {source.path} holds no pretrained supernet "
                              "(supernet.safetensors, or an --init); retrain with --retrain-init inherit or scratch")
        return found

    def _source_supernet(self, source: RunDir) -> nn.Module | None:
        """``dmscale retrain --teacher supernet``: the pretrained supernet the run at ``source``
        searched -- its ``supernet.safetensors``, or for an ``hf:`` model searched without
        pretraining the model as loaded; None when neither applies (a random supernet, or
        one pretrained elsewhere: give that run as ``--teacher``)."""
        cfg = self.cfg
        src = load_run_config(source.path)
        if src.pipeline not in ("p", "p-"):
            return None
        if (source / "supernet.safetensors").is_file():
            return load_weights(new_supernet(cfg, self.task.info, cfg.seed)[0], source / "supernet.safetensors")
        if is_hf_model(cfg.model) and src.init is None:
            return new_supernet(cfg, self.task.info, cfg.seed)[0]
        return None

    def search_config(self, exclude: list[str]) -> dms.SearchConfig:
        """The library config of this run's search (a subclass may change it, e.g. the gate of
        a baseline)."""
        return search_config(self.cfg, exclude)

    def _make_searcher(self, model: nn.Module, extra_exclude: list[str]) -> dms.Searcher:
        return make_searcher(self.cfg, model, self.example, extra_exclude, self.search_config)

    def _phase_search(self) -> None:
        cfg = self.cfg
        pretrained = cfg.pipeline in ("p", "p-")
        if pretrained:
            model, extra_exclude = self._pretrained_supernet()
            as_loaded = cfg.init is None and "pretrain" not in self.phases and not starts_from_weights(cfg)
            self._evaluate_original(model if as_loaded else None)
        else:
            model, extra_exclude = new_supernet(cfg, self.task.info, cfg.seed)
            if self.checkpoint_for("search") is None and self.checkpoint_for("finish") is None:
                self._evaluate_original(model)
                self._start_weights(model)
        self._check_hf(model)
        model.to(self.device)
        self._record_supernet(model)
        teacher = None
        if cfg.teacher and cfg.distills:
            teacher = load_teacher(cfg.teacher, self.device, supernet=model if pretrained else None)
            self._check_teacher(teacher, model)
            self._teacher = teacher  # kept for the retrain phase of this run: one frozen copy
        searcher = self._make_searcher(model, extra_exclude)
        self._shard(model, searcher, teacher)
        s_opt = torch.optim.Adam(list(searcher.structure_parameters()), lr=cfg.structure_lr,
                                 weight_decay=0.0)
        total = self._steps(cfg.epochs)
        # settle phase: the structural lr anneals to 0 (step k uses the factor of progress k / total)
        s_sched = torch.optim.lr_scheduler.LambdaLR(
            s_opt, lambda k: searcher.structure_lr_scale((k + 1) / max(1, total)))
        if cfg.pipeline == "p-":
            for prm in searcher.model_parameters():
                prm.requires_grad_(False)
            optimizers, schedulers = [s_opt], [s_sched]
        else:
            w_opt = self._weight_optimizer(list(searcher.model_parameters()))
            optimizers, schedulers = [w_opt, s_opt], [self._schedule(w_opt, total), s_sched]
        if self.checkpoint_for("finish") is None:
            self._train("search", model, total, optimizers, schedulers, searcher, teacher)
        self._finish_search(model, searcher, teacher, s_opt)
        if not searcher.has_importance():  # every step skipped (non-finite loss or gradients)
            raise NoImportanceError(
                f"the search ran {total} steps but none updated importance (each was skipped for a "
                "non-finite loss or gradient, see metrics.jsonl), so it found no structure (an "
                "export would keep the first channels of every layer); no structure.json was written: "
                "search again with more --epochs, a lower --lr or --precision 32")
        self.rd.write_json("structure.json", searcher.structure())
        small = export_search(searcher)  # --shard fsdp: on rank 0 only, gathered on the CPU
        if small is not None:
            small.to(self.device)
            calibrate_on_task(small, self.task, cfg.batch_size, cfg.seed * 10 + 5, self.device)
            metrics = self._phase_result("search", small, total, self.evaluate("search", small, None, total))
            self.state["evals"]["search"] = metrics
            self.state["evals"]["final"] = metrics
            self._save_weights(small, "model.safetensors")
            self.state["counts"]["found"] = dms.count(small, self.example)
        if is_hf_model(cfg.model) and "retrain" not in self.phases:
            self._save_hf(small)  # on every rank (rank 0 writes)
        self.state["resources"] = searcher.resources()
        if cfg.resource == "latency":
            fit = searcher.latency_fit()
            self.state["latency_fit"] = {k: fit[k] for k in ("fit_rmse_rel", "fit_rmse_rel_max",
                                                             "parts_rel_error", "calibration")}
            self._log(f"latency model: fit error {fit['fit_rmse_rel']:.1%} (pooled relative RMSE, "
                      f"worst layer {fit['fit_rmse_rel_max']:.1%}); the parts add up to the timed "
                      f"model within {fit['parts_rel_error']:+.1%}, calibration x{fit['calibration']:.3f}")

    def _check_teacher(self, teacher: nn.Module, model: nn.Module,
                       structure: dict | None = None) -> list[int] | None:
        """Refuse a teacher whose outputs cannot be compared with ``model``'s; returns the
        teacher's hidden channels that ``model`` kept when ``--distill-hidden`` compares them
        at those channels (``model`` an export of ``structure`` with a pruned hidden size),
        else None."""
        a, b = self._on_example(self.task.forward, model, teacher)
        if a.shape != b.shape:
            raise ConfigError(f"--teacher {self.cfg.teacher}: its logits have shape {tuple(b.shape)}, "
                              f"the model's {tuple(a.shape)}")
        if self.cfg.distill_hidden > 0:
            return self._check_hidden(teacher, model, structure)
        return None

    def _on_example(self, forward: Any, model: nn.Module, teacher: nn.Module) -> tuple[Any, Any]:
        """``forward(model, example)`` in eval mode (``model``'s mode restored after) and
        ``forward(teacher, example)``, without gradients."""
        with torch.no_grad():
            was = model.training
            model.eval()
            a = forward(model, self.example)
            model.train(was)
            return a, forward(teacher, self.example)

    def _check_hidden(self, teacher: nn.Module, model: nn.Module,
                      structure: dict | None = None) -> list[int] | None:
        """``--distill-hidden``: both forwards return hidden states of the same width, or the
        model's are the teacher's at the kept channels ``structure`` records
        (:func:`~dmscale.tasks.distill.kept_hidden_channels`), which are returned."""
        (_, h_s), (_, h_t) = self._on_example(self.task.forward_hidden, model, teacher)
        d_s, d_t = h_s[-1].shape[-1], h_t[-1].shape[-1]
        if d_s == d_t:
            return None
        found = kept_hidden_channels(model, structure)
        if found is None:
            why = ("no structure says which of the teacher's channels the model kept"
                   if structure is None else
                   "the run's structure.json does not record which hidden channels the model kept")
        elif found[1] != d_t:
            why = (f"the run's structure.json keeps {len(found[0])} of a supernet's {found[1]} hidden "
                   f"channels, not of the teacher's {d_t}")
        elif len(found[0]) != d_s or max(found[0], default=-1) >= d_t:
            why = (f"the run's structure.json keeps {len(found[0])} hidden channels, the model "
                   f"has {d_s}")
        else:
            return found[0]
        raise ConfigError(
            f"--distill-hidden: the model's hidden size {d_s} differs from the teacher's {d_t} "
            f"and {why}, so their hidden states cannot be compared: distil from the model the "
            "search started from (--teacher supernet in the run that searched, or a teacher "
            "of the supernet's hidden size), keep the hidden size (--exclude "
            "lm.model.embed_tokens for an hf: model) or use --distill-hidden 0")

    def _finish_search(self, model: nn.Module, searcher: dms.Searcher, teacher: nn.Module | None,
                       s_opt: torch.optim.Optimizer) -> None:
        """Structure-only steps at the final target until the hard cost is under it; then the
        budget solver when the cost is still over, or under ``budget_band[0]`` x target (a
        budget left unused is capacity the found model could have had)."""
        def under() -> bool:  # every budget at or under its target
            return searcher.within_budgets()

        def filled() -> bool:  # every budget at or over budget_band[0] x its target
            return searcher.fills_budgets()

        if self.checkpoint_for("finish") is None:
            end = self.state["resources_search_end"] = searcher.resources()
            hint = reach_hint(self.cfg.structure_lr, self._steps(self.cfg.epochs), end["hard"] / end["target"])
            if hint:
                self.state["warnings"].append(hint)
        if self.checkpoint_for("finish") is not None or not under():
            for group in s_opt.param_groups:  # the settle phase annealed it to 0
                group["lr"] = self.cfg.structure_lr
            frozen = [p for p in searcher.model_parameters() if p.requires_grad]
            for prm in frozen:
                prm.requires_grad_(False)
            try:
                self._train("finish", model, FINISH_STEPS, [s_opt], [], searcher, teacher, until=under)
            finally:
                for prm in frozen:
                    prm.requires_grad_(True)
        if not under() or not filled():  # common shift of every ratio, then refill unit by unit
            searcher.meet_target()
        moved = posthoc_line(self.state.get("resources_search_end"), searcher.resources())
        if moved:
            self._log(moved)
        if not under():
            res = searcher.resources()
            for name, b in res.get("budgets", {res["resource"]: res}).items():
                if b["hard"] > b["target"] * (1 + 1e-9):
                    self.state["warnings"].append(
                        f"the found model costs {fmt_count(b['hard'])} {name}, over the target "
                        f"{fmt_count(b['target'])}: raise --resource-weight or --structure-lr, or search longer")

    def _phase_retrain(self) -> None:
        cfg = self.cfg
        source = RunDir(cfg.source) if cfg.command == "retrain" else self.rd
        structure = source.read_json("structure.json")
        if structure is None:
            raise ConfigError(f"{source.path} has no structure.json: run `dmscale search` first")
        if cfg.command == "retrain" and not (self.rd / "structure.json").exists():
            self.rd.write_json("structure.json", structure)
        if cfg.command == "retrain" and "original" not in self.state:  # the searched run's original
            original = (source.read_json("state.json") or {}).get("original")
            if original is not None:
                self.state["original"] = original
        if cfg.retrain_init == "inherit":
            model, _ = load_run_model(source.path)
        elif cfg.retrain_init == "pretrained":  # the kept channels of the weights before the search
            model = self._pretrained_supernet()[0] if cfg.command == "search" else self._searched_supernet(source)
            dms.apply_structure(model, structure)
        else:
            model, _ = new_supernet(cfg, self.task.info, cfg.seed * 7 + 1)
            dms.apply_structure(model, structure)
        self._check_hf(model)
        model.to(self.device)
        if "supernet" not in self.state["counts"]:
            counts = (source.read_json("state.json") or {}).get("counts", {})
            if "supernet" in counts:
                self.state["counts"]["supernet"] = counts["supernet"]
            else:
                with torch.random.fork_rng(devices=[]):
                    self._record_supernet(new_supernet(cfg, self.task.info, cfg.seed)[0])
        self.state["counts"]["found"] = dms.count(model, self.example)
        teacher = getattr(self, "_teacher", None)
        if cfg.teacher and cfg.distills and teacher is None:
            sup = None
            if cfg.teacher == "supernet":
                sup = self._pretrained_supernet()[0] if cfg.command == "search" else self._source_supernet(source)
            teacher = load_teacher(cfg.teacher, self.device, supernet=sup, copy_supernet=False)
        channels = None
        if teacher is not None:
            channels = self._check_teacher(teacher, model, structure)
        epochs = cfg.epochs if cfg.command == "retrain" else cfg.retrain_epochs
        total = self._steps(epochs)
        self._shard(model, teacher=teacher)
        opt = self._weight_optimizer(list(model.parameters()))
        sch = self._schedule(opt, total)
        self._train("retrain", model, total, [opt], [sch], teacher=teacher, teacher_channels=channels)
        metrics = self._phase_result("retrain", model, total, self.evaluate("retrain", model, None, total))
        self.state["evals"]["retrain"] = metrics
        self.state["evals"]["final"] = metrics
        full = unsharded(model)  # --shard fsdp: gathered on rank 0, None on the other ranks
        self._save_weights(full, "model.safetensors")
        if is_hf_model(cfg.model):
            self._save_hf(full)

    def _save_hf(self, model: nn.Module | None) -> None:
        """``RUN/hf`` (and ``RUN/model.gguf`` with ``--export gguf``): the found model of an
        ``hf:`` run. Called on every rank, rank 0 writes: its error is every rank's."""
        cfg, tok = self.cfg, getattr(self.task, "tokenizer", None)
        lines = on_all_ranks(lambda: [] if not self.rd.writes or model is None else save_hf_outputs(
            model, self.rd.path, cfg.model, cfg.export, cfg.gguf_type, tokenizer=tok))
        for line in lines:
            self._log(line)
