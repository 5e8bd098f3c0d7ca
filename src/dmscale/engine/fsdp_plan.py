"""Which modules FSDP2 shards in a search, and whether this torch can (:mod:`dmscale.engine.fsdp`
shards by this plan).

A :class:`ShardPlan` names the modules that get their own ``fully_shard`` (innermost first;
the root comes last and takes what no block holds) and the parameters that stay replicated
on every rank: the structural parameters of the ``dms_gates`` submodule.

Under ``--precision bf16`` FSDP2 gathers the weights in bfloat16
(:func:`mixed_precision`: ``MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32)``), so autocast holds no bfloat16 copy of each weight for the backward
pass, and a frozen teacher is stored in bfloat16; both only where
:func:`low_precision_params_unsupported` finds nothing against it (a BatchNorm layer, whose
float32 running statistics need float32 weights).

Example:
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 8), nn.ReLU()), nn.Linear(8, 2))
    >>> plan_shards(net).blocks
    ('0', '1', '2')
    >>> plan_shards(net, blocks=["1.0", "1"]).blocks   # children before their parents
    ('1.0', '1')
    >>> fsdp_unavailable() is None   # this torch has FSDP2 with ignored_params
    True
    >>> mixed_precision(net, torch.bfloat16).param_dtype, mixed_precision(net, None)
    (torch.bfloat16, None)
    >>> low_precision_params_unsupported(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)))
    "it has a BatchNorm layer ('1'), whose float32 running statistics need float32 weights"
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

from dmscale.core.errors import ConfigError
from dmscale.core.masks import GATES_NAME

__all__ = ["ShardPlan", "fsdp_unavailable", "low_precision_params_unsupported", "mixed_precision",
           "plan_shards"]


def fsdp_unavailable() -> str | None:
    """Why FSDP2 cannot shard a search in this torch, or None when it can (it needs
    ``torch.distributed.fsdp.fully_shard`` with ``ignored_params``, torch 2.7 or later; it
    runs on CUDA with NCCL and on the CPU with gloo)."""
    if not dist.is_available():
        return f"torch {torch.__version__} was built without torch.distributed"
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        return f"torch {torch.__version__} has no torch.distributed.fsdp.fully_shard (FSDP2)"
    if "ignored_params" not in inspect.signature(fully_shard).parameters:
        return (f"torch {torch.__version__}'s fully_shard has no ignored_params, which keeps the "
                "structural parameters replicated")
    return None


@dataclass(frozen=True)
class ShardPlan:
    """Which modules get their own ``fully_shard`` (``blocks``, innermost first; the root is
    sharded last, with what no block holds) and which parameters stay replicated."""

    blocks: tuple[str, ...]
    replicated: tuple[str, ...]


def _hf_blocks(model: nn.Module) -> list[str]:
    """Modules of the classes Hugging Face models list in ``_no_split_modules`` (decoder layers)."""
    classes = {c for m in model.modules() for c in (getattr(m, "_no_split_modules", None) or [])}
    return [n for n, m in model.named_modules() if n and type(m).__name__ in classes]


def _list_blocks(model: nn.Module) -> list[str]:
    """The items of the longest ``nn.ModuleList`` / ``nn.Sequential`` of parametrised modules."""
    best: list[str] = []
    for name, m in model.named_modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and not name.startswith(GATES_NAME):
            items = [f"{name}.{k}" if name else k for k, c in m.named_children()
                     if k != GATES_NAME and any(True for _ in c.parameters())]
            if len(items) > len(best):
                best = items
    return best if len(best) > 1 else []


def plan_shards(model: nn.Module, blocks: Iterable[str] | None = None, space: Any = None) -> ShardPlan:
    """The :class:`ShardPlan` of ``model``: ``blocks`` when given, else Hugging Face's
    ``_no_split_modules`` classes, else the residual blocks of ``space`` (a searcher's
    :class:`~dmscale.trace.discover.SearchSpace`), else the items of the longest module list;
    the parameters of ``dms_gates`` are replicated.

    Raises:
        ConfigError: a named block is not a submodule, is the root, holds the gates or has
            no parameters.
    """
    modules = dict(model.named_modules())
    if blocks is not None:
        names = list(blocks)
        for n in names:
            if n not in modules or not n:
                raise ConfigError(f"shard block {n!r} is not a submodule of {type(model).__name__} "
                                  "(the root is always sharded last): name submodules, e.g. model.layers.0")
            if n == GATES_NAME or n.startswith(GATES_NAME + ".") or GATES_NAME in modules[n]._modules:
                raise ConfigError(f"shard block {n!r} holds the structural parameters ({GATES_NAME}), "
                                  "which stay replicated: shard the model's own blocks")
            if not any(True for _ in modules[n].parameters()):
                raise ConfigError(f"shard block {n!r} has no parameters: leave it out")
    else:
        names = _hf_blocks(model)
        if not names and space is not None:
            # a sublayer unit shards with its whole block (getattr: a space of another kind)
            names = [b.name if getattr(b, "layer", None) is None else b.layer.name
                     for d in getattr(space, "depth", []) for b in d.blocks]
            names = [n for n in names if n in modules]
        if not names:
            names = _list_blocks(model)
        names = [n for n in names if any(True for _ in modules[n].parameters())]
    unique = list(dict.fromkeys(names))
    ordered = sorted(unique, key=lambda n: -n.count("."))  # stable: children before their parents
    replicated = tuple(n for n, _ in model.named_parameters() if n.startswith(GATES_NAME + "."))
    return ShardPlan(tuple(ordered), replicated)


def low_precision_params_unsupported(model: nn.Module) -> str | None:
    """Why ``model`` cannot compute with bfloat16 (or float16) parameters under autocast, or
    None when it can: a layer with running statistics (BatchNorm, InstanceNorm with
    ``track_running_stats``) keeps them in float32, and its kernels refuse half weights
    beside float32 statistics ("expected scalar type BFloat16 but found Float")."""
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats:
            return (f"it has a {type(m).__name__.rstrip('123d')} layer ({name!r}), whose float32 running "
                    "statistics need float32 weights")
    return None


def mixed_precision(model: nn.Module, param_dtype: torch.dtype | None) -> Any:
    """FSDP2's ``MixedPrecisionPolicy(param_dtype, reduce_dtype=float32)`` for ``model``: the
    weights are gathered (and computed with) in ``param_dtype``, the gradients reduced and
    kept in float32, the sharded weights stay float32. None (gather the stored dtype) when
    ``param_dtype`` is None or float32, or :func:`low_precision_params_unsupported` says why not."""
    if param_dtype is None or param_dtype == torch.float32 or low_precision_params_unsupported(model):
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
