"""DMS inside the Hugging Face ``Trainer``: :class:`DMSTrainer` (or :class:`DMSTrainerMixin`).

Why a small ``Trainer`` subclass, not a ``TrainerCallback`` or ``compute_loss_func``:

* **The optimiser group.** The structural parameters need a group of their own (own lr, no
  weight decay) *before* the Trainer builds its LR scheduler and loads a checkpoint's
  optimizer state. Callbacks first run after both (``on_train_begin``), so a group added
  there is unknown to the scheduler and breaks ``resume_from_checkpoint``. The subclass adds
  it in ``create_optimizer``.
* **The resource loss.** It depends only on the structural parameters, so it gets its own
  backward, right after the Trainer's own in ``training_step``, through
  ``accelerator.backward``: the same fp16 loss scale (unscaled together with every other
  gradient), the same gradient clipping, and divided by the micro-batches of one step
  (summed over gradient accumulation it counts once per optimizer step). A callback's
  ``on_pre_optimizer_step`` comes after clipping and after unscaling only when clipping is
  on, so its gradient would be scaled wrongly in fp16 without clipping. Adding the term in
  ``compute_loss`` would also pollute the logged training loss and the evaluation loss and
  depend on whether the Trainer divides the loss by the accumulation steps (it does not
  when the model normalises by ``num_items_in_batch``).
* **Progress** r_t follows ``state.global_step / state.max_steps``.
* **Checkpoints** hold the weights without the gates (layer-uniform dims share one ratio,
  which ``save_pretrained`` refuses as untied shared tensors) and ``dms_search.pt`` (the
  searcher's ``state_dict``), loaded back by ``resume_from_checkpoint``.
* **Export** after ``train()``: :meth:`~dmscale.search.searcher.Searcher.meet_target`, ``export()``,
  and (rank 0) :func:`dmscale.save_pretrained` into ``export_dir`` (``from_pretrained``
  loads it), or :func:`dmscale.save` for a model that is not a Hugging Face causal LM.

Use the mixin with a ``Trainer`` subclass you already have (e.g. TRL's ``SFTTrainer``):
``class MyTrainer(DMSTrainerMixin, SFTTrainer): pass``.

Distributed: under DDP the extra backward runs after the Trainer's gradient all-reduce, so
it only adds locally; its gradient is the same on every rank (a function of the replicated
``a`` alone). Importance is averaged by ``Searcher.sync_importance`` once per optimizer step,
when the searcher offers it. A search that freezes depth part-way (the settle phase, on by
default, or the width-only phase) leaves depth's ``a`` without a gradient from then on, which
DDP tolerates only with ``find_unused_parameters``: when ``ddp_find_unused_parameters`` is
left at None, :class:`DMSTrainer` sets it to True (the Trainer's own default is False with
activation checkpointing); under DDP it refuses an explicit False and ``ddp_static_graph``.
Activation checkpointing must be the non-reentrant kind (transformers 5's default; the
reentrant kind recomputes a layer with the first forward's masks, whose graph is freed): an
explicit ``use_reentrant=True`` is refused.

Sharded: ``TrainingArguments(fsdp=True, fsdp_config={"version": 2})`` (accelerate's FSDP2 plugin,
transformers' default version) works: the ``dms_gates`` submodule is added to the plugin's
ignored modules (the structural parameters stay whole on every rank), the sharded model is
adopted after accelerate's ``fully_shard`` (:func:`dmscale.engine.fsdp_adopt.adopt_sharded`), the
gradients of ``a`` are averaged once per optimizer step, and the export gathers the whole model
on rank 0 (``found_model`` is None on the other ranks). FSDP1 (``"version": 1``),
``cpu_ram_efficient_loading`` and DeepSpeed (any ZeRO stage) are refused, each with its reason
(:mod:`dmscale.integrations._sharding`).

Example::

    import torch, transformers, dmscale as dms
    from dmscale.integrations.hf_trainer import DMSTrainer

    model = transformers.AutoModelForCausalLM.from_pretrained("...")   # or from a config
    example = {"input_ids": torch.randint(0, model.config.vocab_size, (1, 16))}
    trainer = DMSTrainer(
        model=model, args=transformers.TrainingArguments("out", max_steps=500),
        train_dataset=dataset,
        search_config=dms.SearchConfig(resource="params", target=0.5, layer_uniform=True),
        example_inputs=example, structure_lr=0.01, export_dir="out/found")
    trainer.train()             # searches; then exports and saves "out/found"
    small = trainer.found_model  # the physically smaller model
    transformers.AutoModelForCausalLM.from_pretrained("out/found")
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
from torch import nn

from dmscale.core._compat import ensure_torchvision
from dmscale.core.errors import ConfigError
from dmscale.core.masks import GATES_NAME, detach
from dmscale.search.searcher import SearchConfig, Searcher, prepare
from dmscale.engine.fsdp import sharded, sync_replicated_grads
from dmscale.engine.fsdp_adopt import adopt_sharded
from dmscale.integrations._sharding import deepspeed_error, keep_gates_replicated
from dmscale.integrations._search_steps import (add_structure_group, check_ddp_finds_unused, depth_may_freeze, export_and_save,
                            frozen_depth_error, lazy_class, pin_structure_lr, require, static_graph_error)

__all__ = ["DMSTrainerMixin", "DMSTrainer", "SEARCH_STATE"]

SEARCH_STATE = "dms_search.pt"  # the searcher's state_dict in each Trainer checkpoint
_HF_FIX = "pass TrainingArguments(ddp_find_unused_parameters=True)"


class DMSTrainerMixin:
    """Adds a DMS search to a ``transformers.Trainer`` (subclass); see the module docs.

    Keyword arguments (all others go to the Trainer):
        searcher: a :class:`~dmscale.search.searcher.Searcher` already attached to the model (or to
            one of its submodules) with :func:`dmscale.prepare`; or
        search_config, example_inputs: attach one here (``dms.prepare(model, ...)``).
        structure_lr: the structural parameters' learning rate (kept constant; the Trainer's
            LR schedule applies to the weights only).
        export_dir: where the found model is saved after ``train()`` (None: not saved;
            ``trainer.found_model`` holds it either way).
        meet_target: bring the hard structure to the budget before the export.
    """

    def __init__(self, *args: Any, searcher: Searcher | None = None,
                 search_config: SearchConfig | None = None, example_inputs: Any = None,
                 structure_lr: float = 0.01, export_dir: str | os.PathLike[str] | None = None,
                 meet_target: bool = True, **kwargs: Any) -> None:
        model = kwargs.get("model", args[0] if args else None)
        if not isinstance(model, nn.Module):
            raise TypeError(f"{type(self).__name__} needs model=<an nn.Module>, got {type(model).__name__}")
        if not structure_lr > 0:
            raise ConfigError(f"structure_lr must be > 0, got {structure_lr}")
        created = searcher is None
        if searcher is None:
            if search_config is None or example_inputs is None:
                raise ConfigError(f"{type(self).__name__}: pass searcher=dms.prepare(model, ...), or "
                                  "search_config=dms.SearchConfig(...) with example_inputs=<a batch the "
                                  "model accepts, e.g. {'input_ids': ...}>")
            searcher = prepare(model, example_inputs, search_config)
        elif not any(m is searcher.model for m in model.modules()):
            raise ConfigError(f"the searcher is attached to a {type(searcher.model).__name__} that is not "
                              f"part of the trained {type(model).__name__}: prepare the model you pass "
                              "to the Trainer (or one of its submodules)")
        self.searcher = searcher
        self.structure_lr = float(structure_lr)
        self.export_dir = export_dir
        self.meet_target = meet_target
        self.found_model: nn.Module | None = None
        self._dms_log: dict[str, float] = {}
        self._ddp_checked = False
        try:
            training_args = _training_args(args, kwargs)
            _non_reentrant_checkpointing(training_args)
            _let_ddp_find_unused(training_args, searcher)
        except ValueError:
            if created:
                detach(searcher.model)  # refused: the user's model as it came
            raise
        super().__init__(*args, **kwargs)
        self._shard_frame: nn.Module | None = None  # under FSDP2: the export's frame, taken before sharding
        try:
            if getattr(self, "is_deepspeed_enabled", False):
                raise deepspeed_error("TrainingArguments(deepspeed=...)")
            if getattr(self.args, "fsdp_plugin_args", None) is not None and not getattr(self, "is_fsdp_enabled", False):
                warnings.warn("TrainingArguments ask for FSDP, but accelerate did not enable it (accelerate 1.x "
                              "enables its FSDP plugin on GPUs and other accelerators, not on the CPU): the "
                              "Trainer runs DDP, each rank holding the whole model", stacklevel=2)
            if getattr(self, "is_fsdp_enabled", False):
                self._shard_frame = keep_gates_replicated(self.accelerator.state.fsdp_plugin, model, searcher,
                                                          self.accelerator.device)
        except ValueError:
            if created:
                detach(searcher.model)
            raise
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None:  # fp16: importance from unscaled gradients
            searcher.use_grad_scaler(scaler)

    # ------------------------------------------------------------------ Trainer hooks
    def create_optimizer(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's optimizer, with the structural parameters in a group of their own."""
        optimizer = super().create_optimizer(*args, **kwargs)  # type: ignore[misc]
        add_structure_group(optimizer, self.searcher, self.structure_lr)
        return optimizer

    def progress(self) -> float:
        """r_t's progress: ``global_step / max_steps`` in [0, 1]."""
        state = self.state  # type: ignore[attr-defined]
        return min(1.0, state.global_step / max(1, state.max_steps))

    def training_step(self, model: nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's step (task loss, backward), then the resource loss's own backward."""
        if not self._ddp_checked:  # the Trainer wraps the model in DDP (or shards it) inside train()
            check_ddp_finds_unused(model, self.searcher, _HF_FIX)
            if self._shard_frame is not None and sharded(self.searcher.model) is None:
                adopt_sharded(self.searcher.model, self._shard_frame)  # accelerate's fully_shard
            self._ddp_checked = True
        loss = super().training_step(model, inputs, *args, **kwargs)  # type: ignore[misc]
        progress = self.progress()
        pin_structure_lr(self.optimizer, self.structure_lr,  # type: ignore[attr-defined]
                         self.searcher.structure_lr_scale(progress))
        resource = self.searcher.resource_loss(progress)
        if resource.requires_grad:  # zero (no graph) while the cost is under r_t
            steps = getattr(self, "current_gradient_accumulation_steps", None)  # transformers >= 4.46
            steps = max(1, int(steps or self.args.gradient_accumulation_steps))  # type: ignore[attr-defined]
            self.accelerator.backward(resource / steps)  # type: ignore[attr-defined]
        if self.accelerator.sync_gradients:  # type: ignore[attr-defined]
            # last micro-batch of the step: under FSDP, average the gradients of the replicated
            # structural parameters (DDP does it in the backward); importance over the ranks
            # (Searcher.sync_importance)
            sync_replicated_grads(self.searcher.model)
            self.searcher.sync_importance()
            self._dms_log = {"dms_resource_loss": float(resource.detach())}
        return loss

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's logs, plus the resource loss and the cost (fractions of the supernet)."""
        if "loss" in logs and self._dms_log:  # training logs only
            res = self.searcher.resources()
            sup = self.searcher.supernet_cost
            logs = {**logs, **self._dms_log, "dms_cost_soft": res["soft"] / sup,
                    "dms_cost_hard": res["hard"] / sup, "dms_target_now": self.searcher.budget.target_at(self.progress()) / sup}
        super().log(logs, *args, **kwargs)  # type: ignore[misc]

    def _save(self, output_dir: str | None = None, state_dict: dict[str, Any] | None = None) -> None:
        """Checkpoints: the model's weights without the gates (``save_pretrained`` refuses the
        ratios that layer-uniform dims share), and the search state in ``dms_search.pt``."""
        if state_dict is None:
            state_dict = self.model.state_dict()  # type: ignore[attr-defined]
        state_dict = {k: v for k, v in state_dict.items() if GATES_NAME + "." not in k}
        super()._save(output_dir, state_dict=state_dict)  # type: ignore[misc]
        out = output_dir if output_dir is not None else self.args.output_dir  # type: ignore[attr-defined]
        if self.args.should_save:  # type: ignore[attr-defined]
            torch.save(self.searcher.state_dict(), os.path.join(out, SEARCH_STATE))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, *args: Any, **kwargs: Any) -> None:
        """The Trainer's weights (loaded non-strict: the gates are not in them), then the search state."""
        super()._load_from_checkpoint(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]
        path = os.path.join(resume_from_checkpoint, SEARCH_STATE)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{resume_from_checkpoint} has no {SEARCH_STATE}: it was not written by "
                                    f"{type(self).__name__}, so the search state (ratios, importance) is lost; "
                                    "resume from a checkpoint of this search")
        self.searcher.load_state_dict(torch.load(path, map_location="cpu", weights_only=False))

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's ``train()``, then the export (``found_model``, saved to ``export_dir``)."""
        output = super().train(*args, **kwargs)  # type: ignore[misc]
        self.found_model = self.export_found()
        return output

    def export_found(self) -> nn.Module | None:
        """Export the found model now and save it (main process only) to ``export_dir``.
        Under FSDP every rank calls it (the whole model is gathered on rank 0, on the CPU, and
        exported there); ranks other than 0 get None."""
        was = self.searcher.model.training
        try:
            small = export_and_save(self.searcher, self.export_dir, meet_target=self.meet_target,
                                    save=bool(self.args.should_save),  # type: ignore[attr-defined]
                                    tokenizer=getattr(self, "processing_class", None))
        finally:
            self.searcher.model.train(was)
        return small


def _training_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The ``TrainingArguments`` among the Trainer's arguments (by duck type: trainers built on
    ``Trainer`` take them at different positions), or None (the Trainer makes its default)."""
    if kwargs.get("args") is not None:
        return kwargs["args"]
    return next((a for a in args if hasattr(a, "ddp_find_unused_parameters")), None)


def _let_ddp_find_unused(args: Any, searcher: Searcher) -> None:
    """``args.ddp_find_unused_parameters`` True when the search freezes depth part-way and the
    user left it to the Trainer (None); under DDP an explicit False or ``ddp_static_graph`` is
    refused."""
    if args is None or not hasattr(args, "ddp_find_unused_parameters") or not depth_may_freeze(searcher):
        return
    distributed = getattr(args, "world_size", 1) > 1
    if args.ddp_find_unused_parameters is None:
        args.ddp_find_unused_parameters = True  # depth's a has no gradient once depth is frozen
    elif not args.ddp_find_unused_parameters and distributed:
        raise frozen_depth_error(_HF_FIX)
    if not distributed:
        return
    if getattr(args, "ddp_static_graph", None):
        raise static_graph_error("pass TrainingArguments(ddp_static_graph=False)")


def _non_reentrant_checkpointing(args: Any) -> None:
    """Activation checkpointing during a search must be the non-reentrant kind: the reentrant
    kind recomputes a layer's forward inside the backward with the masks of the first forward,
    whose graph the backward has already freed ("Trying to backward through the graph a second
    time", measured with transformers 4.46 and 5.24). Asked for explicitly, it is refused;
    where it is left to torch (kwargs without ``use_reentrant``), the non-reentrant kind is set
    (transformers 5's own default)."""
    if args is None or not (getattr(args, "activation_checkpointing", None)
                            or getattr(args, "gradient_checkpointing", None)):
        return
    names = [n for n in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs") if hasattr(args, n)]
    for name in names:
        kw = getattr(args, name)
        if isinstance(kw, dict) and kw.get("use_reentrant") is True:
            raise ConfigError(
                f"DMS search with reentrant activation checkpointing ({name}={{'use_reentrant': True}}) "
                "fails in the backward: the recomputed forward reuses the masks of the first one, whose "
                f"graph is already freed; pass TrainingArguments({name}={{'use_reentrant': False}}) "
                "(transformers 5's default), or turn activation checkpointing off")
    for name in names:  # kwargs given without use_reentrant: torch's default would decide
        kw = getattr(args, name)
        if isinstance(kw, dict) and "use_reentrant" not in kw:
            setattr(args, name, {**kw, "use_reentrant": False})


def _build_trainer() -> type:
    ensure_torchvision()  # transformers imports torchvision
    transformers = require("transformers", "hf", "dmscale.integrations.hf_trainer.DMSTrainer")

    class DMSTrainer(DMSTrainerMixin, transformers.Trainer):  # type: ignore[misc, valid-type]
        """``transformers.Trainer`` with a DMS search: see :class:`DMSTrainerMixin`."""

    DMSTrainer.__module__ = __name__
    return DMSTrainer


# ``DMSTrainer`` is built on first use, so importing this module needs no transformers
__getattr__ = lazy_class(__name__, "DMSTrainer", _build_trainer)
