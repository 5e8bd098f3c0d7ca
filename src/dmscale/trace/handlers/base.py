"""Layer handlers: how a layer maps channel labels, and how it is physically shrunk.

A handler is registered for a module type. During discovery the layer is one opaque
operation: the handler reads the label of its input, says which channel ids its input and
output carry, and the tracer does not look inside. At export, ``prune`` slices the weights.
Users register handlers for their own layers with :func:`register_handler`.

Example:
    >>> import torch
    >>> from torch import nn
    >>> conv = nn.Conv2d(4, 6, 3)
    >>> HANDLERS_BY_NAME["conv"].prune(conv, torch.tensor([0, 2]), torch.tensor([1, 3, 5]))
    >>> tuple(conv.weight.shape), conv.in_channels, conv.out_channels
    ((3, 2, 3, 3), 2, 3)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

if TYPE_CHECKING:
    from dmscale.trace.protocol import TraceRecorder
    from dmscale.trace.graph import Label

__all__ = [
    "Handler",
    "ParamDims",
    "register_handler",
    "register_weight_standardised",
    "handler_for",
    "HANDLERS_BY_NAME",
    "register_family_loader",
    "load_families",
]

# param name -> {tensor dim: "in" | "out"}: which channel side each weight dim follows
ParamDims = dict[str, dict[int, str]]


@dataclass
class Handler:
    """How one family of layers is traced, costed and shrunk.

    Attributes:
        name: a short unique name, stored in structure files.
        trace: ``(tracer, name, module, args, output) -> None``; must call
            ``tracer.record_layer`` and set the output label.
        prune: ``(module, in_keep, out_keep) -> None``: slice in place (``None`` = keep all).
        param_dims: ``module -> ParamDims``: which channel side each parameter dim follows.
        macs_dims: which sides scale the layer's MACs (("in", "out") for a dense conv,
            ("out",) for a depthwise conv whose input and output are the same channels).
            A layer whose MACs scale with "in" mixes its input channels: its input is
            multiplied by the channel masks during the search.
        channel_dim: the dim of the layer's first input that holds the channels.
        output_layer: ``module -> child name or None``: the child whose output the module
            returns as its (first) output, through dropout at most (an attention's output
            projection); a residual branch ending in the module takes its depth mask there.
        kv_shape: ``module -> (key/value heads, head dim)`` of an attention layer, read from
            the module as it is now (a pruned one gives its kept counts): what one token
            adds to its key/value cache (:mod:`dmscale.cost.kv_cache`); None for the others.
    """

    name: str
    trace: Callable[..., None]
    prune: Callable[[nn.Module, torch.Tensor | None, torch.Tensor | None], None]
    param_dims: Callable[[nn.Module], ParamDims]
    macs_dims: Callable[[nn.Module], tuple[str, ...]]
    channel_dim: int = 1
    output_layer: Callable[[nn.Module], str | None] | None = None
    kv_shape: Callable[[nn.Module], tuple[int, int]] | None = None


_REGISTRY: list[tuple[type | Callable[[nn.Module], bool], Handler]] = []
HANDLERS_BY_NAME: dict[str, Handler] = {}


def register_handler(module_type: type | Callable[[nn.Module], bool], handler: Handler) -> None:
    """Register ``handler`` for ``module_type`` (and subclasses), or for every module a
    predicate ``module -> bool`` accepts; the most recent registration wins."""
    _REGISTRY.insert(0, (module_type, handler))
    HANDLERS_BY_NAME[handler.name] = handler


_FAMILY_LOADERS: list[Callable[[], None]] = []


def register_family_loader(loader: Callable[[], None]) -> None:
    """Register ``loader``, called before every trace and structure application: a family
    of handlers for a third-party library (timm, transformers) registers itself there once
    that library is imported, so dmscale never imports it on its own."""
    if loader not in _FAMILY_LOADERS:
        _FAMILY_LOADERS.append(loader)


def load_families() -> None:
    """Run every registered family loader (cheap when nothing new was imported)."""
    for loader in _FAMILY_LOADERS:
        loader()


def handler_for(module: nn.Module) -> Handler | None:
    """The handler of the most recent registration that matches ``module``."""
    for key, handler in _REGISTRY:
        if isinstance(key, type):
            if isinstance(module, key):
                return handler
        elif key(module):
            return handler
    return None


# ----------------------------------------------------------------------------- helpers


def _slice_param(module: nn.Module, name: str, dim: int, keep: torch.Tensor | None) -> None:
    p = getattr(module, name, None)
    if p is None or keep is None:
        return
    data = p.data.index_select(dim, keep.to(p.device)).clone()
    if isinstance(p, nn.Parameter):
        setattr(module, name, nn.Parameter(data, requires_grad=p.requires_grad))
    else:
        setattr(module, name, data)


def _is_depthwise(conv: nn.Module) -> bool:
    return conv.groups > 1 and conv.groups == conv.in_channels == conv.out_channels


# ----------------------------------------------------------------------------- conv

# the functions a conv or linear layer applies its own weight with
_LAYER_FUNCTIONS = {"conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
                    "conv_transpose3d", "linear", "addmm", "matmul"}

_WEIGHT_STANDARDISED: list[type] = []


def register_weight_standardised(cls: type) -> None:
    """Declare a conv subclass that standardises each filter over its fan-in (input channels
    x kernel) before convolving, and whose other own parameters (a ``gain``) have one entry
    per output channel. Its output channels are searched; its input channels stay fixed,
    since removing one would change every filter's mean and variance."""
    if cls not in _WEIGHT_STANDARDISED:
        _WEIGHT_STANDARDISED.append(cls)


def _is_weight_standardised(m: nn.Module) -> bool:
    return isinstance(m, tuple(_WEIGHT_STANDARDISED))


def _per_output_params(m: nn.Module) -> list[str]:
    """Own parameters besides weight and bias with one entry per output channel (dim 0):
    the ``gain`` of a scaled weight-standardised conv."""
    if not _is_weight_standardised(m):
        return []
    return [n for n, p in m.named_parameters(recurse=False)
            if n not in ("weight", "bias") and p.dim() >= 1 and p.shape[0] == m.out_channels]


def _transformed_weights(tr: "TraceRecorder", name: str) -> set[str]:
    """The functions other than the layer's own conv/linear that read its parameters
    during the trace (weight standardisation, weight norm, a learned scale ...)."""
    return tr.opaque_param_uses.get(name, set()) - _LAYER_FUNCTIONS


def _fixed_layer(tr: "TraceRecorder", name: str, m: nn.Module, lab: "Label | None", out: torch.Tensor,
                 n_out: int, out_dim: int, handler: str, reason: str) -> None:
    """Record a layer whose input and output channels both stay fixed."""
    tr.pin_label(lab, reason)
    out_ids = tr.produce(name, n_out)
    tr.pin_ids(out_ids, reason)
    tr.record_layer(name, handler, None, None)
    tr.set_label(out, out_dim % out.dim(), out_ids)


def _transform_reason(name: str, m: nn.Module, uses: set[str]) -> str:
    return (f"{type(m).__name__} {name} transforms its parameters before applying them "
            f"({', '.join(sorted(uses))}): widths fixed; register a handler for it "
            "(dmscale.register_handler) to search them")


def _conv_trace(tr: "TraceRecorder", name: str, m: nn.Module, args: tuple, out: torch.Tensor) -> None:
    x = args[0]
    lab = tr.label_of(x)
    uses = _transformed_weights(tr, name)
    ws = _is_weight_standardised(m)
    if uses and not ws:
        return _fixed_layer(tr, name, m, lab, out, m.out_channels, 1, "conv", _transform_reason(name, m, uses))
    if m.groups == 1:
        if ws:  # each filter is normalised over all its input channels: inputs fixed
            tr.pin_label(lab, f"weight-standardised conv {name} normalises each filter over "
                              "its input channels")
            in_ids = None
        else:
            in_ids = tr.take_channel_label(lab, 1, f"input of {name}")
        out_ids = tr.produce(name, m.out_channels)
        tr.record_layer(name, "conv", in_ids, out_ids)
        tr.set_label(out, 1, out_ids)
    elif _is_depthwise(m) and lab is not None and lab.dim == 1:
        # a depthwise filter sees one channel: standardising it needs no other channel
        tr.record_layer(name, "conv", lab.ids, lab.ids)
        tr.set_label(out, 1, lab.ids)
    else:  # grouped or channel-multiplier conv: widths fixed (see README)
        tr.pin_label(lab, f"grouped conv {name} (groups={m.groups})")
        tr.record_layer(name, "conv", None, None)


def _conv_prune(m: nn.Module, in_keep: torch.Tensor | None, out_keep: torch.Tensor | None) -> None:
    for pname in _per_output_params(m):  # before the weight: it compares with out_channels
        _slice_param(m, pname, 0, out_keep)
    _slice_param(m, "weight", 0, out_keep)
    _slice_param(m, "bias", 0, out_keep)
    if _is_depthwise(m):
        m.in_channels = m.out_channels = m.groups = m.weight.shape[0]
        return
    _slice_param(m, "weight", 1, in_keep)
    m.out_channels = m.weight.shape[0]
    m.in_channels = m.weight.shape[1] * m.groups


def _conv_param_dims(m: nn.Module) -> ParamDims:
    extra: ParamDims = {p: {0: "out"} for p in _per_output_params(m)}
    if _is_depthwise(m):
        return {"weight": {0: "out"}, "bias": {0: "out"}, **extra}
    return {"weight": {0: "out", 1: "in"}, "bias": {0: "out"}, **extra}


def _conv_macs_dims(m: nn.Module) -> tuple[str, ...]:
    return ("out",) if _is_depthwise(m) else ("in", "out")


CONV = Handler("conv", _conv_trace, _conv_prune, _conv_param_dims, _conv_macs_dims)

# ----------------------------------------------------------------------------- linear


def _linear_trace(tr: "TraceRecorder", name: str, m: nn.Linear, args: tuple, out: torch.Tensor) -> None:
    x = args[0]
    uses = _transformed_weights(tr, name)
    if uses:
        return _fixed_layer(tr, name, m, tr.label_of(x), out, m.out_features, -1, "linear",
                            _transform_reason(name, m, uses))
    in_ids = tr.take_channel_label(tr.label_of(x), x.dim() - 1, f"input of {name}")
    out_ids = tr.produce(name, m.out_features)
    tr.record_layer(name, "linear", in_ids, out_ids)
    tr.set_label(out, out.dim() - 1, out_ids)


def _linear_prune(m: nn.Module, in_keep: torch.Tensor | None, out_keep: torch.Tensor | None) -> None:
    _slice_param(m, "weight", 0, out_keep)
    _slice_param(m, "bias", 0, out_keep)
    _slice_param(m, "weight", 1, in_keep)
    m.out_features, m.in_features = m.weight.shape


LINEAR = Handler(
    "linear",
    _linear_trace,
    _linear_prune,
    lambda m: {"weight": {0: "out", 1: "in"}, "bias": {0: "out"}},
    lambda m: ("in", "out"),
    channel_dim=-1,
)

# ----------------------------------------------------------------------------- norms


def _channelwise_trace(kind: str, dim_of: Callable[[torch.Tensor], int]) -> Callable[..., None]:
    """A layer that acts on each channel of dim ``dim_of(x)`` on its own (BN, per-channel GN)."""

    def trace(tr: "TraceRecorder", name: str, m: nn.Module, args: tuple, out: torch.Tensor) -> None:
        x = args[0]
        lab = tr.label_of(x)
        dim = dim_of(x)
        if lab is not None and lab.dim == dim and _channelwise_ok(m):
            tr.record_layer(name, kind, lab.ids, lab.ids)
            tr.set_label(out, dim, lab.ids)
        else:
            tr.pin_label(lab, f"{type(m).__name__} {name} mixes channels")
            tr.record_layer(name, kind, None, None)

    return trace


def _channelwise_ok(m: nn.Module) -> bool:
    if isinstance(m, nn.GroupNorm):
        return m.num_groups == m.num_channels
    return True


def _norm_prune(m: nn.Module, in_keep: torch.Tensor | None, out_keep: torch.Tensor | None) -> None:
    keep = out_keep if out_keep is not None else in_keep
    if keep is None:
        return
    for pname in ("weight", "bias", "running_mean", "running_var"):
        _slice_param(m, pname, 0, keep)
    n = int(keep.numel())
    if isinstance(m, nn.GroupNorm):
        m.num_groups = m.num_channels = n
    else:
        m.num_features = n


_NORM_DIMS = lambda m: {"weight": {0: "out"}, "bias": {0: "out"}}  # noqa: E731

BATCHNORM = Handler(
    "batchnorm", _channelwise_trace("batchnorm", lambda x: 1), _norm_prune, _NORM_DIMS,
    lambda m: ("out",),
)
GROUPNORM = Handler(
    "groupnorm", _channelwise_trace("groupnorm", lambda x: 1), _norm_prune, _NORM_DIMS,
    lambda m: ("out",),
)


# ----------------------------------------------------------------------------- embedding


def _embedding_trace(tr: "TraceRecorder", name: str, m: nn.Embedding, args: tuple, out: torch.Tensor) -> None:
    out_ids = tr.produce(name, m.embedding_dim)
    tr.record_layer(name, "embedding", None, out_ids)
    tr.set_label(out, out.dim() - 1, out_ids)


def _embedding_prune(m: nn.Module, in_keep: torch.Tensor | None, out_keep: torch.Tensor | None) -> None:
    _slice_param(m, "weight", 1, out_keep)
    m.embedding_dim = m.weight.shape[1]


EMBEDDING = Handler(
    "embedding", _embedding_trace, _embedding_prune, lambda m: {"weight": {1: "out"}},
    lambda m: (), channel_dim=-1,
)

for _typ, _h in [
    (nn.Embedding, EMBEDDING),
    (nn.GroupNorm, GROUPNORM),
    (nn.modules.batchnorm._BatchNorm, BATCHNORM),
    (nn.Linear, LINEAR),
    (nn.Conv1d, CONV),
    (nn.Conv2d, CONV),
    (nn.Conv3d, CONV),
]:
    register_handler(_typ, _h)
