"""A model sharded by someone else's ``fully_shard`` (accelerate's FSDP2 plugin, a Lightning
strategy) taken over for a search: :func:`frame_of` before sharding (the export's frame),
:func:`adopt_sharded` after it. Then :mod:`dmscale.engine.fsdp`'s helpers (``sharded``,
``export_search``, ``sync_replicated_grads``) work as after its own ``shard_model``.

Example:
    >>> import torch
    >>> frame = frame_of(torch.nn.Linear(2, 2))
    >>> frame.weight.device.type
    'meta'
"""

from __future__ import annotations

from torch import nn

from dmscale.core.distributed import is_distributed
from dmscale.core.errors import ConfigError
from dmscale.core.masks import GATES_NAME
from dmscale.engine.fsdp import _HANDLE, Sharded, _broadcast_gates, _is_dtensor, sharded
from dmscale.engine.fsdp_frame import _skeleton
from dmscale.engine.fsdp_plan import ShardPlan, plan_shards

__all__ = ["frame_of", "adopt_sharded"]


def frame_of(model: nn.Module) -> nn.Module:
    """The copy of ``model`` that :meth:`Sharded.gather` fills (hooks and gates included,
    weights on the meta device, so it costs no weight memory): take it before someone else
    shards the model, then pass it to :func:`adopt_sharded`."""
    return _skeleton(model)


def adopt_sharded(model: nn.Module, frame: nn.Module, plan: ShardPlan | None = None) -> Sharded:
    """The :class:`Sharded` handle of ``model`` sharded by someone else's ``fully_shard``
    (accelerate's FSDP2 plugin), in place; ``frame``: :func:`frame_of` taken before sharding.
    Broadcasts rank 0's structural parameters and importance (a collective: every rank calls
    it, once); :func:`sharded`, :func:`export_search` and :func:`sync_replicated_grads` then
    work as after :func:`shard_model`.

    Raises:
        ConfigError: the structural parameters were sharded (they must stay replicated: pass
            the ``dms_gates`` submodule as an ignored module), or the model is adopted already.
    """
    plan = plan if plan is not None else plan_shards(model)
    if not is_distributed():
        return Sharded(model, plan)
    if sharded(model) is not None:
        raise ConfigError(f"{type(model).__name__} has a sharding handle already: adopt a sharded model once")
    names = set(plan.replicated)
    kept = [p for n, p in model.named_parameters() if n in names]
    split = [n for n, p in model.named_parameters() if n in names and _is_dtensor(p)]
    if split:
        raise ConfigError(f"FSDP sharded the structural parameters ({', '.join(split[:3])}): they must stay "
                          f"replicated on every rank; expected the {GATES_NAME} submodule among the ignored "
                          f"modules of every fully_shard, got it sharded")
    _broadcast_gates(model)
    handle = Sharded(model, plan, frame, True, kept)
    model.__dict__[_HANDLE] = handle
    return handle
