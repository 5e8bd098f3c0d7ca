"""Wire a search's gates into a user's model and take them out again: register the gates
submodule (``dms_gates``), attach every :class:`~dmscale.core.hook_base.DMSHook` (the mask
computation, the channel masks on inputs, outputs and norms, or folded into weights, and the
depth masks on residual branches), and remove them all by type in :func:`detach`.

The gates themselves, and the masks they compute, are :class:`dmscale.core.masks.Gates`
(whose ``attach`` calls :func:`attach_hooks`).

Example:
    >>> import torch
    >>> from torch import nn
    >>> from dmscale.core.masks import Gates
    >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> _ = Gates.attach(net, dims=[(8, 1, 1, 1.0)], depth=[], consumers={"2": (-1, torch.arange(8))}, branches={})
    >>> sorted(type(h).__name__ for h in net[2]._forward_pre_hooks.values())
    ['FoldMask']
    >>> net = detach(net)
    >>> len(net[2]._forward_pre_hooks), hasattr(net, GATES_NAME)
    (0, False)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dmscale.core.hook_base import DMSHook
from dmscale.core.mask_hooks import ComputeMasks, MaskBranch, MaskedNorm, MaskInput, MaskOutput, RestoreFastpath
from dmscale.core.weight_masks import (FoldDepth, FoldMask, Unfold, depth_foldable, depth_reads, fold_layers,
                                      fold_plan)

__all__ = ["GATES_NAME", "NORM_PREFIX", "attach_hooks", "detach", "guard_hooks_under_compile", "fold_layers",
           "block_keys"]

GATES_NAME = "dms_gates"
NORM_PREFIX = "norm_"  # the mask keys of masked norms (the gates compute their weights)


def attach_hooks(
    model: nn.Module,
    gates: Any,
    consumers: dict[str, tuple[int, torch.Tensor]],
    branches: dict[str, tuple[int, int]],
    norms: dict[str, Any] | None = None,
    outputs: dict[str, tuple[int, Any]] | None = None,
    fold_masks: bool = True,
    depth_folds: dict[str, str] | None = None,
) -> dict[str, torch.Tensor]:
    """Register ``gates`` (a :class:`~dmscale.core.masks.Gates`) on ``model`` as
    :data:`GATES_NAME` and attach every hook; returns every hooked layer's mask key and the
    global slot of each of its channels ((C,) long), in the order the gates gather them.

    Args: as :meth:`dmscale.core.masks.Gates.attach` (``consumers``: layer name -> (channel
    dim of its input, global slot per channel); ``norms``: norm name -> (slots, kind, eps[, offset]);
    ``outputs``: layer name -> (channel dim of its output, slots); ``branches``: module name
    -> (depth dim, block index); ``fold_masks``: fold masks into weights where that is the
    same function; ``depth_folds``: branch module -> the layer whose output it returns, which
    takes the depth mask when the branch module itself cannot).
    """
    guard_hooks_under_compile()
    model.add_module(GATES_NAME, gates)
    modules = dict(model.named_modules())
    has_mha = any(isinstance(m, nn.MultiheadAttention) for m in model.modules())
    model.register_forward_pre_hook(ComputeMasks(gates, no_fastpath=has_mha))
    if has_mha:
        model.register_forward_hook(RestoreFastpath(gates), always_call=True)
    order: dict[str, torch.Tensor] = {}

    def slot_key(prefix: str, name: str, slots: Any) -> str:
        """One key per hooked layer, also where two layers read the same slots: every layer's
        mask is its own slice of the forward's one gather, so the backward sums the gradients of
        a shared slot inside that gather's backward (one operation), not one addition per layer."""
        key = prefix + name.replace(".", "__")
        order.setdefault(key, torch.as_tensor(slots, dtype=torch.long))
        return key

    unfolds: dict[str, Unfold] = {}

    def unfold_after(name: str, hook: FoldMask | FoldDepth) -> None:
        """One Unfold per layer, however many folds shadow its weight; it knows them all."""
        if name not in unfolds:
            unfolds[name] = Unfold()
            # first among the layer's forward hooks: those registered before see its output as the model does
            modules[name].register_forward_hook(unfolds[name], always_call=True, prepend=True)
        unfolds[name].folds.append(hook)
        hook.via_unfold = True  # under torch.compile its output side is multiplied in the Unfold
        hook.unfold = unfolds[name]  # eager calls: the layer's folds from one batch (core.fold_batch)

    def fold(name: str, dim: int, side: str, key: str, slots: Any = None) -> bool:
        plan = fold_plan(modules[name], dim, side) if fold_masks else None
        if plan is None:
            return False
        # an output fold's bias reads a slice of its own: its gradient and the weight's are summed
        # in the gather's backward, not by one more addition
        bias_key = slot_key("outb_", name, slots) \
            if side == "out" and modules[name]._parameters.get("bias") is not None else None
        hook = FoldMask(gates, key, plan, dim, bias_key)
        modules[name].register_forward_pre_hook(hook, with_kwargs=True)
        unfold_after(name, hook)
        return True

    for name, (dim, slots) in consumers.items():
        key = slot_key("idx_", name, slots)
        if not fold(name, dim, "in", key):
            modules[name].register_forward_pre_hook(MaskInput(gates, key, dim), with_kwargs=True)
    for name, (slots, kind, eps, *offset) in (norms or {}).items():
        key = slot_key(NORM_PREFIX, name, slots)
        hook = MaskedNorm(gates, key, kind, eps, offset[0] if offset else None)
        modules[name].register_forward_hook(hook, with_kwargs=True)
    for name, (dim, slots) in (outputs or {}).items():
        key = slot_key("out_", name, slots)
        if not fold(name, dim, "out", key, slots):
            modules[name].register_forward_hook(MaskOutput(gates, key, dim))
    for name, (j, i) in branches.items():
        # the branch module itself, else the layer whose output it returns
        candidates = (name, (depth_folds or {}).get(name)) if fold_masks else ()
        target = next((t for t in candidates if t is not None and depth_foldable(modules[t])), None)
        # every multiply by a block's depth mask reads a scalar of its own (gates.depth_read)
        if target is not None:
            reads = tuple(gates.depth_read(j, i) for _ in range(depth_reads(modules[target])))
            depth_hook = FoldDepth(gates, j, i, reads)
            modules[target].register_forward_pre_hook(depth_hook)
            unfold_after(target, depth_hook)
        else:
            modules[name].register_forward_hook(MaskBranch(gates, j, i, gates.depth_read(j, i)))
    return order


def block_keys(layers: list[tuple[nn.Module, Unfold]]) -> set[str]:
    """The mask keys of the folds that a batch can hold (:mod:`dmscale.core.fold_batch`): every
    fold of a layer none of whose folds reads a gathered index (a grouped convolution's input)."""
    keys: set[str] = set()
    for _, unfold in layers:
        if not any(isinstance(f, FoldMask) and f.plan.index is not None for f in unfold.folds):
            keys.update(unfold.mask_keys())
    return keys


def guard_hooks_under_compile() -> None:
    """Make ``torch.compile`` tell a module with hooks from one without.

    torch skips the guard on a module's empty hook dicts by default
    (``torch._dynamo.config.skip_nnmodule_hook_guards``), so a graph compiled for a plain model
    (a teacher, the model before :func:`dmscale.prepare`) would run for a model of the same
    class with the search's hooks: the masks silently left out. The guard is switched on for
    the process, and code compiled before, which has no such guard, is dropped (it compiles
    again at its next call; results are unchanged, the guard costs a length check per module).
    """
    import torch._dynamo

    if torch._dynamo.config.skip_nnmodule_hook_guards:
        torch._dynamo.config.skip_nnmodule_hook_guards = False
        torch._dynamo.reset()


def _strip_hooks(module: nn.Module) -> None:
    for attr in ("_forward_pre_hooks", "_forward_hooks"):
        hooks: dict[int, Any] = getattr(module, attr)
        for key in [k for k, fn in hooks.items() if isinstance(fn, DMSHook)]:
            del hooks[key]
            for extra in ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
                          "_forward_hooks_always_called"):
                getattr(module, extra, {}).pop(key, None)


def detach(model: nn.Module) -> nn.Module:
    """Remove every dmscale hook and the ``dms_gates`` submodule; returns ``model``.

    The model is back to its original modules, state_dict keys and outputs.
    """
    for m in model.modules():
        _strip_hooks(m)
    if GATES_NAME in model._modules:
        del model._modules[GATES_NAME]
    return model
