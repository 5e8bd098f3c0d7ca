"""Sharded training inside someone else's trainer: what is supported, and why the rest is not.

* **FSDP2 through accelerate** (the Hugging Face Trainer's ``fsdp=...`` with
  ``fsdp_config={"version": 2}``, transformers' default version): accelerate applies
  ``fully_shard`` to the decoder layers, the embeddings, the head and the root.
  :func:`keep_gates_replicated` adds the ``dms_gates`` submodule to the plugin's ignored
  modules before that happens (the structural parameters stay whole on every rank) and
  returns the frame :meth:`dmscale.engine.fsdp.Sharded.gather` fills at the export; after
  accelerate has sharded the model, :func:`dmscale.engine.fsdp.adopt_sharded` makes it a
  sharded search like ``shard_model``'s (gates broadcast, gradients of ``a`` averaged by
  ``sync_grads``, the export gathered on rank 0).
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
from dmscale.engine.fsdp import frame_of

__all__ = ["deepspeed_error", "fsdp1_error", "keep_gates_replicated"]

_FSDP2_HF = ("TrainingArguments(fsdp=\"full_shard\", fsdp_config={\"version\": 2}) under torchrun "
             "(accelerate's FSDP2 plugin)")


def deepspeed_error(where: str, fix: str = _FSDP2_HF) -> ConfigError:
    """Why a DMS search cannot run under DeepSpeed (any ZeRO stage), and what to use instead."""
    return ConfigError(
        f"DMS search under DeepSpeed ({where}) is not supported: (1) DeepSpeed steps the optimizer "
        "inside the backward of the last micro-batch (accelerate's DeepSpeedEngineWrapper.backward "
        "calls engine.step()), so the resource loss's own backward, which comes after the task "
        "loss's, would land after the step and its zero_grad; (2) ZeRO-3 replaces every parameter by "
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
    returns :func:`~dmscale.engine.fsdp.frame_of` the model (the export's frame).

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
