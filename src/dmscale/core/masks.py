"""Attach masks to a user's model with hooks, and remove them again.

A :class:`Gates` submodule (registered on the model as ``dms_gates``) holds one
:class:`~dmscale.core.topk.DifferentiableTopK` per width and depth dimension. Hooks:

* a forward pre-hook on the model computes every dimension's mask once per forward, all
  batchable gates in one :class:`~dmscale.core.gate_bank.GateBank` evaluation, and every layer's
  channel mask in one gather;
* on each layer that consumes searchable channels, ``X * m`` with m shaped 1xCx1x1 (conv) or C
  (linear) (paper A.1.1): for a standard convolution or linear layer as ``W * m`` on its
  weight for the call (:mod:`dmscale.core.weight_masks`, the same function, or on the input when that
  is the smaller tensor), otherwise on the input (:mod:`dmscale.core.mask_hooks`);
* on each removable block's branch, the branch output times the block's depth mask, so the
  block computes ``post(x + f(x) * m_i)`` (Sec. 3.2): in the weight and bias of the branch's
  last layer where it is a standard linear, convolution or affine batch norm, else on its output.

The user's parameters are never changed and no class is swapped. All hooks are instances of
:class:`DMSHook`, found again by type in :func:`detach`; attaching and detaching them is
:mod:`dmscale.core.hook_attach` (``detach`` and ``GATES_NAME`` are re-exported here).

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

from dmscale.core.distributed import is_distributed
from dmscale.core.errors import ConfigError
from dmscale.core.importance import PendingImportance
from dmscale.core.gate_bank import GateBank, batchable
from dmscale.core.channel_layout import ChannelLayout, assemble_width_mask, resolve_derived
from dmscale.core.forward_masks import ForwardMasks
from dmscale.core.ratios import ratio_leaf, stack_ratios, upgrade_state_dict
from dmscale.core.hook_attach import GATES_NAME, NORM_PREFIX, attach_hooks, block_keys, detach, fold_layers
from dmscale.core.hook_base import DMSHook, first_input
from dmscale.core.topk import DifferentiableTopK, GateFactory, StructuralGate

__all__ = ["Gates", "DMSHook", "detach", "GATES_NAME", "assemble_width_mask", "first_input"]


class Gates(nn.Module):
    """The structural parameters of one search and the masks they produce; this forward's
    masks are held by the :class:`~dmscale.core.forward_masks.ForwardMasks` it owns
    (``forward_masks``), which the hooks read through the gates (:meth:`channel_mask`,
    :meth:`norm_weights`, :meth:`depth_unit`, :meth:`depth_value`, :meth:`batched_params`)."""

    def __init__(self, width: list[StructuralGate], depth: list[StructuralGate]) -> None:
        super().__init__()
        self.width = nn.ModuleList(width)
        self.depth = nn.ModuleList(depth)
        self.mode = "soft"  # "soft" | "hard" | "open" (all ones: the self-check of prepare)
        self.enabled = True
        self.fuse_norms: bool | None = None  # masked norms compiled (None: on CUDA), core.fused_norms
        self.grad_scaler: Any = None  # a GradScaler: importance from unscaled gradients
        self._inv_scale = 1.0
        self.depth_frozen = False  # width-only phase: depth masks hard
        # torch.distributed: None = the default group (when its world size is > 1), False =
        # never synchronise, or a ProcessGroup (the data-parallel ranks)
        self.process_group: Any = None
        self.pending = PendingImportance()  # Eq. 4 updates waiting for the all-reduce
        self._forwards = 0  # training forwards so far: orders pending updates across ranks
        # this forward's masks, computed by the first forward; its layout (where each key's
        # channels lie in channel_index) is set by attach, once the hooks are in place
        self.forward_masks = ForwardMasks(ChannelLayout(), [], self.compute)

    def _apply(self, fn: Any, recurse: bool = True) -> "Gates":
        """``model.to(device)`` moves the gates; ``model.half()`` / ``.to(bfloat16)`` does
        not lower their precision: ``a`` and importance stay float32 (k = round((1-a)N)
        and the moving average need it; masks are cast to the activations' dtype)."""
        super()._apply(fn, recurse)
        for t in list(self.width) + list(self.depth):
            leaf = ratio_leaf(t)[0]
            if leaf.dtype != torch.float32:
                leaf.data = leaf.data.float()
            if t.importance.dtype != torch.float32:
                t.importance = t.importance.float()
        return self

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """A checkpoint with one ``a`` per width gate loads into the stacked ratios."""
        upgrade_state_dict(self, list(self.width), state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args)

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        """Identity: when the model is an ``nn.Sequential``, the gates are its last child
        (until :func:`detach`) and must pass the output through unchanged."""
        return x

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if "forward_masks" not in self.__dict__:  # gates pickled when they were the mask store
            self.forward_masks = ForwardMasks(_pickled_layout(self.__dict__), self.__dict__.pop("_reads", []),
                                              self.compute)
        self.forward_masks.clear()

    def __getstate__(self) -> dict[str, Any]:
        """Copies (deepcopy, pickle) drop the per-forward mask cache (non-leaf tensors: the
        mask store keeps its layout and reads only)."""
        state = self.__dict__.copy()
        state["pending"] = PendingImportance()
        state.pop("_bank", None)  # rebuilt from the copied gates on first use
        state.pop("_bank_key", None)
        state.pop("_one_cache", None)
        state.pop("_derived_cache", None)
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
        fold_masks: bool = True,
        depth_folds: dict[str, str] | None = None,
    ) -> "Gates":
        """Create the gates, register them on ``model`` and attach every hook.

        Args:
            dims / depth: per dimension ``(size, step, min_keep, temperature)``.
            consumers: layer name -> (channel dim of its input, global slot per channel,
                -1 for a fixed channel).
            branches: module name -> (depth dim, block index).
            gate_factory: builds each gate (default :class:`DifferentiableTopK`, DMS's own);
                a baseline gate implementing :class:`~dmscale.core.topk.StructuralGate`.
            fold_masks: multiply the masks of convolution and linear layers into their
                weights where that is the same function (:mod:`dmscale.core.weight_masks`);
                False keeps every mask on the activations (the paper's formulation).
            depth_folds: branch module -> the layer whose output it returns (through
                dropout only): with ``fold_masks`` the depth mask goes into that layer's weight.
        """
        if hasattr(model, GATES_NAME):
            raise ConfigError(
                f"model already has a {GATES_NAME!r} submodule: it is prepared for a search "
                "already; call dmscale.detach(model) first"
            )
        factory = DifferentiableTopK if gate_factory is None else gate_factory
        make = lambda spec: factory(  # noqa: E731
            spec[0], step=spec[1], min_keep=spec[2], temperature=spec[3],
            importance=importance, normalize=normalize,
        )
        gates = cls([make(s) for s in dims], [make(s) for s in depth])
        stack_ratios(gates, list(gates.width))  # one (W,) Parameter: core.ratios
        pairs = torch.tensor(derived or [], dtype=torch.long).reshape(-1, 2)
        gates.register_buffer("derived_a", pairs[:, 0].clone(), persistent=False)
        gates.register_buffer("derived_b", pairs[:, 1].clone(), persistent=False)
        keyed = attach_hooks(model, gates, consumers, branches, norms=norms, outputs=outputs,
                             fold_masks=fold_masks, depth_folds=depth_folds)
        layout, index = ChannelLayout.arrange(keyed, {k for k in keyed if k.startswith(NORM_PREFIX)},
                                              block_keys(fold_layers(model)))
        reads = gates.forward_masks.reads
        gates.forward_masks = ForwardMasks(layout, reads, gates.compute)
        # every hooked layer's channels, (sum of C,): int32, half the memory (an LLM has many layers)
        gates.register_buffer("channel_index", index.to(torch.int32), persistent=False)
        gates.register_buffer("read_index", torch.tensor(reads, dtype=torch.long), persistent=False)
        return gates

    def depth_read(self, j: int, block: int) -> int:
        """Register a hook's multiply by block ``block``'s mask of depth dim ``j``; returns the
        id it reads its () scalar by (:meth:`depth_value`). Where a block is read more than once
        every read gets an entry of its own in one gather, whose backward sums their gradients
        (one operation) instead of one addition per extra read."""
        reads = self.forward_masks.reads
        reads.append(sum(t.size for t in list(self.depth)[:j]) + block)
        return len(reads) - 1

    # ------------------------------------------------------------------ the hooks' reads
    # (this forward's pieces, from the mask store: see dmscale.core.forward_masks)
    def channel_mask(self, key: str) -> torch.Tensor:
        """This forward's (C,) mask of hooked layer ``key``."""
        return self.forward_masks.channel_mask(key)

    def norm_weights(self, key: str) -> torch.Tensor:
        """This forward's (C,) statistics weights ``m / sum(m)`` of masked norm ``key``."""
        return self.forward_masks.norm_weights(key)

    def depth_unit(self, j: int, block: int) -> torch.Tensor:
        """This forward's () mask of block ``block`` of depth dim ``j``."""
        return self.forward_masks.depth_unit(j, block)

    def depth_value(self, read: int) -> torch.Tensor:
        """This forward's () depth mask of read ``read`` (:meth:`depth_read`)."""
        return self.forward_masks.depth_value(read)

    def batched_params(self, unfold: Any) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The folded (weight, bias or None) of ``unfold``'s layer from this forward's batch, or None."""
        return self.forward_masks.batched_params(unfold)

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
        width, depth = self.masks(self.mode, track, defer)
        self.forward_masks.store(width[self.channel_index], depth, [t.size for t in self.depth],
                                 self._buffers.get("read_index"))

    # ------------------------------------------------------------------ batched masks
    def _bank_for(self) -> tuple[GateBank | None, list[int]]:
        """The :class:`~dmscale.core.gate_bank.GateBank` of the batchable gates (built on first
        use, rebuilt when a gate, its ``a`` or its importance buffer was replaced) and the
        positions of its gates in ``width + depth``."""
        gates = (*self.width._modules.values(), *self.depth._modules.values())
        cached = self.__dict__.get("_bank_key")
        bank = self.__dict__.get("_bank")
        if cached is not None and cached[0] == gates and bank is not None and bank.valid_for(cached[2]):
            return bank, cached[1]  # the same gates as last time (compared by identity), still valid
        which = [i for i, t in enumerate(gates) if batchable(t)]
        members = [gates[i] for i in which]
        if members and len({(t.metric, t.decay, t.centered) for t in members}) > 1:
            which, members = [], []  # mixed gate settings: each gate on its own path
        self.__dict__["_bank_key"] = (gates, which, members)
        if not members:
            return None, []
        if bank is None or not bank.valid_for(members):
            with torch.inference_mode(False):  # kept across forwards: normal tensors, whatever the mode
                bank = self.__dict__["_bank"] = GateBank(members)
        return bank, which

    def masks(self, kind: str = "soft", track: bool = False,
              defer: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(global width mask with its derived slots and trailing 1, every depth dim's mask
        concatenated (n_blocks,))
        of ``kind`` "soft", "hard" or "open", the depth masks hard while depth is frozen.

        Soft masks of every :func:`~dmscale.core.gate_bank.batchable` gate come from one
        :class:`~dmscale.core.gate_bank.GateBank` evaluation, (G, N_max); with ``track`` one
        gradient hook on it updates every gate's importance (Eq. 4); hard masks come from one
        batched evaluation too, on the device. Other gates, and hard masks of gates with
        required groups, are computed gate by gate.
        """
        n = len(self.width)
        gates = list(self.width) + list(self.depth)
        bank, which = self._bank_for() if kind in ("soft", "hard") else (None, [])
        row = {i: r for r, i in enumerate(which)}
        soft = hard = None
        if bank is not None:
            frozen = [i for i in which if i >= n and self.depth_frozen] if kind == "soft" else []
            if kind == "soft":
                soft = bank.unit_soft_masks(fresh=track)  # (G, N_max); a training forward stacks anew
                if track and soft.requires_grad:  # rows of frozen depth gates get no update
                    rows = tuple(i not in frozen and gates[i].ratio_leaf()[0].requires_grad for i in which)
                    soft.register_hook(self._importance_hook(bank.rows(rows), soft.detach(), defer, len(gates)))
            if kind == "hard" or (frozen and not any(gates[i].required_groups for i in frozen)):
                hard = bank.unit_hard_masks()  # (G, N_max) on the device, no host synchronisation

        def use_hard(i: int) -> bool:
            return kind == "hard" or (i >= n and self.depth_frozen and kind != "open")

        def source(i: int) -> torch.Tensor | None:
            return hard if use_hard(i) else soft

        def batched(i: int) -> bool:
            # hard masks of gates with required groups come from the gate itself
            return i in row and source(i) is not None and not (use_hard(i) and gates[i].required_groups)

        def one(i: int) -> torch.Tensor:
            if batched(i):
                return bank.elements(source(i), [row[i]])
            return gates[i].hard_mask() if use_hard(i) else self._mask(gates[i], kind, track, defer, i)

        def one_gather(ids: list[int]) -> bool:
            """Whether the bank has the masks of gates ``ids`` all from one source."""
            return bool(ids) and all(batched(i) and source(i) is source(ids[0]) for i in ids)

        def joined(ids: list[int]) -> torch.Tensor:
            """The element masks of gates ``ids`` concatenated: one gather when :func:`one_gather`
            (one index forward, one backward per evaluation)."""
            if one_gather(ids):
                return bank.elements(source(ids[0]), [row[i] for i in ids])
            parts = [one(i) for i in ids]
            return torch.cat(parts) if parts else torch.zeros(0, device=self._device())

        all_ids = list(range(len(gates)))
        if n and len(gates) > n and one_gather(all_ids):  # width and depth in one gather
            base, depth = bank.elements(source(0), [row[i] for i in all_ids]).split(
                [sum(g.size for g in gates[:n]), sum(g.size for g in gates[n:])])
        else:
            base, depth = joined(all_ids[:n]), joined(all_ids[n:])
        return self.assemble_width([base]) if n else self.assemble_width([]), depth

    def assemble_width(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """:func:`assemble_width_mask` of the width dims' element masks ``parts`` (in the order
        of ``width``), with this search's derived slots."""
        if not parts:
            return assemble_width_mask([], self.derived_a, self.derived_b, like=self._one())
        return assemble_width_mask(parts, *self.derived_index(), one=self._one(), resolved=True)

    def derived_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The derived slots' factor indices into the element masks with a trailing 1 (-1
        replaced by the number of width elements), on the gates' device, made once."""
        cached, device = self.__dict__.get("_derived_cache"), self._device()
        if cached is None or cached[0].device != device:
            n = sum(t.size for t in self.width)
            with torch.inference_mode(False):  # kept across forwards: a normal tensor, whatever the mode
                cached = self.__dict__["_derived_cache"] = resolve_derived(self.derived_a.to(device),
                                                                           self.derived_b.to(device), n)
        return cached

    def _mask(self, topk: StructuralGate, kind: str, track: bool, defer: bool = False,
              index: int = 0) -> torch.Tensor:
        if kind == "hard":
            return topk.hard_mask()
        if kind == "open":
            return torch.ones(topk.size, device=self._device())
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

    def _one(self) -> torch.Tensor:
        """A (1,) float32 tensor of 1 on the gates' device, made once per device."""
        cached = self.__dict__.get("_one_cache")
        if cached is None or cached.device != self._device():
            with torch.inference_mode(False):
                cached = self.__dict__["_one_cache"] = torch.ones(1, device=self._device())
        return cached

    def _device(self) -> torch.device:
        for t in (*self.width._modules.values(), *self.depth._modules.values()):  # (no view of a stacked ratio)
            return ratio_leaf(t)[0].device
        return torch.device("cpu")

    @contextlib.contextmanager
    def use(self, mode: str | None = None, enabled: bool = True) -> Iterator[None]:
        """Temporarily switch mask mode ("soft"/"hard") or disable masking."""
        prev = (self.mode, self.enabled)
        self.mode = mode or self.mode
        self.enabled = enabled
        self.forward_masks.clear()
        try:
            yield
        finally:
            self.mode, self.enabled = prev
            self.forward_masks.clear()


def _pickled_layout(state: dict[str, Any]) -> ChannelLayout:
    """The channel layout of gates pickled when they held their masks themselves (taken out of
    their ``state``): ``_layout``, or before the layout its keys and sizes (no norm groups)."""
    layout = state.pop("_layout", None)
    return layout if layout is not None else ChannelLayout(state.pop("_keys", []), state.pop("_key_sizes", []))
