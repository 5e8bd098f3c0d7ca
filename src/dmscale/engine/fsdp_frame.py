"""The frame a sharded model is gathered into (:meth:`dmscale.engine.fsdp.Sharded.gather`): a
copy of the model taken before sharding whose parameters live on the meta device, filled
from a full state dict on rank 0.

Example:
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(2, 3))
    >>> frame = _skeleton(net)
    >>> frame[0].weight.is_meta, torch.equal(_materialize(frame, net.state_dict())[0].weight, net[0].weight)
    (True, True)
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from dmscale.core.errors import StructureError

__all__ = ["_materialize", "_skeleton", "_to_cpu"]  # private to dmscale.engine.fsdp


def _skeleton(model: nn.Module) -> nn.Module:
    """A copy of ``model`` (hooks and gates included) whose parameters live on the meta
    device and whose buffers are CPU copies: the frame :meth:`Sharded.gather` fills."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = b.detach().to("cpu", copy=True)
    return copy.deepcopy(model, memo)


def _materialize(frame: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    """Put the full ``state`` into ``frame``'s meta parameters (tied ones stay tied) and
    persistent buffers; returns ``frame``."""
    made: dict[int, nn.Parameter] = {}
    for prefix, m in frame.named_modules(remove_duplicate=False):
        dot = prefix + "." if prefix else ""
        for name, p in list(m._parameters.items()):
            if p is None:
                continue
            if id(p) not in made:
                if dot + name not in state:
                    raise StructureError(f"the gathered state dict has no {dot + name!r}: the sharded "
                                         "model and the copy taken when it was sharded differ")
                made[id(p)] = nn.Parameter(_own(state[dot + name]), requires_grad=p.requires_grad)
            m._parameters[name] = made[id(p)]
        for name in list(m._buffers):
            if dot + name in state and name not in m._non_persistent_buffers_set:
                m._buffers[name] = _own(state[dot + name])
    return frame


def _own(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy when it is a view into a larger storage (a gathered state dict's
    tensors may be: safetensors refuses to save those)."""
    whole = t.is_contiguous() and t.storage_offset() == 0 \
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t if whole else t.clone()


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_to_cpu(v) for v in value)
    return value
