"""The masked norms compiled into fused kernels (``SearchConfig(fuse_norms=...)``).

A masked LayerNorm (:class:`~dmscale.core.masked_norm.MaskedLayerNorm`) is about 15 operators
forward and 25 backward in eager mode, each a full pass over the activation: on a GPU the
masked norms of a ViT are most of what a search step adds. Here the same autograd functions
run under ``torch.compile`` (``dynamic=True``: one graph for every norm of a channel count,
class and eps whatever its batch and length, a compiled copy per such configuration):
inductor fuses each direction into a few kernels. The saved tensors and the
closed-form backward are the functions' own, so the results equal the eager ones up to
float rounding (the order of the fused reductions).

``fuse`` None (auto): fused when the activation is on a CUDA device, eager elsewhere (a CPU
run would spend more time compiling than it saves). Calls that cannot be fused run eagerly:
inside a ``torch.compile`` of the whole model (which fuses them itself), on meta or fake
tensors (the memory plan, ``prepare`` on meta), and for the rest of the process once a
compilation failed (one warning names the error).

Both take the statistics' weights p (:func:`~dmscale.core.masked_norm.mask_weights` of the
mask, computed once for all the norms that read it), not the mask.

Example:
    >>> import torch
    >>> from dmscale.core.masked_norm import mask_weights, masked_layer_norm
    >>> x, m = torch.randn(2, 5, 8), torch.rand(8)
    >>> w, b = torch.ones(8), torch.zeros(8)
    >>> y = layer_norm(x, mask_weights(m), w, b, 1e-5, fuse=False)  # eager: the function itself
    >>> torch.equal(y, masked_layer_norm(x, m, w, b, 1e-5))
    True
"""

from __future__ import annotations

import itertools
import math
import types
import warnings
from typing import Any, Callable

import torch
from torch import nn

from dmscale.core.masked_norm import MaskedLayerNorm, MaskedRMSNorm, MaskedRMSRescale

__all__ = ["FUSE_BACKEND", "layer_norm", "rms_norm", "rms_rescale", "fusion_state", "fusion_failure",
           "reset_fusion"]

FUSE_BACKEND: Any = "inductor"  # tests use "aot_eager" (the same graphs, no kernel compiler)

# one compiled copy per function and norm configuration (see _fused)
_compiled: dict[tuple, Callable[..., torch.Tensor]] = {}
_copies = itertools.count()
_failure: list[str] = []  # the first compilation error: every later call runs eagerly


def fusion_state() -> dict[str, Any] | None:
    """What this process's masked norms ran as: ``{"compiled": the functions run compiled
    ("layer_norm", "rms_norm", "rms_rescale"), "failure": the compiler error that stopped them}``; None
    when neither happened (no masked norm, or every call eager)."""
    if not (_compiled or _failure):
        return None
    return {"compiled": sorted({key[0] for key in _compiled}), "failure": fusion_failure()}


def reset_fusion() -> None:
    """Forget which functions ran compiled and any compiler failure (a run of the command line
    starts: its summary reports its own; the next call compiles again)."""
    _compiled.clear()
    _failure.clear()


def fusion_failure() -> str | None:
    """The error that turned fusion off in this process (None: it has not failed)."""
    return _failure[0] if _failure else None


def _ln(x: torch.Tensor, p: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
        eps: float) -> torch.Tensor:
    return MaskedLayerNorm.apply(x, p, weight, bias, eps)


def _rms_norm(x: torch.Tensor, p: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
              out_dtype: torch.dtype) -> torch.Tensor:
    return MaskedRMSNorm.apply(x, p, weight, eps, offset, out_dtype)


def _rms(out: torch.Tensor, x: torch.Tensor, p: torch.Tensor, norm: nn.Module | None, eps: float) -> torch.Tensor:
    # the module, not its bound forward, is the argument: one graph serves every norm module
    return MaskedRMSRescale.apply(out, x, p, eps, norm.forward if norm is not None else None)


def _fusable(fuse: bool | None, x: torch.Tensor) -> bool:
    # cheapest first: a norm asks on every call (detect_fake_mode alone is ~20 us of Python)
    if not (x.is_cuda if fuse is None else fuse) or _failure or torch.compiler.is_compiling():
        return False
    # meta or fake tensors (the memory plan, prepare on meta): a fake tensor is a subclass
    return x.device.type != "meta" and (type(x) is torch.Tensor or torch._guards.detect_fake_mode(x) is None)


def _backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
    """:data:`FUSE_BACKEND`, compiling the backward graph with the forward (dynamo calls it only
    when it compiles: nothing is added to a call that runs compiled code)."""
    import torch._functorch.config as functorch_config  # (here: importing it imports dynamo, ~1 s)

    backend = torch._dynamo.lookup_backend(FUSE_BACKEND) if isinstance(FUSE_BACKEND, str) else FUSE_BACKEND
    # compile the backward graph with the forward (torch >= 2.10 has the switch), so that its
    # failure is caught below and not raised in the user's loss.backward()
    eager_backward = ({"force_non_lazy_backward_lowering": True}
                      if hasattr(functorch_config, "force_non_lazy_backward_lowering") else {})
    with functorch_config.patch(**eager_backward):
        return backend(gm, example_inputs)


def _own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of ``fn`` with a code object of its own: dynamo keeps compiled code, and counts
    recompilations against ``torch._dynamo.config.recompile_limit`` (8), per code object."""
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{next(_copies)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def _dynamo_errors() -> tuple[type[BaseException], ...]:
    """What tracing or the backend raise (read when one is raised: dynamo is imported by then,
    and importing it with this module would add a second to every ``import dmscale``)."""
    exc = torch._dynamo.exc
    return tuple(e for e in (exc.TorchDynamoException, getattr(exc, "FailOnRecompileLimitHit", None))
                 if e is not None)


def _bind(fn: Callable[..., torch.Tensor], constants: tuple) -> Callable[..., torch.Tensor]:
    """``fn`` with its trailing ``constants`` (eps, offset; a dtype by name) written into the
    code as literals: dynamo makes a float argument (or one read from a closure) an input of the
    graph, a 0-d tensor built on every call (``torch.as_tensor``: 3 operators per float per
    call), while a literal is a constant of the graph. ``repr`` of a float reads back the same
    float.

        >>> import numpy as np
        >>> _bind(lambda *a: a, (np.float64(1e-5), 1, torch.float32))("x")
        ('x', 1e-05, 1, torch.float32)
    """
    literals = []
    for c in constants:
        if isinstance(c, float) and not math.isfinite(c):
            return lambda *args: fn(*args, *constants)  # (no literal for inf or nan)
        # (float(c), int(c): a numpy scalar's repr is not a literal)
        literals.append(repr(c) if isinstance(c, bool) else repr(int(c)) if isinstance(c, int)
                        else repr(float(c)) if isinstance(c, float) else f"_c{len(literals)}")
    namespace: dict[str, Any] = {"_fn": fn, **{f"_c{i}": c for i, c in enumerate(constants)}}
    exec(f"def bound(*args):\n    return _fn(*args, {', '.join(literals)})", namespace)  # noqa: S102
    return namespace["bound"]


def _fused(name: str, fn: Callable[..., torch.Tensor], args: tuple, fuse: bool | None,
           x: torch.Tensor, configuration: tuple, constants: tuple = ()) -> torch.Tensor | None:
    """``fn(*args)`` compiled; None (the caller runs it eagerly) when it is not to be fused
    for activation ``x`` (:func:`_fusable`) or compiling it failed.

    Each ``configuration`` (what dynamo specialises a graph on whatever ``dynamic=True`` says:
    the channel count, which a norm's weight, a static parameter, fixes; the norm's class; eps)
    gets a compiled copy of its own, so a process that meets many (a model with norms of
    several widths, several models in one notebook) never reaches dynamo's recompilation limit,
    which under ``fullgraph=True`` raises instead of running eagerly (it did at the ninth)."""
    if not _fusable(fuse, x):
        return None
    key = (name, *configuration)
    compiled = _compiled.get(key)
    if compiled is None:
        compiled = _compiled[key] = torch.compile(_own_code(_bind(fn, constants)), dynamic=True, fullgraph=True,
                                                  backend=_backend)
    try:
        with warnings.catch_warnings():
            # torch's own warnings while dynamo traces (it reads .grad of the non-leaf activation,
            # instantiates autograd functions): not the user's concern, errors under -W error
            warnings.filterwarnings("ignore", module=r"torch(\.|$)")
            return compiled(*args)
    except _dynamo_errors() as err:  # (not a run error: those propagate)
        cause = getattr(err, "inner_exception", None) or err
        first = (str(cause).strip().splitlines() or [""])[0][:200]
        _failure.append(f"{type(cause).__name__}: {first}")
        warnings.warn(f"fused masked norms: torch.compile (backend {FUSE_BACKEND}) failed ({_failure[0]}); "
                      "the masked norms run eagerly from now on (same results, more kernels). "
                      "SearchConfig(fuse_norms=False) / --fuse-norms false skips the attempt",
                      RuntimeWarning, stacklevel=3)
        return None


def layer_norm(x: torch.Tensor, p: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
               eps: float, fuse: bool | None = None) -> torch.Tensor:
    """:class:`~dmscale.core.masked_norm.MaskedLayerNorm` with weights ``p`` (C,), fused when
    ``fuse`` (None: on CUDA)."""
    y = _fused("layer_norm", _ln, (x, p, weight, bias), fuse, x,
               (p.numel(), weight is None, bias is None, eps), (eps,))
    return y if y is not None else _ln(x, p, weight, bias, eps)


def rms_norm(x: torch.Tensor, p: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
             out_dtype: torch.dtype, fuse: bool | None = None) -> torch.Tensor:
    """:class:`~dmscale.core.masked_norm.MaskedRMSNorm` with weights ``p`` (C,), fused when
    ``fuse`` (None: on CUDA)."""
    y = _fused("rms_norm", _rms_norm, (x, p, weight), fuse, x,
               (p.numel(), offset, eps, out_dtype), (eps, offset, out_dtype))
    return y if y is not None else _rms_norm(x, p, weight, eps, offset, out_dtype)


def rms_rescale(out: torch.Tensor, x: torch.Tensor, p: torch.Tensor, eps: float, norm: nn.Module | None = None,
                fuse: bool | None = None) -> torch.Tensor:
    """:class:`~dmscale.core.masked_norm.MaskedRMSRescale` with weights ``p`` (C,), fused when
    ``fuse`` (None: on CUDA); ``norm``: the norm module whose forward the backward computes
    again (None: keep y)."""
    y = _fused("rms_rescale", _rms, (out, x, p, norm), fuse, x,
               (p.numel(), type(norm) if norm is not None else None, eps), (eps,))
    return y if y is not None else _rms(out, x, p, norm, eps)
