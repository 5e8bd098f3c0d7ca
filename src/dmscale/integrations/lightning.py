"""DMS inside a Lightning ``Trainer``: :class:`DMSCallback`, nothing to change in the module.

What the callback does, and at which hook:

* ``setup`` (before ``configure_optimizers``): attach the search, ``dms.prepare`` on the
  ``LightningModule`` or on one of its submodules (``submodule="net"``), unless a searcher
  was given. The structural parameters are then part of ``self.parameters()``.
  A search that freezes depth part-way (the settle phase, on by default, or the width-only
  phase) leaves depth's ``a`` without a gradient from then on, which DDP tolerates only with
  ``find_unused_parameters``: with ``strategy="ddp"`` (where it is not set) the callback turns
  it on, and it refuses ``"ddp_find_unused_parameters_false"`` (and the other start methods'
  ``..._false`` strategies) and ``static_graph=True`` with the fix, leaving the module as it came.
* ``on_fit_start`` (optimizers built, checkpoint not yet restored, so ``ckpt_path`` resumes
  with the same groups): move the structural parameters out of the user's groups into a
  group of their own in the same optimizer (their own lr, no weight decay). This is the
  least intrusive way that works: the user's ``configure_optimizers`` stays as it is.
* ``on_before_optimizer_step`` (once per optimizer step: after every micro-batch's backward
  of gradient accumulation and after AMP's unscale, before gradient clipping): put the
  structural lr back (the user's LR scheduler scales every group), add the gradient of
  ``searcher.resource_loss(progress)`` with its own backward, and average importance over
  ranks (``Searcher.sync_importance``). Under DDP this backward
  runs after the gradient all-reduce, so it only adds locally; it is the same on every rank
  (a function of the replicated ``a`` alone).
* Sharded: ``strategy=ModelParallelStrategy()`` (FSDP2) with the searched network sharded by
  :func:`dmscale.engine.fsdp.shard_model` in the module's ``configure_model`` (the structural
  parameters stay replicated); the callback averages the gradients of ``a`` in
  ``on_before_optimizer_step`` and gathers the export on rank 0 (``found_model`` is None on
  the other ranks). ``FSDPStrategy`` (FSDP1) and ``DeepSpeedStrategy`` are refused, each with
  its reason (:mod:`dmscale.integrations._sharding`).
* ``on_fit_end``: :meth:`~dmscale.search.searcher.Searcher.meet_target`, ``export()``, and (rank 0)
  save to ``export_dir`` (:func:`dmscale.save`; :func:`dmscale.save_pretrained` for a
  Hugging Face causal LM). ``callback.found_model`` holds the export.

Progress r_t follows ``trainer.global_step / max_steps`` (``estimated_stepping_batches``
when ``max_steps`` is not set).

Example::

    import lightning as L, torch, dmscale as dms
    from dmscale.integrations.lightning import DMSCallback

    dms_cb = DMSCallback(search_config=dms.SearchConfig(resource="macs", target=0.5),
                         example_inputs=torch.randn(1, 3, 32, 32), submodule="net",
                         structure_lr=0.01, export_dir="found")
    L.Trainer(max_steps=1000, callbacks=[dms_cb]).fit(module, loader)
    small = dms_cb.found_model          # also saved in "found" (dms.load(fresh_net, "found"))
"""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from dmscale.core._compat import ensure_torchvision
from dmscale.core.masks import detach
from dmscale.core.errors import ConfigError, MissingDependencyError
from dmscale.search.searcher import SearchConfig, Searcher, prepare
from dmscale.engine.fsdp import sync_replicated_grads
from dmscale.integrations._sharding import check_strategy
from dmscale.integrations._search_steps import (add_structure_group, check_ddp_finds_unused, depth_may_freeze, export_and_save,
                            frozen_depth_error, lazy_class, pin_structure_lr, resource_backward,
                            static_graph_error, structure_group)

__all__ = ["DMSCallbackLogic", "DMSCallback"]

_FIND_UNUSED = {"popen": "ddp", "spawn": "ddp_spawn", "fork": "ddp_fork"}  # start method -> strategy name


def _lightning_fix(strategy: Any) -> str:
    """The strategy that keeps the user's start method and finds unused parameters."""
    name = _FIND_UNUSED.get(getattr(strategy, "_start_method", "popen"), "ddp")
    return (f"use strategy='{name}_find_unused_parameters_true' (or "
            "DDPStrategy(find_unused_parameters=True))")


class DMSCallbackLogic:
    """The hooks of :class:`DMSCallback` (a Lightning ``Callback``); see the module docs.

    Args:
        searcher: a :class:`~dmscale.search.searcher.Searcher` already attached to the module (or one
            of its submodules); or
        search_config, example_inputs: attach one in ``setup``, on ``pl_module`` or on
            ``pl_module.get_submodule(submodule)``.
        structure_lr: the structural parameters' learning rate (constant).
        export_dir: where the found model is saved at the end of ``fit`` (None: not saved).
        meet_target: bring the hard structure to the budget before the export.
    """

    def __init__(self, searcher: Searcher | None = None, *, search_config: SearchConfig | None = None,
                 example_inputs: Any = None, submodule: str | None = None, structure_lr: float = 0.01,
                 export_dir: str | os.PathLike[str] | None = None, meet_target: bool = True) -> None:
        super().__init__()
        if searcher is None and (search_config is None or example_inputs is None):
            raise ConfigError("DMSCallback: pass searcher=dms.prepare(net, ...), or search_config="
                              "dms.SearchConfig(...) with example_inputs=<a batch the network accepts>")
        if not structure_lr > 0:
            raise ConfigError(f"structure_lr must be > 0, got {structure_lr}")
        self.searcher = searcher
        self.search_config = search_config
        self.example_inputs = example_inputs
        self.submodule = submodule
        self.structure_lr = float(structure_lr)
        self.export_dir = export_dir
        self.meet_target = meet_target
        self.found_model: nn.Module | None = None
        self.resource_losses: list[float] = []  # one per optimizer step

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: Any, pl_module: nn.Module, stage: str) -> None:
        if stage != "fit":
            return
        created = self.searcher is None
        if self.searcher is None:
            target = pl_module.get_submodule(self.submodule) if self.submodule else pl_module
            self.searcher = prepare(target, self.example_inputs, self.search_config)
        elif not any(m is self.searcher.model for m in pl_module.modules()):
            raise ConfigError(f"the searcher is attached to a {type(self.searcher.model).__name__} that is "
                              f"not part of the fitted {type(pl_module).__name__}: prepare the network the "
                              "LightningModule holds")
        try:
            self._let_ddp_find_unused(trainer)
        except ValueError:
            if created:  # refused: the user's module as it came
                detach(self.searcher.model)
                self.searcher = None
            raise

    def _let_ddp_find_unused(self, trainer: Any) -> None:
        """Before the strategy wraps the module: a DDP strategy that does not set
        ``find_unused_parameters`` gets True when the search freezes depth; False is refused."""
        ddp_kwargs = getattr(getattr(trainer, "strategy", None), "_ddp_kwargs", None)
        if not isinstance(ddp_kwargs, dict) or not depth_may_freeze(self._searcher()):
            return
        if ddp_kwargs.get("static_graph"):
            raise static_graph_error("drop static_graph=True from DDPStrategy")
        if "find_unused_parameters" not in ddp_kwargs:
            ddp_kwargs["find_unused_parameters"] = True  # depth's a has no gradient once depth is frozen
        elif not ddp_kwargs["find_unused_parameters"]:
            raise frozen_depth_error(_lightning_fix(trainer.strategy))

    def on_fit_start(self, trainer: Any, pl_module: nn.Module) -> None:
        searcher = self._searcher()
        check_strategy(trainer.strategy, searcher)
        check_ddp_finds_unused(getattr(trainer.strategy, "model", None), searcher,
                               _lightning_fix(trainer.strategy))
        if not trainer.optimizers:
            raise ConfigError("DMSCallback needs an optimizer: return one from configure_optimizers")
        ids = {id(p) for p in searcher.structure_parameters()}
        holding = [o for o in trainer.optimizers if any(id(p) in ids for g in o.param_groups for p in g["params"])]
        add_structure_group((holding or trainer.optimizers)[0], searcher, self.structure_lr)
        scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
        if scaler is not None:  # 16-mixed: importance from unscaled gradients
            searcher.use_grad_scaler(scaler)

    def on_before_optimizer_step(self, trainer: Any, pl_module: nn.Module, optimizer: Any) -> None:
        if structure_group(optimizer) is None:  # another optimizer (manual optimisation)
            return
        searcher = self._searcher()
        progress = self.progress(trainer)
        pin_structure_lr(optimizer, self.structure_lr, searcher.structure_lr_scale(progress))
        loss = resource_backward(searcher, progress)
        # sharded (ModelParallelStrategy + shard_model): average the gradients of the replicated
        # a (DDP does it in the backward); importance over the ranks (Searcher.sync_importance)
        sync_replicated_grads(searcher.model)
        searcher.sync_importance()
        self.resource_losses.append(float(loss))

    def on_fit_end(self, trainer: Any, pl_module: nn.Module) -> None:
        searcher = self._searcher()
        was = searcher.model.training
        try:
            self.found_model = export_and_save(searcher, self.export_dir, meet_target=self.meet_target,
                                               save=bool(trainer.is_global_zero))
        finally:
            searcher.model.train(was)

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def progress(trainer: Any) -> float:
        """r_t's progress: ``global_step / max_steps`` in [0, 1]."""
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else trainer.estimated_stepping_batches
        return min(1.0, trainer.global_step / max(1, float(total)))

    def _searcher(self) -> Searcher:
        if self.searcher is None:
            raise RuntimeError("DMSCallback: no search attached yet (setup('fit') attaches it)")
        return self.searcher


def _build_callback() -> type:
    ensure_torchvision()  # torchmetrics (imported by Lightning) may import torchvision
    try:
        import lightning.pytorch as pl
    except ImportError as err:
        try:  # the standalone package has the same API
            import pytorch_lightning as pl
        except ImportError:
            raise MissingDependencyError(
                "dmscale.integrations.lightning.DMSCallback needs Lightning (the package 'lightning' "
                f"or 'pytorch_lightning'), which is not installed ({err}): "
                "pip install 'dmscale[lightning]'") from None

    class DMSCallback(DMSCallbackLogic, pl.Callback):  # type: ignore[misc, valid-type]
        """A Lightning ``Callback`` running a DMS search: see :class:`DMSCallbackLogic`."""

    DMSCallback.__module__ = __name__
    return DMSCallback


# ``DMSCallback`` is built on first use, so importing this module needs no Lightning
__getattr__ = lazy_class(__name__, "DMSCallback", _build_callback)
