"""The bytes one training step's forward and backward pass hold, traced without data.

:func:`trace_step` runs ``forward_loss`` on a copy of the model whose parameters and buffers
are fake tensors (``torch._subclasses.fake_tensor.FakeTensorMode``: shapes and dtypes only, no
storage, so a 7 B model at a real batch costs nothing to trace), then ``loss.backward()``, and
counts the bytes of every tensor storage an operator creates, from its creation until it is
freed (a ``TorchDispatchMode`` that keeps a weak reference to each storage). The model itself
is not touched: its parameters get no gradients and its importance buffers no update.

What it reports, all in bytes (:class:`StepTrace`):

* ``peak``: the most bytes alive at once during the forward, the loss and the backward pass
  (activations saved for the backward pass, temporaries, and the gradients produced so far);
* ``peak_without_grads``: the same without the parameters' gradients (what a sharded run
  holds besides its shard of them);
* ``saved``: the storages the autograd graph holds for the backward pass when the loss is
  computed (each storage once; the parameters themselves left out);
* ``grads``: the parameters' gradients at the end of the backward pass.

The weights, the optimiser state and a teacher's weights exist before the step and are not
counted here (:func:`dmscale.engine.memory.estimate_search_memory` adds them).

Example:
    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    >>> t = trace_step(net, lambda m: m(torch.randn(32, 64)).square().mean())
    >>> t.grads == 4 * sum(p.numel() for p in net.parameters()), t.saved >= 32 * 256 * 4
    (True, True)
    >>> all(p.grad is None for p in net.parameters())
    True
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dmscale.core.masks import GATES_NAME

__all__ = ["StepTrace", "trace_step"]


@dataclass(frozen=True)
class StepTrace:
    """Bytes of one traced forward + backward pass (see the module docstring)."""

    peak: int
    peak_without_grads: int
    saved: int
    grads: int


class _LiveBytes(TorchDispatchMode):
    """Every storage an operator returns, counted from its creation until it is freed; the
    timeline of (storage, +/- bytes) is kept so the gradients can be told apart afterwards.
    A storage is known by a serial number, not by its address (``_cdata``), which a later
    storage may reuse once it is freed."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[int, int]] = {}  # address -> (serial, bytes) of a live storage
        self.refs: dict[int, weakref.ref] = {}
        self.events: list[tuple[int, int]] = []  # (serial, +/- bytes)

    def _freed(self, key: int, serial: int) -> None:
        entry = self.live.get(key)
        if entry is None or entry[0] != serial:
            return
        del self.live[key]
        self.refs.pop(key, None)
        self.events.append((serial, -entry[1]))

    def serial(self, storage: Any) -> int | None:
        """The serial number of a live ``storage`` (None: no operator made it)."""
        entry = self.live.get(storage._cdata)
        return None if entry is None else entry[0]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage._cdata
                if key not in self.live:
                    serial, size = len(self.events), storage.nbytes()
                    self.live[key] = (serial, size)
                    self.refs[key] = weakref.ref(storage, lambda _r, k=key, n=serial: self._freed(k, n))
                    self.events.append((serial, size))
        return out

    def peak(self, leave_out: set[int] = frozenset()) -> int:  # type: ignore[assignment]
        """The most bytes alive at once, the storages of the serial numbers ``leave_out`` left out."""
        now = top = 0
        for serial, size in self.events:
            if serial not in leave_out:
                now += size
                top = max(top, now)
        return top


def _fake_copy(model: nn.Module, mode: Any, param_dtype: torch.dtype | None = None) -> nn.Module:
    """A deep copy of ``model`` (hooks and gates included) whose parameters and buffers are
    fake tensors of the same shapes, dtypes and devices (tied parameters stay tied); its
    floating parameters outside the gates in ``param_dtype`` when given."""
    def fake(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype if dtype is not None and t.is_floating_point() else t.dtype
        if t.device.type != "meta":
            with mode:
                return mode.from_tensor(t.detach()).to(dtype)
        with mode:  # a meta tensor becomes a fake CPU one: the CPU kernels (flash attention) run
            return torch.empty_strided(t.shape, t.stride(), dtype=dtype, device="cpu")

    memo: dict[int, Any] = {}
    gates = {id(p) for n, p in model.named_parameters() if n.startswith(GATES_NAME + ".")}
    for p in model.parameters():
        dtype = None if id(p) in gates else param_dtype
        memo[id(p)] = nn.Parameter(fake(p, dtype), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = fake(b)
    return copy.deepcopy(model, memo)


def trace_step(model: nn.Module, forward_loss: Callable[[nn.Module], torch.Tensor],
               autocast: torch.dtype | None = None, param_dtype: torch.dtype | None = None) -> StepTrace:
    """Trace ``forward_loss(copy)`` and its ``backward()`` on a fake copy of ``model``.

    Args:
        model: the (prepared) model; real, or on the ``meta`` device (only shapes are read; the
            copy of a meta model lives on a fake CPU device, so make the inputs on
            ``next(copy.parameters()).device``).
        forward_loss: called inside ``FakeTensorMode`` with the copy; makes its own inputs
            (``torch.randint(...)`` there gives fake tensors) and returns the scalar loss. A
            teacher it calls may be the real module (it runs without gradients).
        autocast: run ``forward_loss`` under ``torch.autocast`` to this dtype (``--precision
            bf16``: ``torch.bfloat16``), on the device type of the model's parameters.
        param_dtype: the dtype of the copy's weights (the gates' ``a`` stay float32): what
            FSDP gathers under ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = _fake_copy(model, mode, param_dtype)
    device = next((p.device for p in fake.parameters()), torch.device("cpu"))
    dtype_ctx = (torch.autocast(device.type, dtype=autocast)
                 if autocast is not None else contextlib.nullcontext())
    refs: list[weakref.ref] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        refs.append(weakref.ref(t))
        return t

    with mode, _LiveBytes() as live:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), dtype_ctx:
            loss = forward_loss(fake)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(f"forward_loss must return a scalar tensor, got "
                            f"{type(loss).__name__}{tuple(getattr(loss, 'shape', ()))}")
        weights = {p.untyped_storage()._cdata for p in fake.parameters()}
        held: dict[int, int] = {}
        for ref in refs:
            t = ref()
            if t is not None and t.untyped_storage()._cdata not in weights:
                s = t.untyped_storage()
                held[s._cdata] = s.nbytes()
        del refs
        loss.backward()
        del loss
        grads = {p.grad.untyped_storage()._cdata: p.grad.untyped_storage() for p in fake.parameters()
                 if p.grad is not None}
        serials = {live.serial(g) for g in grads.values()} - {None}
        return StepTrace(peak=live.peak(), peak_without_grads=live.peak(serials),
                         saved=sum(held.values()), grads=sum(g.nbytes() for g in grads.values()))
