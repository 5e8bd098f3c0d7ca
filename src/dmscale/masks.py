"""Attach masks to a user's model with hooks, and remove them again.

A :class:`Gates` submodule (registered on the model as ``dms_gates``) holds one
:class:`~dmscale.topk.DifferentiableTopK` per width and depth dimension. Hooks:

* a forward pre-hook on the model computes every dimension's mask once per forward;
* a forward pre-hook on each layer that consumes searchable channels multiplies its input by
  the channels' masks, ``X * m`` with m shaped 1xCx1x1 (conv) or C (linear) (paper A.1.1);
* a forward hook on each removable block's branch multiplies the branch output by the
  block's depth mask, so the block computes ``post(x + f(x) * m_i)`` (Sec. 3.2).

Masks act on activations only: no weight is changed and no class is swapped. All hooks are
instances of :class:`DMSHook`, found again by type in :func:`detach`.

Example:
    >>> import torch
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> gates = Gates.attach(net, dims=[(8, 1, 1, 1.0)], depth=[], consumers={"2": (-1, torch.arange(8))}, branches={})
    >>> isinstance(net.dms_gates, Gates)
    True
    >>> _ = detach(net)
    >>> hasattr(net, "dms_gates")
    False
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

from .distributed import is_distributed
from .importance import PendingImportance
from .topk import DifferentiableTopK, GateFactory, StructuralGate

__all__ = ["Gates", "DMSHook", "detach", "GATES_NAME", "assemble_width_mask", "first_input"]

GATES_NAME = "dms_gates"


class DMSHook:
    """Base class of every hook dmscale attaches (so that :func:`detach` finds them)."""


def assemble_width_mask(parts: list[torch.Tensor], derived_a: torch.Tensor, derived_b: torch.Tensor,
                        like: torch.Tensor | None = None) -> torch.Tensor:
    """The global width mask: every dim's element mask, then the derived (product) slots
    ``m[a] * m[b]`` (a or b = -1: factor 1), then a trailing 1 for fixed channels."""
    ref = parts[0] if parts else like
    one = torch.ones(1, device=ref.device if ref is not None else None,
                     dtype=ref.dtype if ref is not None else torch.float32)
    base = torch.cat(parts) if parts else one[:0]
    if len(derived_a):
        ext = torch.cat([base, one])
        n = base.numel()
        a = torch.where(derived_a < 0, n, derived_a)
        b = torch.where(derived_b < 0, n, derived_b)
        return torch.cat([base, ext[a] * ext[b], one])
    return torch.cat([base, one])


class _MaskOutput(DMSHook):
    """Forward hook: multiply a layer's output by its channels' masks (Q' = Q m_qk m_head)."""

    def __init__(self, gates: "Gates", key: str, dim: int) -> None:
        self.gates, self.key, self.dim = gates, key, dim

    def __call__(self, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
        if not self.gates.enabled:
            return None
        m = self.gates.channel_mask(self.key)
        shape = [1] * out.dim()
        shape[self.dim % out.dim()] = m.numel()
        return out * m.view(shape).to(out.dtype)


class _ComputeMasks(DMSHook):
    def __init__(self, gates: "Gates", no_fastpath: bool = False) -> None:
        self.gates = gates
        self.no_fastpath = no_fastpath

    def __call__(self, module: nn.Module, args: tuple) -> None:
        self.gates.compute()
        if self.no_fastpath:  # the fused MHA/encoder kernel would bypass the layer hooks
            self.gates._fastpath = torch.backends.mha.get_fastpath_enabled()
            torch.backends.mha.set_fastpath_enabled(False)


class _RestoreFastpath(DMSHook):
    """Forward hook registered with ``always_call=True``: the global fast-path switch is
    restored even when the forward raises."""

    def __init__(self, gates: "Gates") -> None:
        self.gates = gates

    def __call__(self, module: nn.Module, args: tuple, out: Any) -> None:
        prev = getattr(self.gates, "_fastpath", None)
        if prev is not None:
            torch.backends.mha.set_fastpath_enabled(prev)
            self.gates._fastpath = None


def first_input(args: tuple, kwargs: dict) -> tuple[int | str, torch.Tensor] | None:
    """Where a layer's input is: ``(0, args[0])``, or ``(name, kwargs[name])`` for the first
    tensor keyword when it is called with keywords only (``fc(input=h)``); the tracer reads
    the same input (see :meth:`dmscale.tracer.Tracer._opaque_call`)."""
    if args:
        return (0, args[0]) if isinstance(args[0], torch.Tensor) else None
    for key, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            return key, value
    return None


class _MaskInput(DMSHook):
    """Pre-hook (with kwargs): multiply the layer's input by the masks of its channels,
    ``X * m`` with m shaped 1xCx1x1 (conv) or C (linear), A.1.1."""

    def __init__(self, gates: "Gates", key: str, dim: int) -> None:
        self.gates, self.key, self.dim = gates, key, dim

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        found = first_input(args, kwargs)
        if found is None or not self.gates.enabled:
            return None
        where, x = found
        m = self.gates.channel_mask(self.key)  # (C,)
        shape = [1] * x.dim()
        shape[self.dim % x.dim()] = m.numel()
        masked = x * m.view(shape).to(x.dtype)
        if where == 0:
            return (masked,) + tuple(args[1:]), kwargs
        return args, {**kwargs, where: masked}


class _MaskedNorm(DMSHook):
    """Forward hook (with kwargs) on a norm over the last dim: the output as if mean and
    variance were taken over the kept channels only (weighted by their masks), so hard masks
    give exactly the norm of the pruned model.

    The handler has checked what the layer computes (:mod:`dmscale.norms`): ``kind`` is
    ``"layernorm"`` (``F.layer_norm`` with the module's weight, bias and eps) or ``"rms"``
    (``y = g * x * rsqrt(mean(x^2) + eps)`` for some per-channel g, e.g. ``weight`` or
    ``1 + weight``): an RMS output is rescaled by ``rsqrt(mean_kept + eps) / rsqrt(mean + eps)``,
    which keeps whatever g the layer applies.
    """

    def __init__(self, gates: "Gates", key: str, kind: str, eps: float | None) -> None:
        self.gates, self.key, self.kind, self.eps = gates, key, kind, eps

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor | None:
        found = first_input(args, kwargs)
        if found is None or not self.gates.enabled:
            return None
        x = found[1]
        m = self.gates.channel_mask(self.key).to(torch.float32)  # (C,)
        xf = x.to(torch.float32)
        total = m.sum().clamp_min(1e-6)
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps  # nn.RMSNorm(eps=None)
        if self.kind == "rms":
            ms_kept = (xf * xf * m).sum(-1, keepdim=True) / total
            ms_all = (xf * xf).mean(-1, keepdim=True)
            return (out.to(torch.float32) * torch.rsqrt(ms_kept + eps) / torch.rsqrt(ms_all + eps)).to(out.dtype)
        mean = (xf * m).sum(-1, keepdim=True) / total
        var = (((xf - mean) ** 2) * m).sum(-1, keepdim=True) / total
        y = (xf - mean) * torch.rsqrt(var + eps)
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        if weight is not None:
            y = y * weight
        if isinstance(bias, torch.Tensor):
            y = y + bias
        return y.to(out.dtype)


class _MaskBranch(DMSHook):
    """Forward hook: multiply a residual branch's output by its block's depth mask."""

    def __init__(self, gates: "Gates", dim: int, block: int) -> None:
        self.gates, self.dim, self.block = gates, dim, block

    def __call__(self, module: nn.Module, args: tuple, out: Any) -> Any:
        if not self.gates.enabled:
            return None
        m = self.gates.depth_mask(self.dim)[self.block]
        if isinstance(out, torch.Tensor):
            return out * m.to(out.dtype)
        first = out[0]  # (output, attention weights, ...) as Hugging Face attention returns
        return (first * m.to(first.dtype),) + tuple(out[1:])


class Gates(nn.Module):
    """The structural parameters of one search and the masks they produce."""

    def __init__(self, width: list[StructuralGate], depth: list[StructuralGate]) -> None:
        super().__init__()
        self.width = nn.ModuleList(width)
        self.depth = nn.ModuleList(depth)
        self.mode = "soft"  # "soft" | "hard" | "open" (all ones: the self-check of prepare)
        self.enabled = True
        self.grad_scaler: Any = None  # a GradScaler: importance from unscaled gradients
        self._inv_scale = 1.0
        self.depth_frozen = False  # width-only phase: depth masks hard
        # torch.distributed: None = the default group (when its world size is > 1), False =
        # never synchronise, or a ProcessGroup (the data-parallel ranks)
        self.process_group: Any = None
        self.pending = PendingImportance()  # Eq. 4 updates waiting for the all-reduce
        self._forwards = 0  # training forwards so far: orders pending updates across ranks
        self._masks: torch.Tensor | None = None
        self._depth_masks: list[torch.Tensor] | None = None

    def _apply(self, fn: Any, recurse: bool = True) -> "Gates":
        """``model.to(device)`` moves the gates; ``model.half()`` / ``.to(bfloat16)`` does
        not lower their precision: ``a`` and importance stay float32 (k = round((1-a)N)
        and the moving average need it; masks are cast to the activations' dtype)."""
        super()._apply(fn, recurse)
        for t in list(self.width) + list(self.depth):
            if t.a.dtype != torch.float32:
                t.a.data = t.a.data.float()
            if t.importance.dtype != torch.float32:
                t.importance = t.importance.float()
        return self

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        """Identity: when the model is an ``nn.Sequential``, the gates are its last child
        (until :func:`detach`) and must pass the output through unchanged."""
        return x

    def __getstate__(self) -> dict[str, Any]:
        """Copies (deepcopy, pickle) drop the per-forward mask cache (non-leaf tensors)."""
        state = self.__dict__.copy()
        state["_masks"] = state["_depth_masks"] = None
        state["pending"] = PendingImportance()
        return state

    # ------------------------------------------------------------------ construction
    @classmethod
    def attach(
        cls,
        model: nn.Module,
        dims: list[tuple[int, int, int, float]],
        depth: list[tuple[int, int, int, float]],
        consumers: dict[str, tuple[int, torch.Tensor]],
        branches: dict[str, tuple[int, int]],
        importance: str = "taylor",
        normalize: bool = True,
        norms: dict[str, Any] | None = None,
        outputs: dict[str, tuple[int, Any]] | None = None,
        derived: list[tuple[int, int]] | None = None,
        gate_factory: GateFactory | None = None,
    ) -> "Gates":
        """Create the gates, register them on ``model`` and attach every hook.

        Args:
            dims / depth: per dimension ``(size, step, min_keep, temperature)``.
            consumers: layer name -> (channel dim of its input, global slot per channel,
                -1 for a fixed channel).
            branches: module name -> (depth dim, block index).
            gate_factory: builds each gate (default :class:`DifferentiableTopK`, DMS's own);
                a baseline gate implementing :class:`~dmscale.topk.StructuralGate`.
        """
        if hasattr(model, GATES_NAME):
            raise ValueError(
                f"model already has a {GATES_NAME!r} submodule: it is prepared for a search "
                "already; call dmscale.detach(model) first"
            )
        factory = DifferentiableTopK if gate_factory is None else gate_factory
        make = lambda spec: factory(  # noqa: E731
            spec[0], step=spec[1], min_keep=spec[2], temperature=spec[3],
            importance=importance, normalize=normalize,
        )
        gates = cls([make(s) for s in dims], [make(s) for s in depth])
        pairs = torch.tensor(derived or [], dtype=torch.long).reshape(-1, 2)
        gates.register_buffer("derived_a", pairs[:, 0].clone(), persistent=False)
        gates.register_buffer("derived_b", pairs[:, 1].clone(), persistent=False)
        model.add_module(GATES_NAME, gates)
        modules = dict(model.named_modules())
        has_mha = any(isinstance(m, nn.MultiheadAttention) for m in model.modules())
        model.register_forward_pre_hook(_ComputeMasks(gates, no_fastpath=has_mha))
        if has_mha:
            model.register_forward_hook(_RestoreFastpath(gates), always_call=True)
        for name, (dim, slots) in consumers.items():
            key = "idx_" + name.replace(".", "__")
            gates.register_buffer(key, torch.as_tensor(slots, dtype=torch.long), persistent=False)
            modules[name].register_forward_pre_hook(_MaskInput(gates, key, dim), with_kwargs=True)
        for name, (slots, kind, eps) in (norms or {}).items():
            key = "idx_" + name.replace(".", "__")
            gates.register_buffer(key, torch.as_tensor(slots, dtype=torch.long), persistent=False)
            modules[name].register_forward_hook(_MaskedNorm(gates, key, kind, eps), with_kwargs=True)
        for name, (dim, slots) in (outputs or {}).items():
            key = "out_" + name.replace(".", "__")
            gates.register_buffer(key, torch.as_tensor(slots, dtype=torch.long), persistent=False)
            modules[name].register_forward_hook(_MaskOutput(gates, key, dim))
        for name, (j, i) in branches.items():
            modules[name].register_forward_hook(_MaskBranch(gates, j, i))
        return gates

    # ------------------------------------------------------------------ masks
    def compute(self) -> None:
        """Compute every mask once for this forward (and hook Taylor importance).

        Under torch.distributed a training forward first applies the updates the previous
        backward left pending (:meth:`sync_importance`), exactly as one process would have
        applied them in its backward: every rank runs its training forwards in lockstep
        under DDP, so this all-reduce is matched on every rank.
        """
        track = torch.is_grad_enabled() and self.training and self.mode == "soft"
        if track and len(self.pending):
            self.sync_importance()
        scaler = self.grad_scaler
        if track and scaler is not None and scaler.is_enabled():
            self._inv_scale = 1.0 / scaler.get_scale()  # the scale this step's backward uses
        else:
            self._inv_scale = 1.0
        defer = track and is_distributed(self.process_group)
        if track:
            self._forwards += 1
        n = len(self.width)
        parts = [self._mask(t, track, defer, i) for i, t in enumerate(self.width)]
        self._masks = assemble_width_mask(parts, self.derived_a, self.derived_b,
                                          like=torch.ones(1, device=self._device()))
        self._depth_masks = [t.hard_mask() if self.depth_frozen and self.mode != "open"
                             else self._mask(t, track, defer, n + j) for j, t in enumerate(self.depth)]

    def _mask(self, topk: StructuralGate, track: bool, defer: bool = False, index: int = 0) -> torch.Tensor:
        if self.mode == "hard":
            return topk.hard_mask()
        if self.mode == "open":
            return torch.ones(topk.size, device=topk.a.device)
        unit = topk.unit_soft_mask()
        if track and unit.requires_grad:
            unit.register_hook(self._importance_hook(topk, unit.detach(), defer, index))
        return topk.expand(unit)

    def _importance_hook(self, topk: StructuralGate, value: torch.Tensor, defer: bool,
                         index: int) -> Any:
        """The mask's gradient hook: Eq. 4 from the unscaled task-loss gradient, now (one
        process) or after the all-reduce of :meth:`sync_importance` (torch.distributed)."""
        inv, key = self._inv_scale, (self._forwards, index)

        def hook(g: torch.Tensor) -> None:
            g = g * inv if inv != 1.0 else g
            if defer:
                self.pending.add(key, topk, value, g)
            else:
                topk.update_importance(value, g)
        return hook

    def sync_importance(self) -> int:
        """Average the pending mask gradients over the ranks (one all-reduce) and apply
        their Eq. 4 updates; returns how many were applied (0: nothing pending)."""
        return self.pending.flush(self.process_group)

    def channel_mask(self, key: str) -> torch.Tensor:
        if self._masks is None:
            self.compute()
        return self._masks[getattr(self, key)]

    def depth_mask(self, j: int) -> torch.Tensor:
        if self._depth_masks is None:
            self.compute()
        return self._depth_masks[j]

    def _device(self) -> torch.device:
        return self.width[0].a.device if len(self.width) else (
            self.depth[0].a.device if len(self.depth) else torch.device("cpu"))

    @contextlib.contextmanager
    def use(self, mode: str | None = None, enabled: bool = True) -> Iterator[None]:
        """Temporarily switch mask mode ("soft"/"hard") or disable masking."""
        prev = (self.mode, self.enabled)
        self.mode = mode or self.mode
        self.enabled = enabled
        self._masks = self._depth_masks = None
        try:
            yield
        finally:
            self.mode, self.enabled = prev
            self._masks = self._depth_masks = None


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
