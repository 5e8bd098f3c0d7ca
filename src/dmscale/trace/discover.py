"""Find a model's structural dimensions by running it once on example inputs.

The :class:`~dmscale.trace.tracer.Tracer` runs the model under a ``TorchFunctionMode`` and forward hooks. Handled
layers (conv, linear, norms, ... see :mod:`dmscale.trace.handlers.base`) are opaque operations; every
other torch function is mapped by :mod:`dmscale.trace.rules`. Layers without a handler are traced
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

from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np
import torch
from torch import nn
from dmscale.core.errors import ConfigError, UnsupportedLayerError
from dmscale.trace.flops import ForwardFlopCounter
from dmscale.trace.graph import PIN, LayerRecord, ModuleCall, UnionFind
from dmscale.trace.handlers.base import handler_for, load_families
from dmscale.core.modes import eval_mode
from dmscale.trace.tracer import Tracer, output_template

__all__ = ["discover", "SearchSpace", "WidthDim", "DepthDim", "Block", "Tracer", "UnsupportedLayerError",
           "output_template"]


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


# ---------------------------------------------------------------------- unsupported layers


def refuse_script_modules(model: nn.Module) -> None:
    """Raise :class:`UnsupportedLayerError` naming the first TorchScript submodule: its
    forward runs outside Python, so neither hooks nor the trace can see it."""
    for name, m in model.named_modules():
        if isinstance(m, torch.jit.ScriptModule):
            where = f"layer {name!r}" if name else "the model"
            raise UnsupportedLayerError(
                f"{where} is a TorchScript module ({type(m).__name__}), which dmscale cannot trace "
                "(no hooks, no Python forward): pass the nn.Module from before torch.jit.script / "
                "torch.jit.trace, and script the exported model afterwards")


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


def _mutated_after(tr: Tracer, call: ModuleCall) -> bool:
    """Whether the call's input memory was modified in place after the call began, or its
    output memory after it returned (a caller's ``out += ...``)."""
    if len(call.storages) != 2 or None in call.storages:
        return True
    x, y = call.storages
    return any(ptr is None or (ptr == x and clock >= call.start) or (ptr == y and clock >= call.end)
               for clock, ptr in tr.mutations)


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
    refuse_script_modules(model)
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
            raise ConfigError(f"depth stages {sorted(missing)} have no residual block with an identity "
                              "shortcut: name stages whose children are residual blocks, or pass depth=True")
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
