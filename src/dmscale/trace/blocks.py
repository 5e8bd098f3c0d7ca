"""Depth: the residual blocks of a traced model and the stages they form.

A block is a module call whose output is ``post(x + f(x))`` for its input ``x`` (a
transformer block chains two such adds); a stage is a run of sibling blocks, whose branches
the search may remove. :func:`find_blocks` reads the tracer's records of torch functions and
module calls; :func:`group_stages` groups the blocks it finds; :func:`split_branches` makes
each branch of a block that chains several its own unit (sublayer depth); :func:`pin_units`
takes the units that must stay out of the search.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from dmscale.trace.tracer import Tracer
    >>> class Res(nn.Module):
    ...     def __init__(self) -> None:
    ...         super().__init__()
    ...         self.f = nn.Linear(4, 4)
    ...     def forward(self, x: torch.Tensor) -> torch.Tensor:
    ...         return x + self.f(x)
    >>> net = nn.Sequential(nn.Linear(4, 4), Res(), Res())
    >>> tr = Tracer(net)
    >>> _ = tr.run(torch.randn(1, 4))
    >>> blocks = find_blocks(tr)
    >>> [(parent, b.name, b.branch_modules) for parent, b in blocks]
    [('', '1', ['1.f']), ('', '2', ['2.f'])]
    >>> [(d.name, [b.name for b in d.blocks], d.min_keep) for d in group_stages(net, blocks)]
    [('<root>', ['1', '2'], 0)]
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from dmscale.trace.graph import Event, ModuleCall
from dmscale.trace.handlers.base import handler_for
from dmscale.trace.space import Block, DepthDim

if TYPE_CHECKING:
    from dmscale.trace.tracer import Tracer

__all__ = ["find_blocks", "group_stages", "split_branches", "pin_units"]


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
    folds: dict[str, str] = {}
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
        layer = _last_layer(tr, z, call.name, call_count)
        if layer is not None:
            folds[owner[-1].name] = layer
        if rest is None:
            return Block(call.name, branches[::-1], post_module, post_function, fold_layers=folds)
        ev = tr.producer.get(rest)
    return None


# functions of one tensor that commute with a scalar factor: dropout(m x) = m dropout(x)
# (the same random mask, one multiply moved); never alpha_dropout (affine)
_SCALAR_COMMUTING = {"dropout", "dropout1d", "dropout2d", "dropout3d", "feature_dropout"}


def _last_layer(tr: Tracer, z: int, block: str, call_count: dict[str, int]) -> str | None:
    """The layer inside ``block`` whose output becomes the branch output ``z`` through
    nothing but dropout, each node on the way read once, the layer called once per forward;
    None if there is none. Its weight and bias times the depth mask give ``f(x) * m``."""
    node = z
    for _ in range(8):
        ev = tr.producer.get(node)
        if ev is None:
            return None
        if ev.module is not None:  # a handled layer's call
            ok = (ev.module.startswith(block + ".") and call_count.get(ev.module) == 1
                  and ev.outputs[:1] == [node])
            if not ok:
                return None
            module = tr.model.get_submodule(ev.module)
            handler = handler_for(module)
            child = handler.output_layer(module) if handler is not None and handler.output_layer else None
            if child is not None:  # an attention returning its output projection's output
                return f"{ev.module}.{child}"
            return ev.module if len(ev.outputs) == 1 else None
        if ev.name not in _SCALAR_COMMUTING or len(ev.inputs) != 1:
            return None
        node = ev.inputs[0]
        if tr.consumers.get(node, 0) != 1:
            return None
    return None


def group_stages(model: nn.Module, blocks: list[tuple[str, Block]]) -> list[DepthDim]:
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


def split_branches(tr: Tracer, stages: list[DepthDim]) -> list[DepthDim]:
    """Sublayer depth: each block of ``stages`` that chains two or more residual branches
    (a transformer block: attention, then FFN) becomes one unit per branch, in order.

    A branch's *members* are the outermost modules inside the block that compute it and
    nothing else (a Llama layer's ``input_layernorm`` and ``self_attn``; a timm block's
    ``norm1``, ``attn``, ``ls1`` and ``drop_path1``): the tensors from the branch's input
    on the residual stream to its output, none of them computed outside those modules or
    read by another branch. A removed branch's members each become zeros shaped like their
    input (the export's ``ZeroBranch``), so a block is split only when every member returns
    one tensor (bare, or in a tuple of constants) of its input's shape; other blocks stay
    whole units. A unit is a :class:`Block` named after its member with the most parameters,
    its mask where the block's was (``branch_modules``), ``members`` its members (name ->
    output template) and ``layer`` the whole block. A stage keeps its ``min_keep`` (now
    counted in units).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from dmscale.trace.tracer import Tracer
        >>> class Layer(nn.Module):  # x1 = x + attn(norm1(x)); y = x1 + mlp(norm2(x1))
        ...     def __init__(self) -> None:
        ...         super().__init__()
        ...         self.norm1, self.attn = nn.LayerNorm(4), nn.Linear(4, 4)
        ...         self.norm2, self.mlp = nn.LayerNorm(4), nn.Linear(4, 4)
        ...     def forward(self, x: torch.Tensor) -> torch.Tensor:
        ...         x = x + self.attn(self.norm1(x))
        ...         return x + self.mlp(self.norm2(x))
        >>> net = nn.Sequential(Layer(), Layer())
        >>> tr = Tracer(net)
        >>> _ = tr.run(torch.randn(1, 4))
        >>> units = split_branches(tr, group_stages(net, find_blocks(tr)))[0].blocks
        >>> [(b.name, list(b.members), b.layer.name) for b in units[:2]]
        [('0.attn', ['0.norm1', '0.attn'], '0'), ('0.mlp', ['0.norm2', '0.mlp'], '0')]
    """
    calls = {c.name: c for c in tr.calls}
    users: dict[int, list[Event]] = {}
    for ev in {id(e): e for e in tr.producer.values()}.values():
        for n in ev.inputs:
            users.setdefault(n, []).append(ev)
    modules = dict(tr.model.named_modules())
    out = []
    for d in stages:
        units: list[Block] = []
        for b in d.blocks:
            split = _branch_members(tr, calls, users, b) if len(b.branch_modules) > 1 else None
            if split is None:
                units.append(b)
                continue
            for m, members in zip(b.branch_modules, split):
                size = {n: sum(p.numel() for p in modules[n].parameters()) for n in members}
                name = max(members, key=lambda n: size[n])  # the first of the largest
                folds = {m: b.fold_layers[m]} if m in b.fold_layers else {}
                units.append(Block(name, [m], fold_layers=folds, layer=b, members=members))
        out.append(DepthDim(d.name, units, d.min_keep))
    return out


def _branch_members(tr: Tracer, calls: dict[str, ModuleCall], users: dict[int, list[Any]],
                    b: Block) -> list[dict[str, Any]] | None:
    """Per branch of ``b``, its members (module name -> output template), or None when a
    branch cannot be replaced by zeros (see :func:`split_branches`)."""
    block = calls[b.name]
    outs = []  # the branch outputs z_j, and the residual stream s_j each is added to
    for m in b.branch_modules:
        z = calls[m].output_nodes[0]
        adds = [e for e in users.get(z, []) if e.name in _ADDS and len(e.inputs) == 2]
        if len(adds) != 1:
            return None
        outs.append((z, adds[0].inputs[1] if adds[0].inputs[0] == z else adds[0].inputs[0]))
    stops = {s for _, s in outs} | {block.input_node}
    inside = [c for c in tr.calls if c.name.startswith(b.name + ".") and c.done]
    result, seen = [], set()
    for z, _ in outs:
        nodes = _branch_nodes(tr, z, stops, block.start)
        if nodes & seen:  # two branches share a tensor (a norm read by both): not separable
            return None
        seen |= nodes
        members = [c for c in inside if c.output_nodes and set(c.output_nodes) <= nodes
                   and (c.input_node in nodes or c.input_node in stops)]
        members = [c for c in members if not any(c.name.startswith(o.name + ".") for o in members)]
        covered = lambda n: any(c.start < n <= c.end or n in c.output_nodes for c in members)  # noqa: E731
        if not members or not all(covered(n) for n in nodes) or not all(map(_zero_replaceable, members)):
            return None
        result.append({c.name: c.output_template for c in members})
    return result


def _branch_nodes(tr: Tracer, z: int, stops: set[int | None], start: int) -> set[int]:
    """The nodes made inside the block (after ``start``) that ``z`` is computed from, back
    to the residual stream (``stops``)."""
    nodes: set[int] = set()
    todo = [z]
    while todo:
        n = todo.pop()
        if n in nodes or n in stops or n <= start or n not in tr.producer:
            continue
        nodes.add(n)
        todo.extend(tr.producer[n].inputs)
    return nodes


def _zero_replaceable(call: ModuleCall) -> bool:
    """Whether zeros like the call's first input rebuild what the module returned."""
    return (call.output_template != "opaque" and len(call.output_nodes) == 1
            and len(call.shapes) == 2 and call.shapes[0] == call.shapes[1])


def pin_units(stages: list[DepthDim], keep: list[str]) -> list[DepthDim]:
    """``stages`` without the depth units that hold, or lie inside, a module named in
    ``keep``: the search never removes them (their widths are still searched). A pinned
    branch of a split block records its name in the block's ``pinned`` (the block then
    always stays, and its other branches are removed as branches); a stage left without
    units is dropped.

    Why: an export format may need a unit the search could remove (llama.cpp reads the
    head size from the first layer's attention), and pinning it before the search keeps
    the result writable.

    Example (the first of two residual blocks pinned by a module inside it):
        >>> import torch
        >>> from torch import nn
        >>> from dmscale.trace.tracer import Tracer
        >>> class Res(nn.Module):  # y = x + f(x)
        ...     def __init__(self) -> None:
        ...         super().__init__(); self.f = nn.Linear(4, 4)
        ...     def forward(self, x: torch.Tensor) -> torch.Tensor: return x + self.f(x)
        >>> net = nn.Sequential(Res(), Res())
        >>> tr = Tracer(net)
        >>> _ = tr.run(torch.randn(1, 4))
        >>> (d,) = pin_units(group_stages(net, find_blocks(tr)), ["0.f"])
        >>> [b.name for b in d.blocks]
        ['1']
    """
    out = []
    for d in stages:
        units = []
        for b in d.blocks:
            if not any(b.contains(k) or b.name.startswith(k + ".") or b.name == k for k in keep):
                units.append(b)
            elif b.layer is not None:
                b.layer.pinned.append(b.name)
        if units:
            out.append(DepthDim(d.name, units, min(d.min_keep, len(units))))
    return out
