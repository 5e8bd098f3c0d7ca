"""Sharded training inside someone else's trainer: what is supported, and why the rest is not.

* **FSDP2 through accelerate** (the Hugging Face Trainer's ``fsdp=...`` with
  ``fsdp_config={"version": 2}``, transformers' default version): accelerate applies
  ``fully_shard`` to the decoder layers, the embeddings, the head and the root.
  :func:`keep_gates_replicated` adds the ``dms_gates`` submodule to the plugin's ignored
  modules before that happens (the structural parameters stay whole on every rank) and
  returns the frame :meth:`dmscale.engine.fsdp.Sharded.gather` fills at the export; after
  accelerate has sharded the model, :func:`dmscale.engine.fsdp_adopt.adopt_sharded` makes it a
  sharded search like ``shard_model``'s (gates broadcast, gradients of ``a`` averaged by
  ``sync_grads``, the export gathered on rank 0).
* **FSDP2 under Lightning**: ``ModelParallelStrategy`` leaves the sharding to the module's
  ``configure_model``, where :func:`dmscale.engine.fsdp.shard_model` shards the searched
  network (:func:`check_strategy` refuses it unsharded, or with tensor parallelism).
* **DeepSpeed** is refused (:func:`deepspeed_error` says why).
* **FSDP1** (``FullyShardedDataParallel``, accelerate's ``version 1``, Lightning's
  ``FSDPStrategy``) is refused (:func:`fsdp1_error`).
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from dmscale.core.errors import ConfigError
from dmscale.core.masks import GATES_NAME
from dmscale.engine.fsdp_adopt import frame_of

__all__ = ["LIGHTNING_FSDP2", "check_strategy", "deepspeed_error", "fsdp1_error", "keep_gates_replicated"]

_FSDP2_HF = ("TrainingArguments(fsdp=True, fsdp_config={\"version\": 2}) under torchrun "
             "(accelerate's FSDP2 plugin)")
LIGHTNING_FSDP2 = ("strategy=ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1) (FSDP2) with the searched network sharded by "
                   "dmscale.engine.fsdp.shard_model(net, mesh=self.device_mesh[\"data_parallel\"]) in "
                   "configure_model, or strategy=\"ddp\"")
_ACCELERATE_STEP = ("DeepSpeed steps the optimizer inside the backward of the last micro-batch "
                    "(accelerate's DeepSpeedEngineWrapper.backward calls engine.step()), so the resource "
                    "loss's own backward, which comes after the task loss's, would land after the step "
                    "and its zero_grad")
_LIGHTNING_STEP = ("DeepSpeed's engine owns the backward (engine.backward reduces and partitions the "
                   "gradients in its own hooks) and the step, and the resource loss's own backward in "
                   "on_before_optimizer_step is a plain autograd backward outside the engine")


def deepspeed_error(where: str, fix: str = _FSDP2_HF, lightning: bool = False) -> ConfigError:
    """Why a DMS search cannot run under DeepSpeed (any ZeRO stage), and what to use instead
    (``lightning``: the reason of Lightning's DeepSpeedStrategy, else accelerate's)."""
    return ConfigError(
        f"DMS search under DeepSpeed ({where}) is not supported: "
        f"(1) {_LIGHTNING_STEP if lightning else _ACCELERATE_STEP}; (2) ZeRO-3 replaces every parameter by "
        "an empty placeholder that it gathers only in its own hooks around the forward of the module "
        f"owning it: the structural parameters (in {GATES_NAME}, a module whose forward never runs) "
        "would stay empty when the masks are computed, and dmscale's pre-hooks that fold the masks "
        "into the weights, registered before DeepSpeed's, would run on the placeholders. Expected "
        f"DDP or FSDP2, got DeepSpeed; for sharded weights, gradients and optimizer state (what "
        f"ZeRO-3 gives) use {fix}")


def fsdp1_error(where: str, fix: str = _FSDP2_HF) -> ConfigError:
    """Why a DMS search refuses FSDP1 (``FullyShardedDataParallel``), and what to use instead."""
    return ConfigError(
        f"DMS search under FSDP1 ({where}) is not supported: FullyShardedDataParallel flattens the "
        "parameters of each wrapped module into one FlatParameter, the root's including the "
        f"structural parameters in {GATES_NAME} unless they are ignored, and dmscale's sharded "
        "search (replicated gates, their gradients averaged, the export gathered on rank 0) is "
        f"built and tested on FSDP2 (fully_shard) only. Expected FSDP2, got FSDP1; use {fix}")


def keep_gates_replicated(plugin: Any, model: nn.Module, searcher: Any, device: Any) -> nn.Module:
    """Before accelerate's FSDP2 shards ``model``: add its ``dms_gates`` submodule to
    ``plugin.ignored_modules`` (a regex string or a list of modules; accelerate passes their
    parameters as ``ignored_params`` to every ``fully_shard``) and move it to ``device``;
    returns :func:`~dmscale.engine.fsdp_adopt.frame_of` the model (the export's frame).

    Raises:
        ConfigError: FSDP1, CPU-RAM-efficient loading, or a searcher attached to a submodule.
    """
    version = int(getattr(plugin, "fsdp_version", 1) or 1)
    if version != 2:
        raise fsdp1_error(f"fsdp_config version {version}")
    if getattr(plugin, "cpu_ram_efficient_loading", False):
        raise ConfigError("DMS search under FSDP with cpu_ram_efficient_loading=True is not supported: "
                          "accelerate moves the whole model, the structural parameters included, to the "
                          "meta device and refills only what it shards; pass fsdp_config="
                          "{\"cpu_ram_efficient_loading\": False} (the default)")
    if searcher.model is not model:
        raise ConfigError(f"DMS search under FSDP: the searcher is attached to a {type(searcher.model).__name__} "
                          f"inside the trained {type(model).__name__}; expected the trained model itself "
                          "(the export gathers the whole sharded model): prepare the model you pass to the Trainer")
    gates = getattr(model, GATES_NAME)
    gates.to(device)
    ignored = plugin.ignored_modules
    if ignored is None:
        plugin.ignored_modules = re.escape(GATES_NAME)
    elif isinstance(ignored, str):
        plugin.ignored_modules = f"(?:{ignored})|{re.escape(GATES_NAME)}"
    else:
        ignored = list(ignored)
        plugin.ignored_modules = ignored if any(m is gates for m in ignored) else ignored + [gates]
    return frame_of(model)


def check_strategy(strategy: Any, searcher: Any) -> None:
    """Refuse the Lightning strategies a search cannot run under: ``FSDPStrategy`` (FSDP1),
    ``DeepSpeedStrategy``, and ``ModelParallelStrategy`` with tensor parallelism or without the
    searched network sharded by :func:`~dmscale.engine.fsdp.shard_model`."""
    from dmscale.engine.fsdp import sharded

    name = type(strategy).__name__
    if "DeepSpeed" in name:
        raise deepspeed_error(f"Lightning's {name}", LIGHTNING_FSDP2, lightning=True)
    if "FSDP" in name:
        raise fsdp1_error(f"Lightning's {name}", LIGHTNING_FSDP2)
    if name != "ModelParallelStrategy":
        return
    mesh = getattr(strategy, "device_mesh", None)
    tp = mesh["tensor_parallel"].size() if mesh is not None and "tensor_parallel" in (mesh.mesh_dim_names or ()) else 1
    if tp > 1:
        raise ConfigError(f"DMS search under ModelParallelStrategy with tensor parallelism is not supported: it "
                          "splits the masked channels over ranks; expected tensor_parallel_size=1 (FSDP2 "
                          f"over data-parallel ranks), got {tp}; pass ModelParallelStrategy(data_parallel_size="
                          "<the number of ranks>, tensor_parallel_size=1) (its default, \"auto\", puts the "
                          "devices of a node in one tensor-parallel group)")
    handle = sharded(searcher.model)
    if handle is None or not handle.active:
        if getattr(strategy, "world_size", 1) > 1:
            raise ConfigError(f"DMS search under ModelParallelStrategy: the searched {type(searcher.model).__name__} "
                              "is not sharded by dmscale; expected dmscale.engine.fsdp.shard_model(net, "
                              "mesh=self.device_mesh[\"data_parallel\"]) in configure_model (it keeps the "
                              f"structural parameters in {GATES_NAME} replicated; a fully_shard of your own "
                              "would shard them), got no sharding handle")
