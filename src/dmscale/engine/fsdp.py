"""Fully sharded data parallel (FSDP2, ``torch.distributed.fsdp.fully_shard``) for a search.

Under DDP every rank holds the whole model; a model too large for one device is sharded
instead: :func:`shard_model` applies ``fully_shard`` to every block (a Hugging Face model's
decoder layers, else the residual blocks of the search space, else the items of the longest
``nn.ModuleList``), innermost first, then to the root. Each rank then keeps 1/N of every
weight and of its optimiser state and gathers a block's weights only while it runs.

The structural parameters stay replicated: the ``dms_gates`` submodule's parameters (each
dimension's ``a``) are ``ignored_params`` of every ``fully_shard``, its buffers (importance)
are never sharded, and rank 0's values are broadcast once at sharding. After each backward,
:meth:`Sharded.sync_grads` averages the gradients of ``a`` over the ranks (what DDP does for
them) and ``searcher.sync_importance()`` averages the mask gradients before Eq. 4, as under
DDP, so ``a``, importance and the structure are the same on every rank and equal one process
on the global batch.

Masks folded into weights (``SearchConfig(fold_masks=True)``, the default) keep working:
FSDP2's pre-forward hook (which all-gathers the block's weights) is registered with
``prepend=True``, so it runs before the fold's pre-hook of the same module and before any
submodule's; the fold multiplies the unsharded weight for the call, and the gradient reaches
the unsharded weight, which FSDP reduce-scatters as usual.

Under ``--precision bf16`` (``param_dtype=torch.bfloat16``) the weights are gathered in
bfloat16 (:func:`~dmscale.engine.fsdp_plan.mixed_precision`; the shards, gradients and
optimiser state stay float32), so autocast finds bfloat16 weights and saves no cast copy of
each for the backward pass; the fold multiplies the gathered bfloat16 weight by the float32
mask cast to bfloat16, and the mask's gradient returns to the float32 gates. A distillation
teacher is sharded by :func:`shard_frozen`: 1/N of its weights per rank, stored in bfloat16
under ``--precision bf16``.

The model is only in pieces while it trains. :meth:`Sharded.gather` rebuilds the whole
(prepared) model on rank 0, on the CPU, from ``get_model_state_dict(full_state_dict=True,
cpu_offload=True)`` into a copy of the model taken before sharding whose weights lived on
the meta device; :meth:`Sharded.export` exports (and verifies) from it on rank 0. Both are
collectives: call them on every rank; ranks other than 0 get None.

Example (one process: sharding is a no-op, as DDP's wrapping is):
    >>> import torch, dmscale as dms
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> searcher = dms.prepare(net, torch.randn(2, 4), dms.SearchConfig("params", 0.5))
    >>> plan_shards(net).replicated[:1]
    ('dms_gates.width_ratios',)
    >>> handle = shard_model(net)
    >>> handle.active, unsharded(net) is net, sync_replicated_grads(net)
    (False, True, 0)
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dmscale.core.distributed import is_distributed, rank, world_size
from dmscale.core.errors import ConfigError, PendingImportanceError
from dmscale.core.masks import GATES_NAME
from dmscale.engine.fsdp_frame import _materialize, _skeleton, _to_cpu
from dmscale.engine.fsdp_plan import ShardPlan, fsdp_unavailable, mixed_precision, plan_shards

__all__ = ["ShardPlan", "Sharded", "export_search", "fsdp_unavailable", "load_model_state", "load_optimizer_state", "model_state", "optimizer_state", "plan_shards", "shard_frozen", "shard_model", "sharded",
           "sync_replicated_grads",
           "unsharded"]  # ShardPlan, fsdp_unavailable and plan_shards live in dmscale.engine.fsdp_plan

_HANDLE = "_dms_sharded"  # the attribute (in the model's __dict__) that holds its Sharded handle


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


@dataclass
class Sharded:
    """A model sharded by :func:`shard_model` (``active`` False: one process, nothing sharded).

    Attributes:
        model: the model, in place (its blocks and root are FSDP modules when active).
        plan: what was sharded and what stays replicated.
        frame: the copy taken before sharding, weights on the meta device (None when inactive,
            and for a frozen module, which is never gathered).
        param_dtype: the dtype FSDP gathers the weights in (None: the stored dtype).
    """

    model: nn.Module = field(repr=False)
    plan: ShardPlan
    frame: nn.Module | None = field(default=None, repr=False)
    active: bool = False
    replicated: list[nn.Parameter] = field(default_factory=list, repr=False)
    param_dtype: torch.dtype | None = None

    def sync_grads(self) -> int:
        """Average the replicated parameters' gradients over the ranks (one all-reduce);
        returns how many were averaged. Call it on every rank after each backward.

        A parameter frozen after its gradient was computed (depth's ``a`` when a resource loss
        evaluated after the task backward freezes depth) still has that gradient, which the
        optimizer applies: it is averaged too (the ranks freeze in lockstep)."""
        params = [p for p in self.replicated if p.requires_grad or p.grad is not None]
        if not self.active or not params:
            return 0
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat.div_(world_size())
        offset = 0
        for p in params:
            n = p.numel()
            if p.grad is not None:
                p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n
        return len(params)

    def state_dict(self) -> dict[str, Any]:
        """The model's full state dict on rank 0, on the CPU ({} on the other ranks; a collective)."""
        if not self.active:
            return self.model.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def gather(self) -> nn.Module | None:
        """The whole model (hooks and gates included) on rank 0, on the CPU; None on the
        other ranks. A collective: every rank calls it."""
        if not self.active:
            return self.model
        state = self.state_dict()
        if rank() != 0:
            return None
        return _materialize(copy.deepcopy(self.frame), state).to("cpu")

    def export(self, searcher: Any, verify: bool | None = None) -> nn.Module | None:
        """``searcher.export(verify)`` computed on rank 0 from the gathered model (see
        :meth:`gather`); None on the other ranks. A collective: every rank calls it.

        Raises:
            PendingImportanceError: importance updates of the last backward are pending
                (call ``searcher.sync_importance()`` on every rank first).
        """
        if not self.active:
            return searcher.export(verify)
        pending = len(searcher.gates.pending)
        if pending:
            raise PendingImportanceError(f"export under FSDP with {pending} importance updates pending: call "
                                         "searcher.sync_importance() on every rank after loss.backward()")
        full = self.gather()
        if full is None:
            return None
        bound = copy.copy(searcher)  # the same search, bound to the gathered model
        bound.model, bound.gates = full, getattr(full, GATES_NAME)
        bound.example_inputs = _to_cpu(searcher.example_inputs)
        bound.freeze_depth(searcher.gates.depth_frozen)
        return bound.export(verify)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """``optimizer``'s full state dict on rank 0 (a collective when it holds sharded parameters)."""
        if not self.active or not _holds_dtensors(optimizer):
            return optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Load a full optimizer state dict (:meth:`optimizer_state`, read on every rank)."""
        if not self.active or not _holds_dtensors(optimizer):
            optimizer.load_state_dict(state)
            return
        if not state.get("state"):  # a stateless optimizer (SGD without momentum): torch's loader
            for group, saved in zip(optimizer.param_groups, state["param_groups"]):  # needs a tensor
                group.update({k: v for k, v in saved.items() if k != "params"})
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(self.model, optimizer, state, options=StateDictOptions(full_state_dict=True))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a full state dict (:meth:`state_dict`, read on every rank) into the shards."""
        if not self.active:
            self.model.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(self.model, state, options=StateDictOptions(full_state_dict=True))


def _holds_dtensors(optimizer: torch.optim.Optimizer) -> bool:
    return any(_is_dtensor(p) for g in optimizer.param_groups for p in g["params"])


def _device_type() -> str:
    """Where the default process group's collectives run: CUDA under NCCL, else the CPU."""
    return "cuda" if "nccl" in str(dist.get_backend()) else "cpu"


def _broadcast_gates(model: nn.Module) -> None:
    """Rank 0's structural parameters and importance on every rank (one broadcast)."""
    gates = getattr(model, GATES_NAME, None)
    if gates is None:
        return
    tensors = [t for t in list(gates.parameters()) + list(gates.buffers()) if t.is_floating_point()]
    if not tensors:
        return
    device = torch.device("cuda", torch.cuda.current_device()) if _device_type() == "cuda" else torch.device("cpu")
    flat = torch.cat([t.detach().reshape(-1).to(device, torch.float32) for t in tensors])
    dist.broadcast(flat, src=0)
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def _mesh(mesh: Any) -> Any:
    """``mesh``, or a 1-D mesh of every rank (on CUDA under NCCL, else the CPU)."""
    from torch.distributed.device_mesh import init_device_mesh

    return mesh if mesh is not None else init_device_mesh(_device_type(), (world_size(),))


def _refuse_twice(model: nn.Module) -> None:
    why = fsdp_unavailable()
    if why is not None:
        raise ConfigError(f"cannot shard with FSDP: {why}; upgrade torch, or train without sharding (DDP)")
    if sharded(model) is not None:
        raise ConfigError(f"{type(model).__name__} is sharded already: shard a model once")


def shard_model(model: nn.Module, plan: ShardPlan | None = None, *, space: Any = None, mesh: Any = None,
                reshard_after_forward: bool = True, param_dtype: torch.dtype | None = None) -> Sharded:
    """Shard ``model`` (prepared for a search or not) with FSDP2 over the default process
    group, in place; returns its :class:`Sharded` handle. Shard before building optimisers:
    ``fully_shard`` replaces the parameters (by DTensors).

    ``plan`` defaults to :func:`plan_shards` (with ``space``, e.g. ``searcher.space``);
    ``mesh``: a 1-D ``DeviceMesh`` (default: every rank, on CUDA under NCCL, else the CPU).
    Without a process group of more than one rank nothing is sharded (``active`` False).
    ``param_dtype`` (``torch.bfloat16`` under ``--precision bf16``): FSDP gathers the weights
    in that dtype and reduces the gradients in float32 (:func:`mixed_precision`; not for a
    model with BatchNorm layers, which keeps float32: ``handle.param_dtype`` says which).

    Example (under torchrun)::

        searcher = dms.prepare(model, example, dms.SearchConfig("params", 0.5))
        handle = shard_model(model, space=searcher.space)
        opt = torch.optim.AdamW(searcher.model_parameters(), lr=1e-4)   # after sharding
        opt_a = torch.optim.Adam(searcher.structure_parameters(), lr=0.01)
        for step, ids in enumerate(global_batches):
            ids = shard(ids, rank(), world_size())
            loss = model(input_ids=ids, labels=ids).loss + searcher.resource_loss(step / total)
            opt.zero_grad(); opt_a.zero_grad(); loss.backward()
            handle.sync_grads(); searcher.sync_importance(); opt.step(); opt_a.step()
        small = handle.export(searcher)          # every rank calls it; rank 0 gets the model

    Raises:
        ConfigError: this torch's FSDP2 cannot shard a search (:func:`fsdp_unavailable`), or
            the model is sharded already.
    """
    plan = plan if plan is not None else plan_shards(model, space=space)
    if not is_distributed():
        return Sharded(model, plan)
    _refuse_twice(model)
    mesh = _mesh(mesh)
    _broadcast_gates(model)
    frame = _skeleton(model)
    policy = mixed_precision(model, param_dtype)
    kept = _fully_shard(model, plan, mesh, reshard_after_forward, policy)
    handle = Sharded(model, plan, frame, True, kept, None if policy is None else policy.param_dtype)
    model.__dict__[_HANDLE] = handle
    return handle


def _fully_shard(model: nn.Module, plan: ShardPlan, mesh: Any, reshard_after_forward: bool,
                 policy: Any) -> list[nn.Parameter]:
    """``fully_shard`` on ``plan``'s blocks, then the root (``plan.replicated`` ignored: they
    are returned, on the shards' device)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    names = set(plan.replicated)
    kept = [p for n, p in model.named_parameters() if n in names]
    modules = dict(model.named_modules())
    kw = dict(mesh=mesh, reshard_after_forward=reshard_after_forward, ignored_params=set(kept),
              mp_policy=policy if policy is not None else MixedPrecisionPolicy())
    for name in plan.blocks:
        fully_shard(modules[name], **kw)
    fully_shard(model, **kw)
    gates = getattr(model, GATES_NAME, None)
    if gates is not None:  # the replicated part lives where the shards do
        gates.to(torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else "cpu")
    return kept


def shard_frozen(module: nn.Module, *, param_dtype: torch.dtype | None = None, mesh: Any = None) -> Sharded:
    """Shard a frozen module -- a distillation teacher -- with FSDP2, by :func:`plan_shards`:
    each rank keeps 1/N of its weights and gathers a block's only while the block runs (every
    group, the root's too, is freed after the forward). Its outputs are the whole module's:
    the gathered weights are its weights. In place; returns the handle (the one it has when
    sharded already). In one process nothing is sharded.

    ``param_dtype`` (``torch.bfloat16`` under ``--precision bf16``): the parameters are stored
    in it (buffers keep theirs) and floating inputs are cast to it, where
    :func:`~dmscale.engine.fsdp_plan.low_precision_params_unsupported` finds nothing against it: a frozen module never
    trains, and autocast computes its matrix products from bfloat16 weights anyway.

    Raises:
        ConfigError: a parameter requires a gradient (freeze it first), or FSDP2 is unavailable.
    """
    if sharded(module) is not None:
        return sharded(module)
    plan = plan_shards(module)
    if not is_distributed():
        return Sharded(module, plan)
    trains = [n for n, p in module.named_parameters() if p.requires_grad]
    if trains:
        raise ConfigError(f"shard_frozen: expected a frozen module, but {trains[0]!r} (and {len(trains) - 1} "
                          "more) requires a gradient: call requires_grad_(False) on its parameters first")
    _refuse_twice(module)
    module.eval()
    policy = mixed_precision(module, param_dtype)
    if policy is not None:
        for p in module.parameters():
            p.data = p.data.to(policy.param_dtype)
    _fully_shard(module, plan, _mesh(mesh), True, policy)
    handle = Sharded(module, plan, None, True, [], None if policy is None else policy.param_dtype)
    module.__dict__[_HANDLE] = handle
    return handle


def sharded(model: nn.Module) -> Sharded | None:
    """The handle of a model :func:`shard_model` sharded, or None."""
    return model.__dict__.get(_HANDLE)


def unsharded(model: nn.Module) -> nn.Module | None:
    """``model`` itself, or for a sharded model the whole model on rank 0 and None on the
    other ranks (:meth:`Sharded.gather`, a collective)."""
    handle = sharded(model)
    return model if handle is None else handle.gather()


def sync_replicated_grads(model: nn.Module) -> int:
    """:meth:`Sharded.sync_grads` of a sharded model; 0 (nothing to do) otherwise."""
    handle = sharded(model)
    return 0 if handle is None else handle.sync_grads()


def model_state(model: nn.Module) -> dict[str, Any]:
    """``model.state_dict()``, or a sharded model's full state dict on rank 0 (a collective)."""
    handle = sharded(model)
    return model.state_dict() if handle is None else handle.state_dict()


def load_model_state(model: nn.Module, state: dict[str, Any]) -> None:
    """``model.load_state_dict(state)``, into the shards of a sharded model."""
    handle = sharded(model)
    model.load_state_dict(state) if handle is None else handle.load_state_dict(state)


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()``, full on rank 0 when it holds a sharded model's parameters."""
    handle = sharded(model)
    return optimizer.state_dict() if handle is None else handle.optimizer_state(optimizer)


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """``optimizer.load_state_dict(state)``, into the shards when it holds sharded parameters."""
    handle = sharded(model)
    optimizer.load_state_dict(state) if handle is None else handle.load_optimizer_state(optimizer, state)


def export_search(searcher: Any, verify: bool | None = None) -> nn.Module | None:
    """``searcher.export(verify)``; for a sharded model :meth:`Sharded.export` (a collective:
    rank 0 gets the model, on the CPU, the other ranks None)."""
    handle = sharded(searcher.model)
    return searcher.export(verify) if handle is None else handle.export(searcher, verify)
