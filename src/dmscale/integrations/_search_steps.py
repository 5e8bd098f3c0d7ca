"""What every trainer integration does around someone else's optimisation step.

The Hugging Face and Lightning adapters differ only in *where* they hook in; the steps
themselves live here, written once:

* :func:`add_structure_group`: move the structural parameters (the pruning ratios ``a``)
  out of the user's parameter groups into one group of their own: their own learning rate,
  no weight decay (decay would pull every ratio towards 0, i.e. towards keeping everything).
* :func:`pin_structure_lr`: put that learning rate back before each step (the user's LR
  scheduler changes every group's rate; the CLI trains ``a`` at a constant rate).
* :func:`export_and_save`: bring the hard structure to the budget, export, save;
* :func:`lazy_class`: a module attribute built on first use (the framework's base class is
  imported only then);
* :func:`depth_may_freeze` / :func:`check_ddp_finds_unused`: a search that freezes depth
  part-way (the settle phase, the width-only phase) leaves depth's ``a`` without a gradient
  from then on, which DDP tolerates only with ``find_unused_parameters=True``.

Example:
    >>> import torch, dmscale as dms
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    >>> searcher = dms.prepare(net, torch.randn(2, 8), dms.SearchConfig("params", 0.5))
    >>> opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.1)
    >>> group = add_structure_group(opt, searcher, lr=0.01)
    >>> group["lr"], group["weight_decay"], len(opt.param_groups)
    (0.01, 0.0, 2)
    >>> add_structure_group(opt, searcher, lr=0.01) is group   # idempotent
    True
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from dmscale.core.errors import MissingDependencyError

__all__ = ["STRUCTURE_GROUP_KEY", "add_structure_group", "pin_structure_lr", "structure_group",
           "lazy_class", "export_and_save", "require", "resource_backward", "ADAM_LIKE",
           "depth_may_freeze", "check_ddp_finds_unused", "frozen_depth_error", "static_graph_error"]

STRUCTURE_GROUP_KEY = "dms_structure"  # marks the group (survives optimizer state_dict round trips)
ADAM_LIKE = ("Adam", "AdamW", "NAdam", "RAdam", "Adamax", "AdamWScheduleFree", "AdamW8bit", "PagedAdamW")


def require(module: str, extra: str, feature: str) -> Any:
    """Import ``module`` or raise :class:`MissingDependencyError` naming the extra to install.

    Example:
        >>> require("math", "hf", "the test").sqrt(4.0)
        2.0
    """
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise MissingDependencyError(
            f"{feature} needs the package {module.split('.')[0]!r}, which is not installed "
            f"({err}): pip install 'dmscale[{extra}]'") from None


def structure_group(optimizer: Any) -> dict[str, Any] | None:
    """The parameter group :func:`add_structure_group` added, or None."""
    for group in optimizer.param_groups:
        if group.get(STRUCTURE_GROUP_KEY):
            return group
    return None


def add_structure_group(optimizer: Any, searcher: Any, lr: float) -> dict[str, Any]:
    """Give the structural parameters their own group in ``optimizer`` and return it.

    They are removed from whichever groups the user's ``model.parameters()`` put them in
    (a group left empty is dropped), then added as ``{"lr": lr, "weight_decay": 0.0}``.
    Keys a scheduler put on the other groups (``initial_lr``, ``max_lr``, ...) are copied so
    the scheduler does not fail on the new group; :func:`pin_structure_lr` undoes its effect.
    Warns when the optimizer is not of the Adam family (the ratios move by roughly ``lr`` per
    step with Adam whatever the gradient's scale; SGD makes ``lr`` scale-dependent).
    """
    found = structure_group(optimizer)
    if found is not None:
        return found
    params = list(searcher.structure_parameters())
    ids = {id(p) for p in params}
    groups = optimizer.param_groups
    template = dict(groups[0]) if groups else {}
    for group in groups:
        group["params"] = [p for p in group["params"] if id(p) not in ids]
    groups[:] = [g for g in groups if g["params"]]
    group = {k: v for k, v in template.items() if k != "params"}
    group.update({"params": params, "lr": float(lr), "weight_decay": 0.0, STRUCTURE_GROUP_KEY: True})
    if "initial_lr" in template:
        group["initial_lr"] = float(lr)
    optimizer.add_param_group(group)
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate / Lightning wrappers
    name = type(inner).__name__
    if not any(name.startswith(a) for a in ADAM_LIKE):
        warnings.warn(f"the structural parameters are stepped by {name}; DMS trains them with Adam "
                      "(a step of about lr per iteration whatever the gradient's scale): use an "
                      "Adam-family optimizer, or set structure_lr for this one", stacklevel=3)
    return structure_group(optimizer) or group


def pin_structure_lr(optimizer: Any, lr: float, scale: float = 1.0) -> None:
    """Set the structural group's learning rate back to ``lr`` x ``scale`` (call before each
    step; ``scale`` is :meth:`Searcher.structure_lr_scale` of the step's progress)."""
    group = structure_group(optimizer)
    if group is not None:
        group["lr"] = float(lr) * float(scale)


def lazy_class(module: str, name: str, build: Callable[[], type]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that builds ``name`` with ``build()`` on first access and keeps
    it in ``module``'s namespace, so importing ``module`` needs no framework.

    Example:
        >>> getattr_ = lazy_class(__name__, "Built", lambda: type("Built", (), {}))
        >>> getattr_("Built").__name__
        'Built'
    """
    def module_getattr(attr: str) -> Any:
        if attr == name:
            cls = build()
            setattr(sys.modules[module], name, cls)
            return cls
        raise AttributeError(f"module {module!r} has no attribute {attr!r}")

    return module_getattr


def export_and_save(searcher: Any, export_dir: str | os.PathLike[str] | None, *, meet_target: bool = True,
                    save: bool = True, tokenizer: Any = None) -> nn.Module | None:
    """Export the found model; write it to ``export_dir`` when given and ``save``.

    A model sharded with FSDP2 (a :func:`dmscale.engine.fsdp.sharded` handle) is gathered on
    rank 0 and exported there (a collective: every rank calls this); the other ranks get None.

    ``meet_target``: first bring the hard structure to the largest cost not above the target
    (:meth:`~dmscale.search.searcher.Searcher.meet_target`; a search of a few hundred steps ends near,
    not at, its target). Hugging Face causal LMs are written with
    :func:`dmscale.save_pretrained` (loads with ``from_pretrained``), other models with
    :func:`dmscale.save` (``structure.json`` + ``model.safetensors``, loads with
    ``dmscale.load``).
    """
    from dmscale.engine.fsdp import export_search
    from dmscale.export.files import save as save_files

    if meet_target:
        searcher.meet_target()
    small = export_search(searcher)
    if small is None:  # a sharded model: exported on rank 0
        return None
    if export_dir is not None and save:
        out = Path(export_dir)
        if _is_hf(small):
            from dmscale.export.hf import save_pretrained

            save_pretrained(small, out, tokenizer=tokenizer)
        else:
            save_files(small, searcher.structure(), out)
    return small


def _is_hf(model: nn.Module) -> bool:
    transformers = sys.modules.get("transformers")  # an HF model means it is imported already
    if transformers is None:
        return False
    PreTrainedModel = transformers.PreTrainedModel
    return isinstance(model, PreTrainedModel) or any(isinstance(m, PreTrainedModel) for m in model.children())


def resource_backward(searcher: Any, progress: float, scale: float = 1.0) -> torch.Tensor:
    """Backward of ``scale * searcher.resource_loss(progress)`` (gradients only on ``a``);
    returns the unscaled loss, detached. Nothing happens when the cost is under r_t."""
    with torch.enable_grad():
        loss = searcher.resource_loss(progress)
        if loss.requires_grad:
            (loss * scale).backward()
    return loss.detach()


def depth_may_freeze(searcher: Any) -> bool:
    """Whether the search fixes depth at its hard value part-way, after which depth's ``a``
    has ``requires_grad=False``: when it searches depth and has a settle phase (the default)
    or a width-only phase.

    Example:
        >>> import torch, dmscale as dms
        >>> net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        >>> depth_may_freeze(dms.prepare(net, torch.randn(2, 8), dms.SearchConfig("params", 0.5)))
        False
    """
    cfg = searcher.config
    return bool(searcher.gates.depth) and (cfg.settle > 0 or cfg.width_only_from is not None)


def check_ddp_finds_unused(wrapped: Any, searcher: Any, fix: str) -> None:
    """Refuse a DDP-wrapped model built with ``find_unused_parameters=False`` when the search
    will freeze depth: from that step on DDP would wait for gradients of depth's ``a`` that
    never come and fail with "Expected to mark a variable ready only once" (or hang).
    ``fix`` names the framework's setting that turns it on."""
    if not isinstance(wrapped, nn.parallel.DistributedDataParallel) or not depth_may_freeze(searcher):
        return
    if getattr(wrapped, "static_graph", False):
        raise static_graph_error("turn DDP's static_graph off")
    if not wrapped.find_unused_parameters:
        raise frozen_depth_error(fix)


def frozen_depth_error(fix: str, setting: str = "find_unused_parameters=False") -> ValueError:
    """The error of :func:`check_ddp_finds_unused`: DDP's ``setting`` cannot follow a depth
    freeze; ``fix`` names what to change."""
    return ValueError(
        "this DMS search freezes depth part-way (SearchConfig.settle > 0, the default, or "
        "width_only_from), after which depth's structural parameters get no gradient, but DDP "
        f"is set up with {setting}: {fix}; or search widths only (SearchConfig(search_depth=False))")


def static_graph_error(fix: str) -> ValueError:
    """:func:`frozen_depth_error` for DDP's ``static_graph``, which assumes the set of
    parameters with gradients never changes."""
    return frozen_depth_error(fix, "static_graph=True (the set of parameters with gradients must not change)")
