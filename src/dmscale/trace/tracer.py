"""The tracer behind :func:`dmscale.trace.discover.discover`: runs a model once and records how
torch functions carry channel labels.

:class:`Tracer` runs the model under a ``TorchFunctionMode`` (every torch function goes through
:func:`dmscale.trace.rules.apply_rule`) and forward hooks (handled layers are opaque operations that
produce and consume labels). It knows nothing of blocks or stages: :mod:`dmscale.trace.discover`
turns its records into a :class:`~dmscale.trace.discover.SearchSpace`. Parameter tracking is in
:mod:`dmscale.trace.params`, the helpers for call values (``split_inputs``, ``output_template``,
re-exported here) in :mod:`dmscale.trace.values`.

Example:
    >>> import torch
    >>> from torch import nn
    >>> tr = Tracer(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    >>> _ = tr.run((torch.randn(1, 4),))
    >>> sorted(tr.layers)
    ['0', '2']
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator

import numpy as np
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from dmscale.trace.flops import ForwardFlopCounter
from dmscale.trace.graph import PIN, Event, Label, LayerRecord, ModuleCall, UnionFind
from dmscale.trace.handlers.base import handler_for
from dmscale.trace.params import SHAPE_READS, ParamTracker
from dmscale.trace.rules import apply_rule
from dmscale.trace.values import is_inplace, model_outputs, output_template, split_inputs, storage_of, tensors_in

__all__ = ["Tracer", "split_inputs", "output_template"]


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


class Tracer(ParamTracker):
    """Records channel labels and residual patterns while a model runs once.

    The parameter bookkeeping (which tensors are parameters, which are sliced along channels)
    is :class:`~dmscale.trace.params.ParamTracker`'s.
    """

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
        self._init_param_tracking(model)
        # module call (order) -> labels whose size its own code read (x.shape, x.size())
        self.size_reads: dict[int, list[np.ndarray]] = {}
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
        outs = tensors_in(out)
        ins = tensors_in(args) + tensors_in(kwargs)
        self._labelled_now.clear()
        if is_inplace(name) and args and isinstance(args[0], torch.Tensor):
            self.mutations.append((self._next_node, storage_of(args[0])))
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

    def tie_size_reads(self, ids: np.ndarray) -> None:
        """Tie ``ids`` to every width of the same size the running module's code read: a
        reshape that writes such a size for other channels needs the two to stay equal."""
        call = self._active_call()
        for read in self.size_reads.get(call.order, []) if call is not None else []:
            if len(read) == len(ids) and not np.array_equal(read, ids):
                self.uf.union_arrays(read, ids)

    def on_opaque_function(self, name: str, args: tuple, kwargs: dict) -> None:
        """A function inside a handled module: note it if it reads one of the module's
        parameters (a handler can then tell ``conv2d(x, self.weight)`` from a layer that
        transforms its weights first, e.g. weight standardisation)."""
        if name in SHAPE_READS or self.opaque_name is None:
            return
        for t in tensors_in(args) + tensors_in(kwargs):
            if self._opaque_params.get(id(t)) is t:
                self.opaque_param_uses[self.opaque_name].add(name)
                return

    def virtual_macs(self, name: str, module_macs: dict[str, int]) -> int:
        """MACs of a virtual record ``<module>.core``: the module's minus its handled children's."""
        owner = name.rpartition(".")[0]
        inner = sum(module_macs.get(n, 0) for n, r in self.layers.items()
                    if not r.virtual and n.startswith(owner + ".") and r.macs_override is None)
        return module_macs.get(owner, 0) - inner

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
        ins = tensors_in(args) + tensors_in(kwargs)
        call = ModuleCall(name, len(self.calls), self.node_of(ins[0]) if ins else None,
                          start=self._next_node, n_inputs=len(args) + len(kwargs),
                          storages=(storage_of(ins[0]),) if ins else (),
                          shapes=(tuple(ins[0].shape),) if ins else ())
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
        call.output_nodes = [self.node_of(t) for t in tensors_in(out)]
        call.output_template = output_template(out)
        outs = tensors_in(out)
        call.storages = call.storages + ((storage_of(outs[0]),) if len(outs) == 1 else ())
        call.shapes = call.shapes + ((tuple(outs[0].shape),) if len(outs) == 1 else ())
        call.end = self._next_node

    def _opaque_call(self, name: str, module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        ins = tensors_in(args) + tensors_in(kwargs)
        outs = [t for t in tensors_in(out) if not any(t is i for i in ins)]
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
        try:  # registering may fail half-way (a ScriptModule): remove what was registered
            for m in self.model.modules():
                handles.append(m.register_forward_pre_hook(self._pre_hook, with_kwargs=True))
                handles.append(m.register_forward_hook(self._post_hook, with_kwargs=True))
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
        for t in tensors_in(model_outputs(out)):
            self.pin_label(self.label_of(t), "model output")
        self.busy = False
        return out, counter

