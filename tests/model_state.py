"""Snapshot a user's model and check that nothing about it changed (a test helper).

A :class:`ModelSnapshot` records everything a user can observe about an ``nn.Module``: its
state_dict (keys, dtypes and values, copied), its outputs on given inputs (eval mode, no
grad), the train/eval flag of every submodule, its module names (so an extra registered
submodule shows), and every forward/backward hook. :meth:`ModelSnapshot.assert_same`
compares a model against it and names the first difference.

Example:
    >>> import torch
    >>> net = torch.nn.Linear(3, 2)
    >>> snap = ModelSnapshot.take(net, torch.ones(1, 3))
    >>> snap.assert_same(net)
    >>> _ = net.train(False)
    >>> snap.differences(net)[0]
    "train/eval flag of '<root>' changed: True -> False"
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["ModelSnapshot", "hooks_of"]

_HOOK_ATTRS = ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks",
               "_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_state_dict_hooks",
               "_load_state_dict_pre_hooks")


def hooks_of(model: nn.Module) -> list[str]:
    """``'<module>.<hook dict>'`` for every non-empty hook dict of every submodule."""
    found = []
    for name, m in model.named_modules():
        for attr in _HOOK_ATTRS:
            if getattr(m, attr, None):
                found.append(f"{name or '<root>'}.{attr}")
    return found


def _run(model: nn.Module, x: Any) -> list[torch.Tensor]:
    from exact import flat_tensors

    flags = {n: m.training for n, m in model.named_modules()}
    model.eval()
    try:
        with torch.no_grad():
            out = model(**x) if isinstance(x, dict) else model(*x) if isinstance(x, tuple) else model(x)
    finally:
        for n, m in model.named_modules():
            m.training = flags.get(n, m.training)
    return [t.detach().clone() for t in flat_tensors(out)]


@dataclass
class ModelSnapshot:
    """What a user can see of a model; see the module docstring."""

    state: dict[str, torch.Tensor]
    flags: dict[str, bool]
    modules: list[str]
    hooks: list[str]
    inputs: Any
    outputs: list[torch.Tensor] | None

    @classmethod
    def take(cls, model: nn.Module, inputs: Any = None) -> "ModelSnapshot":
        """Record ``model`` (and its outputs on ``inputs`` when given)."""
        flags = {n or "<root>": m.training for n, m in model.named_modules()}
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        outputs = None if inputs is None else _run(model, inputs)
        return cls(state, flags, [n for n, _ in model.named_modules()], hooks_of(model), inputs, outputs)

    def differences(self, model: nn.Module) -> list[str]:
        """Every difference between ``model`` and the snapshot, as sentences (empty: same)."""
        diffs: list[str] = []
        flags = {n or "<root>": m.training for n, m in model.named_modules()}
        for n, was in self.flags.items():
            if n in flags and flags[n] != was:
                diffs.append(f"train/eval flag of {n!r} changed: {was} -> {flags[n]}")
        modules = [n for n, _ in model.named_modules()]
        if modules != self.modules:
            extra = sorted(set(modules) - set(self.modules))
            gone = sorted(set(self.modules) - set(modules))
            diffs.append(f"submodules changed: added {extra[:5]}, removed {gone[:5]}")
        hooks = hooks_of(model)
        if hooks != self.hooks:
            diffs.append(f"hooks changed: {self.hooks} -> {hooks}")
        state = model.state_dict()
        if list(state) != list(self.state):
            diffs.append(f"state_dict keys changed: {sorted(set(state) ^ set(self.state))[:5]}")
        for k, v in self.state.items():
            if k in state and (state[k].shape != v.shape or state[k].dtype != v.dtype
                               or not torch.equal(state[k], v)):
                diffs.append(f"state_dict[{k!r}] changed")
                break
        if self.outputs is not None and not diffs:
            now = _run(model, self.inputs)
            if len(now) != len(self.outputs) or any(
                    a.shape != b.shape or not torch.equal(a, b) for a, b in zip(now, self.outputs)):
                diffs.append("outputs on the example inputs changed")
        return diffs

    def assert_same(self, model: nn.Module, context: str = "") -> None:
        """Raise AssertionError naming every difference between ``model`` and the snapshot."""
        diffs = self.differences(model)
        assert not diffs, f"{context}: the model changed: " + "; ".join(diffs)
