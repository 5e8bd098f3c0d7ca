"""Find a model's structural dimensions by running it once on example inputs.

The :class:`Tracer` runs the model under a ``TorchFunctionMode`` and forward hooks. Handled
layers (conv, linear, norms, ... see :mod:`dmscale.handlers`) are opaque operations; every
other torch function is mapped by :mod:`dmscale.rules`. Layers without a handler are traced
through: a parameter that meets channels element-wise (a layer scale) is sliced with them,
unless some other function also reads it; whatever no rule understands fixes the channels it
touches. The result, a :class:`SearchSpace`, holds:

* width dimensions: sets of channels that must be kept or removed together (a conv's output
  channels tied through residual adds, SE gates, depthwise convs and norms);
* depth dimensions: per stage (parent module), the residual blocks ``y = act(x + f(x))``
  whose branch f can be removed;
* per handled layer, the dimension slot of each of its input and output channels.

Example:
    >>> import torch
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 1))
    >>> space = discover(net, (torch.randn(1, 3, 8, 8),))
    >>> [(d.name, d.size) for d in space.width]
    [('0', 8)]
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import numpy as np
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from .errors import UnsupportedLayerError
from .flops import ForwardFlopCounter
from .graph import PIN, Event, Label, LayerRecord, ModuleCall, UnionFind
from .handlers import handler_for, load_families
from .modes import eval_mode
from .rules import _tensors, apply_rule

__all__ = ["discover", "SearchSpace", "WidthDim", "DepthDim", "Block", "Tracer", "UnsupportedLayerError",
           "output_template"]


# functions that read a tensor's metadata, not its values
_SHAPE_READS = {"__get__", "size", "dim", "ndimension", "numel", "stride", "is_contiguous",
                "data_ptr", "element_size", "nelement", "__len__", "is_floating_point",
                "is_complex", "get_device", "storage_offset", "__repr__", "__format__"}

# ops whose output is the parameter's values again, dims right-aligned (expand adds dims)
_PARAM_VIEWS = {"expand", "expand_as", "to", "type_as", "float", "half", "bfloat16",
                "contiguous", "clone", "detach", "broadcast_to"}
# ops that only add or drop size-1 dims of a parameter (gamma.view(1, -1, 1, 1))
_PARAM_RESHAPES = {"view", "reshape", "unsqueeze", "squeeze", "flatten", "view_as", "reshape_as"}


@dataclass
class WidthDim:
    """One searchable width: ``size`` channel slots, owned by the layers in ``producers``."""

    name: str
    size: int
    producers: list[str]
    kind: str = "width"  # "width" or "heads" (heads use the depth temperature, A.1.1)
    # slot groups (local indices) of which at least one must stay: one per layer that
    # writes only part of this width (a branch of a concat added to a residual stream)
    required: list[list[int]] = field(default_factory=list)


@dataclass
class Block:
    """A residual block ``y = post(x + f(x))``; a transformer block chains two branches,
    ``x1 = x + attn(x); y = x1 + mlp(x1)``, and both share the block's depth mask."""

    name: str
    branch_modules: list[str]  # modules whose outputs are the residual branches f_j(x)
    post_module: str | None = None  # activation module applied after the add, if any
    post_function: str | None = None  # or activation function name
    output: Any = None  # None: returns the tensor; else its output_template (a tuple, ...)
    n_inputs: int = 1  # arguments the block is called with (x alone, or x and masks, ...)
    # its input or output tensor is modified in place after the call starts (``out += ...``):
    # a replacement that returns its input itself would then alias the two
    mutated: bool = True


@dataclass
class DepthDim:
    """The removable residual blocks of one stage (children of one parent module)."""

    name: str
    blocks: list[Block]
    min_keep: int


@dataclass
class LayerSlots:
    """Per channel of a handled layer: its global slot (index into the concatenated mask of
    all width dims) or ``-1`` when the channel is fixed."""

    name: str
    handler: str
    in_slots: np.ndarray | None
    out_slots: np.ndarray | None
    macs: int = 0
    macs_sides: tuple[str, ...] = ()
    virtual: bool = False
    masked_norm: bool = False
    mask_output: bool = False


@dataclass
class SearchSpace:
    """Everything discovery found: dims, layers and where their channels live."""

    width: list[WidthDim]
    depth: list[DepthDim]
    layers: dict[str, LayerSlots]
    pinned_reasons: dict[str, str]
    total_macs: int
    module_macs: dict[str, int]
    params: dict[str, tuple[int, np.ndarray]] = field(default_factory=dict)  # raw parameters
    # derived slots after the base ones: mask = mask[a] * mask[b] (-1: 1), e.g. (head, head dim)
    derived: list[tuple[int, int]] = field(default_factory=list)
    # the model's output on the example inputs during the trace (eval mode, no grad)
    example_output: Any = field(default=None, repr=False, compare=False)
    n_slots: int = field(init=False)  # base + derived; the fixed-channel entry has this index

    def __post_init__(self) -> None:
        self.n_slots = sum(d.size for d in self.width) + len(self.derived)

    def block_of(self, name: str) -> tuple[int, int] | None:
        """(depth dim, block) whose block module contains module/param ``name``."""
        for j, dd in enumerate(self.depth):
            for i, b in enumerate(dd.blocks):
                if name == b.name or name.startswith(b.name + "."):
                    return j, i
        return None


class _Mode(TorchFunctionMode):
    def __init__(self, tracer: "Tracer") -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tr = self.tracer
        if not tr.busy:
            tr.busy = True
            try:
                name = getattr(func, "__name__", str(func))
                if tr.opaque_depth == 0:
                    tr.on_function(name, args, kwargs, out)
                else:
                    tr.on_opaque_function(name, args, kwargs)
            finally:
                tr.busy = False
        return out


class Tracer:
    """Records channel labels and residual patterns while a model runs once."""

    def __init__(self, model: nn.Module, exclude: Iterable[str] = ()) -> None:
        self.model = model
        self.uf = UnionFind()
        self.exclude = tuple(exclude)
        self._info: dict[int, tuple[torch.Tensor, int, Label | None]] = {}
        self._next_node = 0
        self.producer: dict[int, Event] = {}
        self.consumers: dict[int, int] = {}
        self.calls: list[ModuleCall] = []
        self.layers: dict[str, LayerRecord] = {}
        self.produced: list[tuple[str, np.ndarray]] = []
        self.produced_kind: dict[str, str] = {}
        self.products: dict[int, tuple[int, int]] = {}  # product id -> (id a, id b)
        self.param_labels: dict[str, tuple[int, np.ndarray]] = {}
        # id(tensor) -> (tensor, param name, {tensor dim: param dim}) for views of parameters
        self.param_derived: dict[int, tuple[torch.Tensor, str, dict[int, int]]] = {}
        self.param_seen: set[str] = set()  # parameters some traced function read
        # parameter -> functions that read it without slicing it along channels
        self.param_other_uses: dict[str, set[str]] = {}
        self._labelled_now: set[str] = set()  # parameters labelled by the current function
        # module call (order) -> labels whose size its own code read (x.shape, x.size())
        self.size_reads: dict[int, list[np.ndarray]] = {}
        self.params = {id(p): n for n, p in model.named_parameters()}
        self.pin_reasons: dict[int, str] = {}
        self.opaque_depth = 0
        self.opaque_name: str | None = None  # the outermost opaque (handled) module running
        self._opaque_params: dict[int, torch.Tensor] = {}  # its parameters, by id
        # handled module -> the torch functions that received one of its parameters
        self.opaque_param_uses: dict[str, set[str]] = {}
        self.busy = False
        self.names = {m: n for n, m in model.named_modules()}
        # (clock, storage address) of every tensor an in-place function modified
        self.mutations: list[tuple[int, int | None]] = []

    # ------------------------------------------------------------------ labels and nodes
    def label_of(self, t: Any) -> Label | None:
        if not isinstance(t, torch.Tensor):
            return None
        entry = self._info.get(id(t))
        return entry[2] if entry is not None and entry[0] is t else None

    def node_of(self, t: torch.Tensor) -> int:
        entry = self._info.get(id(t))
        if entry is not None and entry[0] is t:
            return entry[1]
        node = self._new_node()
        self._info[id(t)] = (t, node, None)
        return node

    def _new_node(self) -> int:
        self._next_node += 1
        return self._next_node

    def set_label(self, t: torch.Tensor, dim: int, ids: np.ndarray) -> None:
        if dim < 0 or dim >= t.dim() or t.shape[dim] != len(ids):
            self.pin_ids(ids, "internal: label does not match the tensor shape")
            return
        t_node = self._info[id(t)][1] if id(t) in self._info and self._info[id(t)][0] is t else self._new_node()
        self._info[id(t)] = (t, t_node, Label(dim, ids))

    def pin_ids(self, ids: np.ndarray, reason: str) -> None:
        for x in ids.tolist():
            r = self.uf.find(x)
            if r != PIN:
                self.pin_reasons.setdefault(r, reason)
                self.uf.union(r, PIN)

    def pin_label(self, lab: Label | None, reason: str) -> None:
        if lab is not None:
            self.pin_ids(lab.ids, reason)

    def take_channel_label(self, lab: Label | None, dim: int, what: str) -> np.ndarray | None:
        """The ids of ``lab`` if it sits on ``dim``; otherwise pin it and return None."""
        if lab is None:
            return None
        if lab.dim == dim:
            return lab.ids
        self.pin_ids(lab.ids, f"{what}: channels on dim {lab.dim}, layer reads dim {dim}")
        return None

    def produce(self, name: str, n: int, kind: str = "width") -> np.ndarray:
        ids = self.uf.new(n)
        self.produced.append((name, ids))
        self.produced_kind[name] = kind
        return ids

    def product(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Ids for the grid a x b (a-major) whose mask is mask(a_i) * mask(b_j)."""
        ids = self.uf.new(len(a) * len(b))
        for k, (x, y) in enumerate((x, y) for x in a.tolist() for y in b.tolist()):
            self.products[int(ids[k])] = (x, y)
        return ids

    def record_layer(self, name: str, handler: str, in_ids: np.ndarray | None, out_ids: np.ndarray | None,
                     macs_sides: tuple[str, ...] | None = None, virtual: bool = False,
                     masked_norm: bool = False, macs_override: int | None = None,
                     mask_output: bool = False) -> None:
        prev = self.layers.get(name)
        if prev is None:
            self.layers[name] = LayerRecord(name, handler, in_ids, out_ids, 1, macs_sides, virtual,
                                            masked_norm, macs_override, mask_output)
            return
        for ids in (prev.in_ids, prev.out_ids, in_ids, out_ids):  # shared weights: fixed
            if ids is not None:
                self.pin_ids(ids, f"layer {name} is called more than once")
        prev.calls += 1

    # ------------------------------------------------------------------ events
    def on_function(self, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        outs = _tensors(out)
        ins = _tensors(args) + _tensors(kwargs)
        self._labelled_now.clear()
        if _is_inplace(name) and args and isinstance(args[0], torch.Tensor):
            self.mutations.append((self._next_node, _storage(args[0])))
        try:
            if name == "__setitem__":
                for t in ins:
                    self.pin_label(self.label_of(t), "in-place item assignment")
                return
            if not outs:
                if name in ("__get__", "size") and ins:
                    self._note_size_read(ins[0])
                return
            in_nodes = [self.node_of(t) for t in ins]
            if any(self.label_of(t) is not None for t in ins):
                apply_rule(self, name, args, kwargs, out)
            if len(outs) == 1 and ins and self.label_of(outs[0]) is None:
                self._derive_param_view(name, ins[0], outs[0])
            self._finish_event(name, ins, in_nodes, outs, None)
        finally:
            self._note_param_uses(name, ins, outs)

    def _active_call(self) -> ModuleCall | None:
        """The innermost module call running now (outside handled layers)."""
        return next((c for c in reversed(self.calls) if not c.done), None)

    def _note_size_read(self, t: torch.Tensor) -> None:
        lab = self.label_of(t)
        call = self._active_call()
        if lab is not None and call is not None:
            self.size_reads.setdefault(call.order, []).append(lab.ids)

    def pin_size_reads(self, reason: str) -> None:
        """Pin the channels whose count the running module's code read. Called when that code
        splits other channels with sizes of its own: ``B, N, C = x.shape`` then
        ``qkv.reshape(B, N, 3, H, C // H)`` (timm CaiT) ties the qkv layout to x's width,
        which the labels cannot express."""
        call = self._active_call()
        for ids in self.size_reads.get(call.order, []) if call is not None else []:
            self.pin_ids(ids, f"{reason} (module {call.name} reads their count)")

    def _derive_param_view(self, name: str, src: torch.Tensor, out: torch.Tensor) -> None:
        """If ``out`` is a view of a parameter (``gamma.view(1, -1, 1, 1)``, an expand, a
        dtype cast), remember which of its dims are which of the parameter's."""
        source = self.param_source(src)
        if source is None:
            return
        pname, mapping = source
        if name in _PARAM_VIEWS:  # right-aligned; expanded dims were size 1 (unmapped)
            shift = out.dim() - src.dim()
            self.param_derived[id(out)] = (out, pname, {d + shift: k for d, k in mapping.items()})
        elif name in _PARAM_RESHAPES:  # only size-1 dims come or go: the others keep order
            big_in = [d for d in range(src.dim()) if src.shape[d] > 1]
            big_out = [d for d in range(out.dim()) if out.shape[d] > 1]
            if [src.shape[d] for d in big_in] == [out.shape[d] for d in big_out]:
                moved = {a: b for a, b in zip(big_in, big_out)}
                self.param_derived[id(out)] = (out, pname, {moved[d]: k for d, k in mapping.items() if d in moved})

    def _note_param_uses(self, name: str, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        """Record which parameters ``name`` read, and whether it sliced them along channels."""
        if name in _SHAPE_READS and not outs:
            return
        for t in ins:
            source = self.param_source(t)
            if source is None:
                continue
            pname = source[0]
            self.param_seen.add(pname)
            view = len(outs) == 1 and self.param_derived.get(id(outs[0]), (None,))[0] is outs[0]
            if pname not in self._labelled_now and not view:
                self.param_other_uses.setdefault(pname, set()).add(name)

    def pin_shared_params(self) -> None:
        """A parameter sliced along channels must be read only where it is sliced: a
        parameter also read by another function (``F.linear(x, w)``, ``w.sum()``) or sliced
        by its layer's handler too keeps its channels (and those it meets) fixed."""
        for pname, (_, ids) in self.param_labels.items():
            others = self.param_other_uses.get(pname)
            owner = pname.rpartition(".")[0]
            if others:
                self.pin_ids(ids, f"parameter {pname} is also read by {', '.join(sorted(others))}")
            elif owner in self.layers:
                self.pin_ids(ids, f"parameter {pname} belongs to the handled layer {owner}")

    def on_opaque_function(self, name: str, args: tuple, kwargs: dict) -> None:
        """A function inside a handled module: note it if it reads one of the module's
        parameters (a handler can then tell ``conv2d(x, self.weight)`` from a layer that
        transforms its weights first, e.g. weight standardisation)."""
        if name in _SHAPE_READS or self.opaque_name is None:
            return
        for t in _tensors(args) + _tensors(kwargs):
            if self._opaque_params.get(id(t)) is t:
                self.opaque_param_uses[self.opaque_name].add(name)
                return

    def virtual_macs(self, name: str, module_macs: dict[str, int]) -> int:
        """MACs of a virtual record ``<module>.core``: the module's minus its handled children's."""
        owner = name.rpartition(".")[0]
        inner = sum(module_macs.get(n, 0) for n, r in self.layers.items()
                    if not r.virtual and n.startswith(owner + ".") and r.macs_override is None)
        return module_macs.get(owner, 0) - inner

    def param_source(self, t: Any) -> tuple[str, dict[int, int]] | None:
        """(parameter name, {dim of ``t``: dim of the parameter}) if ``t`` is a model
        parameter or a view of one; only dims of size > 1 are mapped."""
        if not isinstance(t, torch.Tensor):
            return None
        if id(t) in self.params and isinstance(t, nn.Parameter):
            return self.params[id(t)], {d: d for d in range(t.dim()) if t.shape[d] > 1}
        entry = self.param_derived.get(id(t))
        if entry is None or entry[0] is not t:
            return None
        return entry[1], entry[2]

    def label_param(self, t: torch.Tensor, dim: int, ids: np.ndarray) -> bool:
        """Record that the parameter ``t`` is (or views) carries ``ids`` along ``t``'s ``dim``."""
        src = self.param_source(t)
        if src is None:
            return False
        pname, mapping = src
        k = mapping.get(dim)
        if k is None:
            return False
        self._labelled_now.add(pname)
        if pname in self.param_labels:
            prev_dim, prev = self.param_labels[pname]
            if prev_dim != k or len(prev) != len(ids):
                self.pin_ids(ids, f"parameter {pname} used with two channel layouts")
                return True
            self.uf.union_arrays(prev, ids)
        else:
            self.param_labels[pname] = (k, ids)
        return True

    def _finish_event(self, name: str, ins: list[torch.Tensor], in_nodes: list[int], outs: list[torch.Tensor], module: str | None) -> None:
        for n in in_nodes:
            self.consumers[n] = self.consumers.get(n, 0) + 1
        out_nodes = []
        for t in outs:
            lab = self.label_of(t)
            node = self._new_node()
            self._info[id(t)] = (t, node, lab)
            out_nodes.append(node)
        ev = Event(name, in_nodes, out_nodes, module)
        for n in out_nodes:
            self.producer[n] = ev

    # ------------------------------------------------------------------ module hooks
    def _is_opaque(self, name: str, module: nn.Module) -> bool:
        return self._excluded(name) or handler_for(module) is not None

    def _excluded(self, name: str) -> bool:
        return any(name == e or name.startswith(e + ".") for e in self.exclude)

    def _pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.busy:
            return
        name = self.names.get(module, "?")
        if self.opaque_depth > 0:
            if self._is_opaque(name, module):
                self.opaque_depth += 1
            return
        ins = _tensors(args) + _tensors(kwargs)
        call = ModuleCall(name, len(self.calls), self.node_of(ins[0]) if ins else None,
                          start=self._next_node, n_inputs=len(args) + len(kwargs),
                          storages=(_storage(ins[0]),) if ins else ())
        self.calls.append(call)
        if self._is_opaque(name, module):
            self.opaque_depth += 1
            self.opaque_name = name
            self._opaque_params = {id(p): p for p in module.parameters()}
            self.opaque_param_uses.setdefault(name, set())

    def _post_hook(self, module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        if self.busy:
            return
        name = self.names.get(module, "?")
        if self._is_opaque(name, module):
            self.opaque_depth -= 1
            if self.opaque_depth > 0:
                return
            self.busy = True
            try:
                self._opaque_call(name, module, args, kwargs, out)
            finally:
                self.busy = False
        elif self.opaque_depth > 0:
            return
        call = next(c for c in reversed(self.calls) if c.name == name and not c.done)
        call.done = True
        call.output_nodes = [self.node_of(t) for t in _tensors(out)]
        call.output_template = output_template(out)
        outs = _tensors(out)
        call.storages = call.storages + ((_storage(outs[0]),) if len(outs) == 1 else ())
        call.end = self._next_node

    def _opaque_call(self, name: str, module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        ins = _tensors(args) + _tensors(kwargs)
        outs = [t for t in _tensors(out) if not any(t is i for i in ins)]
        in_nodes = [self.node_of(t) for t in ins]
        for t in outs:
            self._info.pop(id(t), None)
        handler = None if self._excluded(name) else handler_for(module)
        if handler is None:
            for t in ins:
                self.pin_label(self.label_of(t), f"excluded module {name}")
        else:
            call_args = args if args else tuple(v for v in kwargs.values() if isinstance(v, torch.Tensor))[:1]
            handler.trace(self, name, module, call_args, out)
        self._finish_event(name, ins, in_nodes, outs, name)

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        handles = []
        for m in self.model.modules():
            handles.append(m.register_forward_pre_hook(self._pre_hook, with_kwargs=True))
            handles.append(m.register_forward_hook(self._post_hook, with_kwargs=True))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def run(self, example_inputs: Any) -> tuple[Any, ForwardFlopCounter]:
        args, kwargs = split_inputs(example_inputs)
        counter = ForwardFlopCounter(self.model)
        with counter, self.hooks(), _Mode(self):
            out = self.model(*args, **kwargs)
        self.busy = True
        self.pin_shared_params()
        for t in _tensors(_outputs(out)):
            self.pin_label(self.label_of(t), "model output")
        self.busy = False
        return out, counter


_CONSTANTS = (type(None), bool, int, float, str)


def _is_inplace(name: str) -> bool:
    """Whether the torch function ``name`` modifies its first argument (``add_``, ``+=``)."""
    if name.startswith("__"):
        return name.startswith("__i") and name not in ("__index__", "__init__", "__invert__") \
            or name == "__setitem__"
    return name.endswith("_")


def _storage(t: torch.Tensor) -> int | None:
    """Address of ``t``'s memory (views share it); None when it has none to read."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _mutated_after(tr: "Tracer", call: ModuleCall) -> bool:
    """Whether the call's input memory was modified in place after the call began, or its
    output memory after it returned (a caller's ``out += ...``)."""
    if len(call.storages) != 2 or None in call.storages:
        return True
    x, y = call.storages
    return any(ptr is None or (ptr == x and clock >= call.start) or (ptr == y and clock >= call.end)
               for clock, ptr in tr.mutations)


def output_template(out: Any) -> Any:
    """How a module packs its one output tensor, in JSON: None for a bare tensor; for a
    tuple or list ``{"type": "tuple", "items": [...]}`` with ``{"tensor": True}`` where the
    tensor goes and the other items as the constants (None, numbers, strings) they were;
    ``"opaque"`` for anything else (a dict, a cache object, a nested container), which a
    replacement could not rebuild without running the module.

    Example:
        >>> import torch
        >>> output_template((torch.ones(1), None))
        {'type': 'tuple', 'items': [{'tensor': True}, None]}
    """
    if isinstance(out, torch.Tensor):
        return None
    if type(out) in (tuple, list):
        items: list[Any] = []
        for item in out:
            if isinstance(item, torch.Tensor):
                items.append({"tensor": True})
            elif isinstance(item, _CONSTANTS):
                items.append(item)
            else:
                return "opaque"
        if sum(1 for i in items if isinstance(i, dict)) == 1:
            return {"type": type(out).__name__, "items": items}
    return "opaque"


def split_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    """Tensor -> ((t,), {}); tuple/list -> (tuple, {}); dict -> ((), dict)."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    raise TypeError(
        "example_inputs must be a tensor, a tuple of positional inputs or a dict of keyword "
        f"inputs, got {type(example_inputs).__name__}"
    )


def _outputs(out: Any) -> Any:
    if isinstance(out, dict):
        return list(out.values())
    if hasattr(out, "to_tuple"):
        return out.to_tuple()
    return out


# ---------------------------------------------------------------------- unsupported layers


def check_traced_through(tr: Tracer) -> None:
    """Raise for a layer without a handler whose own parameters no traced function read.

    Layers without a handler are traced through: their functions go through the rule table,
    parameters that meet channels element-wise are sliced with them and anything else fixes
    the channels it touches. That is safe only if the trace saw the parameters being used;
    a forward that runs outside PyTorch's function dispatch (TorchScript, a kernel that reads
    the weights itself) hides how they meet the channels.
    """
    called = {c.name for c in tr.calls}
    for name, m in tr.model.named_modules():
        if name not in called or tr._excluded(name) or handler_for(m) is not None:
            continue
        own = [(n, p) for n, p in m.named_parameters(recurse=False)]
        if not own or any(tr.params.get(id(p)) in tr.param_seen for _, p in own):
            continue
        raise UnsupportedLayerError(
            f"layer {name!r} ({type(m).__name__}) has weights {[n for n, _ in own]} that no "
            "traced PyTorch function read (its forward runs outside torch's function "
            "dispatch, e.g. TorchScript or a custom kernel), so dmscale cannot tell how they "
            f"meet the channels. Exclude it (SearchConfig(exclude=[{name!r}]) or --exclude "
            f"{name}) to keep its widths fixed, or register a handler with "
            "dmscale.register_handler."
        )


# ---------------------------------------------------------------------- depth


def find_blocks(tr: Tracer) -> list[tuple[str, Block]]:
    """Residual blocks: module calls whose output is post(add(input, branch))."""
    seen_io: set[tuple[int, int]] = set()
    call_count: dict[str, int] = {}
    for c in tr.calls:
        call_count[c.name] = call_count.get(c.name, 0) + 1
    found: list[tuple[str, Block]] = []
    modules = dict(tr.model.named_modules())
    for call in tr.calls:
        if call.name in ("", "?") or call_count[call.name] != 1 or len(call.output_nodes) != 1:
            continue
        if call.output_template == "opaque":  # a removed block could not return the same
            continue
        if call.input_node is None or tr._is_opaque(call.name, modules[call.name]):
            continue
        y = call.output_nodes[0]
        if (call.input_node, y) in seen_io:
            continue
        block = _match_block(tr, call, y, call_count)
        if block is not None:
            block.output = call.output_template
            block.n_inputs = call.n_inputs
            block.mutated = _mutated_after(tr, call)
        if block is not None:
            seen_io.add((call.input_node, y))
            parent = call.name.rpartition(".")[0]
            found.append((parent, block))
    # a stage of blocks is itself a chain of residual adds: keep the innermost blocks only
    names = [b.name for _, b in found]
    return [(p, b) for p, b in found if not any(n.startswith(b.name + ".") for n in names)]


_ACTIVATIONS = {"relu", "relu_", "relu6", "silu", "silu_", "gelu", "hardswish", "hardswish_"}
_ADDS = {"add", "add_", "__add__", "__radd__", "__iadd__"}


def _match_block(tr: Tracer, call: ModuleCall, y: int, call_count: dict[str, int]) -> Block | None:
    inside = lambda c: c.name.startswith(call.name + ".")  # noqa: E731
    post_module = post_function = None
    ev = tr.producer.get(y)
    if ev is None:
        return None
    if ev.name not in _ADDS:
        if ev.name not in _ACTIVATIONS or len(ev.inputs) != 1:
            return None
        act_input = ev.inputs[0]
        post = [c for c in tr.calls if inside(c) and c.output_nodes == [y] and c.done]
        modules = dict(tr.model.named_modules())
        post_call = next((c for c in reversed(post) if c.input_node == act_input), None)
        if post_call is not None and not any(True for _ in modules[post_call.name].parameters()):
            post_module = post_call.name
        else:
            post_function = ev.name.rstrip("_")
        ev = tr.producer.get(act_input)
        if ev is None or ev.name not in _ADDS or tr.consumers.get(act_input, 0) != 1:
            return None
    branches: list[str] = []
    for _ in range(4):  # walk back a chain of residual adds to the block's input
        if ev is None or ev.name not in _ADDS or len(ev.inputs) != 2:
            return None
        a, b = ev.inputs
        if call.input_node in (a, b):
            z = b if a == call.input_node else a
            rest = None
        else:
            rest_ev = [n for n in (a, b) if tr.producer.get(n) is not None and tr.producer[n].name in _ADDS]
            if len(rest_ev) != 1:
                return None
            rest = rest_ev[0]
            z = b if a == rest else a
        if z == call.input_node or tr.consumers.get(z, 0) != 1:
            return None
        owner = [c for c in tr.calls if inside(c) and c.output_nodes[:1] == [z] and c.done
                 and call_count[c.name] == 1]
        if not owner:
            return None
        branches.append(owner[-1].name)
        if rest is None:
            return Block(call.name, branches[::-1], post_module, post_function)
        ev = tr.producer.get(rest)
    return None


# ---------------------------------------------------------------------- search space


def discover(model: nn.Module, example_inputs: Any, exclude: Iterable[str] = (),
             depth: bool | Iterable[str] = True) -> SearchSpace:
    """Trace ``model`` once (eval mode, no grad) and build its :class:`SearchSpace`.

    Args:
        exclude: module names (or prefixes) whose widths stay fixed and that are not traced.
        depth: True to find residual stages automatically, False for none, or an explicit
            list of stage (parent module) names to search.
    """
    load_families()
    exclude = tuple(exclude)
    tr = Tracer(model, exclude)
    with eval_mode(model), torch.no_grad():
        out, counter = tr.run(example_inputs)
    check_traced_through(tr)
    module_macs = _module_macs(model, counter)
    blocks = find_blocks(tr) if depth else []
    if depth is not True and depth:
        wanted = set(depth)
        blocks = [(p, b) for p, b in blocks if p in wanted]
        missing = wanted - {p for p, _ in blocks}
        if missing:
            raise ValueError(f"depth stages {sorted(missing)} have no residual block with an identity shortcut")
    blocks = [(p, b) for p, b in blocks if not tr._excluded(b.name)]
    space = _build(tr, blocks, module_macs, counter.get_total_flops() // 2)
    space.example_output = out
    return space


def _module_macs(model: nn.Module, counter: ForwardFlopCounter) -> dict[str, int]:
    root = type(model).__name__
    out: dict[str, int] = {}
    for key, ops in counter.get_flop_counts().items():
        if key == root:
            out[""] = sum(ops.values()) // 2
        elif key.startswith(root + "."):
            out[key[len(root) + 1:]] = sum(ops.values()) // 2
    return out


def _build(tr: Tracer, blocks: list[tuple[str, Block]], module_macs: dict[str, int], total_macs: int) -> SearchSpace:
    uf = tr.uf
    rec_macs = {n: tr.virtual_macs(n, module_macs) for n, r in tr.layers.items() if r.virtual}
    rec_macs.update({n: r.macs_override for n, r in tr.layers.items() if r.macs_override is not None})
    # second-level union: all channels produced by one layer belong to one dimension
    dim_uf = UnionFind()
    root_token: dict[int, int] = {}

    def token(root: int) -> int:
        if root == PIN:
            return PIN
        if root not in root_token:
            root_token[root] = int(dim_uf.new(1)[0])
        return root_token[root]

    for _, ids in tr.produced:
        toks = [token(uf.find(x)) for x in ids.tolist()]
        for t in toks[1:]:
            dim_uf.union(toks[0], t)
    # slots: each element root gets (dim, slot) in order of first production
    dims: dict[int, WidthDim] = {}
    slot_of_root: dict[int, tuple[int, int]] = {}
    reasons: dict[str, str] = {}
    order: list[int] = []
    for name, ids in tr.produced:
        for x in ids.tolist():
            r = uf.find(x)
            if r == PIN or r in slot_of_root:
                continue
            droot = dim_uf.find(token(r))
            if droot == PIN:
                continue
            if droot not in dims:
                dims[droot] = WidthDim(name, 0, [], tr.produced_kind.get(name, "width"))
                order.append(droot)
            d = dims[droot]
            if name not in d.producers:
                d.producers.append(name)
            slot_of_root[r] = (droot, d.size)
            d.size += 1
    for name, ids in tr.produced:  # every producer, and the part of a width it writes
        local = sorted({slot_of_root[uf.find(x)][1] for x in ids.tolist() if uf.find(x) in slot_of_root})
        if not local:
            continue
        droot = slot_of_root[uf.find(int(ids[0]))][0] if uf.find(int(ids[0])) in slot_of_root else None
        if droot is None:
            continue
        d = dims[droot]
        if name not in d.producers:
            d.producers.append(name)
        if len(local) < d.size and local not in d.required:
            d.required.append(local)
    for name, ids in tr.produced:  # report why a producer's channels are fixed
        r = uf.find(int(ids[0]))
        if r == PIN or dim_uf.find(token(r)) == PIN:
            reasons[name] = _pin_reason(tr, ids)
    width = [dims[r] for r in order]
    offset = {r: o for r, o in zip(order, np.cumsum([0] + [d.size for d in width[:-1]]).tolist())}

    def base_slot(x: int) -> int:
        r = uf.find(x)
        if r not in slot_of_root:
            return -1
        droot, s = slot_of_root[r]
        return offset[droot] + s

    n_base = sum(d.size for d in width)
    derived: list[tuple[int, int]] = []
    derived_of_root: dict[int, int] = {}
    for pid, (a, b) in tr.products.items():
        r = uf.find(pid)
        if r == PIN or r in derived_of_root:
            continue
        sa, sb = base_slot(a), base_slot(b)
        if sa < 0 and sb < 0:
            continue
        derived_of_root[r] = n_base + len(derived)
        derived.append((sa, sb))

    def slots(ids: np.ndarray | None) -> np.ndarray | None:
        if ids is None:
            return None
        out = np.full(len(ids), -1, dtype=np.int64)
        for i, x in enumerate(ids.tolist()):
            r = uf.find(x)
            out[i] = derived_of_root[r] if r in derived_of_root else base_slot(x)
        return out

    modules = dict(tr.model.named_modules())

    def sides(rec: LayerRecord) -> tuple[str, ...]:
        if rec.macs_sides is not None:
            return rec.macs_sides
        m = modules[rec.name]
        return handler_for(m).macs_dims(m)

    layers = {
        name: LayerSlots(name, rec.handler, slots(rec.in_ids), slots(rec.out_ids),
                         rec_macs.get(name, module_macs.get(name, 0)), sides(rec), rec.virtual, rec.masked_norm,
                         rec.mask_output)
        for name, rec in tr.layers.items()
    }
    params = {name: (k, slots(ids)) for name, (k, ids) in tr.param_labels.items()}
    params = {name: (k, sl) for name, (k, sl) in params.items() if (sl >= 0).any()}  # fixed: never sliced
    depth = _stages(tr.model, blocks)
    return SearchSpace(width, depth, layers, reasons, total_macs, module_macs, params, derived)


def _stages(model: nn.Module, blocks: list[tuple[str, Block]]) -> list[DepthDim]:
    """Group blocks into stages: maximal runs of consecutive sibling blocks.

    A sibling that is not a removable block (a strided or widening block) ends a run, so a
    stage's blocks share one residual stream. A stage keeps at least one block unless a
    non-removable sibling already keeps the stage alive.
    """
    modules = dict(model.named_modules())
    by_parent: dict[str, list[Block]] = {}
    for parent, b in blocks:
        by_parent.setdefault(parent, []).append(b)
    stages: list[DepthDim] = []
    for parent, bl in by_parent.items():
        container = modules[parent] if parent else model
        children = [parent + "." + n if parent else n for n, _ in container.named_children()]
        is_block = {b.name: b for b in bl}
        runs: list[list[Block]] = [[]]
        for child in children:
            if child in is_block:
                runs[-1].append(is_block[child])
            elif runs[-1]:
                runs.append([])
        runs = [r for r in runs if r]
        whole = len(runs) == 1 and len(runs[0]) == len(children)
        for r in runs:
            first, last = r[0].name.rpartition(".")[2], r[-1].name.rpartition(".")[2]
            name = (parent or "<root>") if len(runs) == 1 else f"{parent}[{first}:{last}]"
            stages.append(DepthDim(name, r, 1 if whole else 0))
    return stages


def _pin_reason(tr: Tracer, ids: np.ndarray) -> str:
    for x in ids.tolist():  # a reason is stored under the set's root at the time of pinning
        if x in tr.pin_reasons:
            return tr.pin_reasons[x]
    return "tied (residual add, concat, ...) to channels that are fixed"
