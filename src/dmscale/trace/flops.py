"""FLOP counting per module that works in any autograd mode.

``torch.utils.flop_counter.FlopCounterMode`` attributes FLOPs to modules with
``torch.utils.module_tracker.ModuleTracker``, which also registers backward hooks on every
module input that requires grad. Under ``torch.no_grad()`` a view of a parameter (timm
CaiT's ``cls_token.expand(...)``, PiT's ``(x, cls_tokens)`` tuples) requires grad but has no
gradient function, and registering that hook fails with
``AssertionError: Expected gradient function to be set``. dmscale only counts forward
passes, so :class:`ForwardFlopCounter` tracks the running modules with plain forward hooks.

Counts are keyed like FlopCounterMode's: ``"Global"`` for the total, the root module's class
name for the root, and ``"<RootClass>.<module name>"`` for every submodule.

Example:
    >>> import torch
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    >>> with torch.no_grad(), ForwardFlopCounter(net) as counter:
    ...     _ = net(torch.randn(5, 4))
    >>> counter.get_total_flops(), sum(counter.get_flop_counts()["Sequential.2"].values())
    (180, 60)
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.utils.flop_counter import FlopCounterMode
from torch.utils.hooks import RemovableHandle

__all__ = ["ForwardFlopCounter"]


class _ForwardModuleTracker:
    """The forward half of ``ModuleTracker``: ``parents`` is the set of the names of the
    modules of ``root`` that are running now, plus ``"Global"``; no backward hooks."""

    def __init__(self, root: nn.Module) -> None:
        prefix = type(root).__name__
        self._names = {m: prefix if not n else f"{prefix}.{n}" for n, m in root.named_modules()}
        self._root = root
        self._stack: list[str] = []
        self._handles: list[RemovableHandle] = []
        self.parents: set[str] = {"Global"}

    def _enter(self, module: nn.Module, args: Any) -> None:
        self._stack.append(self._names[module])
        self.parents = {"Global", *self._stack}

    def _exit(self, module: nn.Module, args: Any, out: Any) -> None:
        name = self._names[module]
        # pop the innermost call of this module (a module may be re-entered)
        for i in range(len(self._stack) - 1, -1, -1):
            if self._stack[i] == name:
                del self._stack[i]
                break
        self.parents = {"Global", *self._stack}

    def __enter__(self) -> "_ForwardModuleTracker":
        self._stack.clear()
        self.parents = {"Global"}
        for m in self._names:
            self._handles.append(m.register_forward_pre_hook(self._enter))
            # always_call: a module that raises still leaves the stack
            self._handles.append(m.register_forward_hook(self._exit, always_call=True))
        return self

    def __exit__(self, *args: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._stack.clear()
        self.parents = {"Global"}


class ForwardFlopCounter(FlopCounterMode):
    """``FlopCounterMode`` for forward passes of ``root``, in grad or no-grad mode.

    Only ``root`` and its submodules are tracked (by their names in ``root``); the flop
    formulas and the total are FlopCounterMode's own.
    """

    def __init__(self, root: nn.Module) -> None:
        super().__init__(display=False)
        self.mod_tracker = _ForwardModuleTracker(root)  # type: ignore[assignment]
