"""Exact resource counts and the differentiable cost of a search (paper Eq. 6-8).

:func:`count` runs ``torch.utils.flop_counter.FlopCounterMode`` (its forward-only variant
:class:`dmscale.trace.flops.ForwardFlopCounter`) and returns exact MACs
(= FLOPs / 2) and parameters. Convention: MACs are those of convolutions, linear layers,
matrix products and attention (``scaled_dot_product_attention``, whose CPU kernel has no
formula in torch and gets one registered here); element-wise ops, norms, activations,
pooling and bias adds are not counted. Parameters are the model's unique parameters (tied
weights once); buffers are not counted. A model with attention layers also gets ``kv_cache``:
bytes of K and V cached per token per sequence (:mod:`dmscale.cost.kv_cache`).

:class:`CostModel` is the differentiable ``r_c`` of Eq. 6: a sum of terms
``base x keep_in x keep_out x m_depth`` where ``keep`` is the mean mask of the channels a
layer reads or writes. At hard (0/1) masks it equals the exact count of the exported model.
For ``kv_cache`` each attention layer is one term: its bytes x the kept share of its
key/value heads x the kept share of its per-head dim (when searched) x the depth mask of the
block that contains the attention module (a dropped layer caches nothing).

Example:
    >>> import torch
    >>> from torch import nn
    >>> count(nn.Linear(8, 4), torch.randn(2, 8))
    {'macs': 64, 'params': 36}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.flop_counter import register_flop_formula, sdpa_flop_count

from dmscale.trace.discover import SearchSpace
from dmscale.trace.values import split_inputs
from dmscale.trace.flops import ForwardFlopCounter
from dmscale.trace.handlers.base import handler_for
from dmscale.core.masks import GATES_NAME
from dmscale.core.modes import eval_mode
from dmscale.cost.kv_cache import kv_layers, require_kv_layers

__all__ = ["count", "CostModel", "DeviceCache", "Row", "TermRows"]


def _gqa_shapes(query_shape: Any, key_shape: Any, value_shape: Any) -> tuple[Any, Any]:
    """Key and value shapes with their heads repeated to the query's (grouped-query attention:
    each query head attends to its key/value group, the same work as with as many heads)."""
    if len(query_shape) == 4 and len(key_shape) == 4 and len(value_shape) == 4:
        hq, hkv = query_shape[1], key_shape[1]
        if hkv and hq != hkv and hq % hkv == 0:
            key_shape = (key_shape[0], hq, *key_shape[2:])
            value_shape = (value_shape[0], hq, *value_shape[2:])
    return key_shape, value_shape


def _gqa_safe(formula: Any) -> Any:
    """``formula`` of an attention op, counting grouped-query attention as its expanded
    form (torch before 2.13 asserts equal head counts in ``sdpa_flop_count``)."""
    if getattr(formula, "_dmscale_gqa", False):
        return formula

    def wrapped(query, key, value, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        # the registry's formulas take the op's tensors (or shapes) and read their shapes
        q, k, v = (tuple(t.shape) if isinstance(t, torch.Tensor) else t for t in (query, key, value))
        k, v = _gqa_shapes(q, k, v)
        return formula(q, k, v, *args, **kwargs)
    wrapped._dmscale_gqa = True  # type: ignore[attr-defined]
    return wrapped


_SDPA_OPS = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")


def _register_cpu_sdpa_formula() -> None:
    """A flop formula for the CPU attention kernel (torch has none before some version), and
    grouped-query attention counted by every forward attention formula."""
    from torch.utils.flop_counter import flop_registry

    cpu = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if cpu is not None and cpu not in flop_registry:
        def formula(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):  # noqa: ANN001
            return sdpa_flop_count(query_shape, key_shape, value_shape)
        try:
            register_flop_formula(cpu)(formula)
        except (RuntimeError, ValueError):  # already registered
            pass
    for name in _SDPA_OPS:
        op = getattr(torch.ops.aten, name, None)
        if op is not None and op in flop_registry:
            flop_registry[op] = _gqa_safe(flop_registry[op])


_register_cpu_sdpa_formula()


def count(model: nn.Module, example_inputs: Any) -> dict[str, int]:
    """Exact ``{"macs", "params"}`` of ``model`` on ``example_inputs`` (eval mode, no grad),
    and ``"kv_cache"`` (bytes per token per sequence, :mod:`dmscale.cost.kv_cache`) when it
    has attention layers."""
    args, kwargs = split_inputs(example_inputs)
    counter = ForwardFlopCounter(model)
    fastpath = torch.backends.mha.get_fastpath_enabled()
    # the fused encoder kernel has no flop formula: count the unfused (same) computation
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.no_grad(), eval_mode(model), counter:
            model(*args, **kwargs)
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
    params = sum(p.numel() for n, p in model.named_parameters() if not n.startswith(GATES_NAME + "."))
    out = {"macs": int(counter.get_total_flops()) // 2, "params": int(params)}
    kv = kv_layers(model)
    if kv:
        out["kv_cache"] = sum(layer.bytes for layer in kv)
    return out


class DeviceCache:
    """Constant tensors of a cost model, moved to a device once and then reused: the step loop
    evaluates the cost every step, and a host-to-device copy per index tensor per step would
    cost more than the arithmetic on a GPU. A tensor that is replaced (not changed in place)
    is moved again."""

    def on(self, device: torch.device, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """``[t.to(device) for t in tensors]``, each copy made once per (tensor, device)."""
        cache: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = \
            self.__dict__.setdefault("_device_cache", {})
        out = []
        for t in tensors:
            hit = cache.get((id(t), device))
            if hit is None or hit[0] is not t:
                with torch.inference_mode(False):  # kept across calls: a normal tensor, whatever the mode
                    hit = cache[(id(t), device)] = (t, t.to(device))
            out.append(hit[1])
        return out


# one term of a cost model: (base, in group, out group, depth factor); -1 for no factor
Row = tuple[float, int, int, int]
# a resource's terms: rows(cost_model, model, space) (CostModel.macs_rows, ...)
TermRows = Callable[["CostModel", nn.Module, SearchSpace], list[Row]]


@dataclass
class _Terms:
    base: torch.Tensor  # (T,) float64
    f_in: torch.Tensor  # (T,) group index, G = no factor
    f_out: torch.Tensor  # (T,)
    depth: torch.Tensor  # (T,) flat block index, B = no factor


class CostModel(DeviceCache):
    """Differentiable cost ``r_c`` of one resource from the gates' masks.

    Built once from a :class:`SearchSpace`; :meth:`__call__` takes the concatenated width
    mask (n_slots + 1, last entry 1 for fixed channels) and the flat depth mask (n_blocks)
    and returns a float64 scalar.

    ``rows(cost_model, model, space)`` gives the terms, each ``(base, in_group, out_group,
    depth)``: :meth:`group` of the slots a term's input and output keep (-1: no factor) and
    :meth:`block` of the module that holds it (-1: none), e.g. :meth:`macs_rows`,
    :meth:`params_rows`, :meth:`kv_rows`; ``resource`` names the resource (the registered
    resource's, :mod:`dmscale.cost.registry`, builds its cost model).
    """

    def __init__(self, model: nn.Module, space: SearchSpace, resource: str, rows: TermRows) -> None:
        self.resource = resource
        self.space = space
        self._groups: list[torch.Tensor] = []
        self._group_key: dict[bytes, int] = {}
        self._block_index = self._flat_blocks(space)
        self._alive_index = self._split_layers(space, self._block_index)
        rows = rows(self, model, space)
        kept = [r for r in rows if not (r[1] < 0 and r[2] < 0 and r[3] < 0)]
        self.constant = float(sum(r[0] for r in rows if r[1] < 0 and r[2] < 0 and r[3] < 0))
        # depth factors: one per unit (B), then one per split block (A, alive while a branch is)
        g, b = len(self._groups), len(self._block_index) + len(self._alive_units)
        self.terms = _Terms(
            torch.tensor([r[0] for r in kept], dtype=torch.float64),
            torch.tensor([r[1] if r[1] >= 0 else g for r in kept], dtype=torch.long),
            torch.tensor([r[2] if r[2] >= 0 else g for r in kept], dtype=torch.long),
            torch.tensor([r[3] if r[3] >= 0 else b for r in kept], dtype=torch.long),
        )
        # every term's three factors as one gather from [keep (G), 1, depth (B), 1]: (3, T)
        t = self.terms
        self._factor_index = torch.stack([t.f_in, t.f_out, t.depth + g + 1])
        self._one = torch.ones(1, dtype=torch.float64)
        lengths = [len(x) for x in self._groups]
        self._flat = torch.cat(self._groups) if self._groups else torch.zeros(0, dtype=torch.long)
        self._seg = torch.repeat_interleave(torch.arange(g), torch.tensor(lengths, dtype=torch.long)) if g else torch.zeros(0, dtype=torch.long)
        self._len = torch.tensor(lengths, dtype=torch.float64)

    # ------------------------------------------------------------------ building
    @staticmethod
    def _flat_blocks(space: SearchSpace) -> dict[tuple[int, int], int]:
        out, k = {}, 0
        for j, d in enumerate(space.depth):
            for i, _ in enumerate(d.blocks):
                out[(j, i)] = k
                k += 1
        return out

    def _split_layers(self, space: SearchSpace, flat: dict[tuple[int, int], int]) -> dict[str, int]:
        """Sublayer depth: each split block's index among the depth factors (after the B
        units) and, in ``_alive_units``, its units' flat indices padded with B (A, K)."""
        layers = space.split_layers()
        width = max((len(u) for u in layers.values()), default=0)
        pad = len(flat)  # the index of a zero appended to the depth mask: a factor 1 - 0
        self._alive_units = torch.tensor([[flat[u] for u in units] + [pad] * (width - len(units))
                                          for units in layers.values()], dtype=torch.long).view(len(layers), width)
        return {name: len(flat) + a for a, name in enumerate(layers)}

    def group(self, slots: Any) -> int:
        """Index of the keep-ratio group of a channel->slot vector (-1: no factor): a term's
        in or out factor is the mean mask of the channels of that group."""
        if slots is None or (slots < 0).all():
            return -1
        idx = torch.as_tensor(slots, dtype=torch.long).clone()
        idx[idx < 0] = self.space.n_slots
        key = idx.numpy().tobytes()
        if key not in self._group_key:
            self._group_key[key] = len(self._groups)
            self._groups.append(idx)
        return self._group_key[key]

    def block(self, name: str) -> int:
        """The depth factor of module ``name``: its block's (or its split layer's alive) index
        among the depth factors, -1 outside every removable block."""
        jb = self.space.block_of(name)
        if jb is None:  # a part of a split block outside its branches (a norm): alive factor
            layer = self.space.split_layer_of(name) if self._alive_index else None
            return -1 if layer is None else self._alive_index[layer]
        return self._block_index[jb]

    def macs_rows(self, model: nn.Module, space: SearchSpace) -> list[Row]:
        """MACs: one term per handled layer (its MACs x the keep of the sides it scales with),
        the MACs of a block outside its handled layers (x its depth) and the rest (constant)."""
        rows = []
        attributed = 0
        for name, layer in space.layers.items():
            if layer.macs == 0:
                continue
            attributed += layer.macs
            sides = layer.macs_sides
            f_in = self.group(layer.in_slots) if "in" in sides else -1
            f_out = self.group(layer.out_slots) if "out" in sides else -1
            rows.append((float(layer.macs), f_in, f_out, self.block(name)))
        rest = space.total_macs - attributed
        for j, d in enumerate(space.depth):  # MACs outside handled layers but inside a block
            for i, b in enumerate(d.blocks):
                inner = sum(space.module_macs.get(m, 0) for m in b.members or [b.name]) - sum(
                    l.macs for n, l in space.layers.items() if b.contains(n))
                if inner:
                    rows.append((float(inner), -1, -1, self._block_index[(j, i)]))
                    rest -= inner
        for layer, units in space.split_layers().items():  # ... inside a split block, outside its units
            inner = space.module_macs.get(layer, 0) - sum(
                space.module_macs.get(m, 0) for j, i in units for m in space.depth[j].blocks[i].members) - sum(
                l.macs for n, l in space.layers.items()
                if (n == layer or n.startswith(layer + ".")) and space.block_of(n) is None)
            if inner:
                rows.append((float(inner), -1, -1, self._alive_index[layer]))
                rest -= inner
        rows.append((float(rest), -1, -1, -1))
        return rows

    def params_rows(self, model: nn.Module, space: SearchSpace,
                    where: Callable[[str, nn.Module], bool] | None = None) -> list[Row]:
        """Parameters: one term per parameter tensor (its size x the keep of the sides it
        has x its block's depth); ``where(module_name, module)``: only the parameters of the
        modules it accepts (None: all)."""
        modules = dict(model.named_modules())
        covered: dict[str, tuple[int, int]] = {}
        for name, layer in space.layers.items():
            if layer.virtual:
                continue
            module = modules[name]
            for pname, dims in handler_for(module).param_dims(module).items():
                sides = set(dims.values())
                f_in = self.group(layer.in_slots) if "in" in sides else -1
                f_out = self.group(layer.out_slots) if "out" in sides else -1
                covered[f"{name}.{pname}" if name else pname] = (f_in, f_out)
        for pname, (_, slots) in space.params.items():
            covered[pname] = (self.group(slots), -1)
        rows = []
        for pname, p in model.named_parameters():
            if pname.startswith(GATES_NAME + "."):
                continue
            owner = pname.rpartition(".")[0]
            if where is not None and not where(owner, modules[owner]):
                continue
            f_in, f_out = covered.get(pname, (-1, -1))
            rows.append((float(p.numel()), f_in, f_out, self.block(owner)))
        return rows

    def kv_rows(self, model: nn.Module, space: SearchSpace) -> list[Row]:
        """One term per attention layer: bytes x keep(KV heads) x keep(head dim) x depth. The
        attention handler records the module with its KV-head units as input slots and its
        per-head dims (None when not searched) as output slots."""
        rows = []
        for kv in require_kv_layers(model):
            layer = space.layers.get(kv.name)
            f_in = self.group(layer.in_slots) if layer is not None else -1
            f_out = self.group(layer.out_slots) if layer is not None else -1
            rows.append((float(kv.bytes), f_in, f_out, self.block(kv.name)))
        return rows

    # ------------------------------------------------------------------ evaluation
    def __call__(self, width_mask: torch.Tensor, depth_mask: torch.Tensor) -> torch.Tensor:
        """r_c from the width mask (n_slots + 1,) and flat depth mask (n_blocks,)."""
        w = width_mask.to(torch.float64)
        dev = w.device
        seg, flat, length, base, index, one = self.on(
            dev, self._seg, self._flat, self._len, self.terms.base, self._factor_index, self._one)
        keep = torch.zeros(len(self._groups), dtype=torch.float64, device=dev).index_add(0, seg, w[flat]) / length
        depth = depth_mask.to(torch.float64)
        if len(self._alive_units):  # sublayer depth: a split block lives while one branch does
            units, = self.on(dev, self._alive_units)
            off = 1 - torch.cat([depth, depth.new_zeros(1)])[units]  # (A, K)
            depth = torch.cat([depth, 1 - off.prod(dim=1)])
        factors = torch.cat([keep, one, depth, one])  # (G + 1 + B + A + 1,)
        k_in, k_out, d = factors[index].unbind(0)  # (T,) each: one gather, one backward
        per_term = base * k_in * k_out * d
        return per_term.sum() + self.constant
