"""How much memory a search needs on each rank, before launching it (``dmscale inspect
--memory``).

:func:`estimate_search_memory` adds up what one rank holds at the peak of a training step:

* **fixed** for the whole run: the weights (float32: dmscale keeps parameters in float32
  under ``--precision bf16`` / ``fp16`` autocast), the optimiser state (AdamW: two float32
  moments, SGD with momentum: one; none for pipeline ``p-``, whose weights are frozen), a
  distillation teacher's weights (a whole float32 copy per rank under DDP; under FSDP 1/N of
  it, stored in bfloat16 under ``bf16``), the DMS gates (each dimension's ``a`` with its
  gradient and Adam moments, and the importance of every element: kilobytes to a few
  megabytes), the other buffers, DDP's gradient buckets (one more copy of the gradients when
  ``world_size > 1`` without sharding), and under FSDP the weights it gathers: the root
  group's and two blocks' (the one running and the one prefetched), with one block's
  unsharded gradients, and the teacher's root group and two blocks while it runs;
* **the larger of two moments**: the forward and backward pass (activations, temporaries and
  the gradients produced so far: traced by :func:`dmscale.engine.memory_trace.trace_step`
  at the per-rank batch, or the ``activations`` you give) and the optimiser step (all
  gradients plus the step's temporaries: one more parameter-sized tensor for the multi-tensor
  ``foreach`` optimisers a GPU runs, only the largest parameter's on a CPU).

Under ``shard="fsdp"`` the weights, gradients and optimiser state are divided by the world
size. With ``precision="bf16"`` as well, FSDP gathers the weights in bfloat16
(``MixedPrecisionPolicy``, :func:`dmscale.engine.fsdp_plan.mixed_precision`): the gathered
groups take 2 bytes a parameter, a block's unsharded gradients 2 + 4 (bfloat16, and their
float32 copy for the reduce-scatter), and the step is traced with bfloat16 weights, so
autocast makes no copy of them. A model with BatchNorm layers keeps float32 weights
(:func:`~dmscale.engine.fsdp_plan.low_precision_params_unsupported`), and so does its teacher. What is not counted: the CUDA context and the caching allocator's fragmentation (add
a few GB per GPU), NCCL buffers, and a teacher's forward at another batch.

Example:
    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    >>> est = estimate_search_memory(net, lambda m: m(torch.randn(32, 64)).square().mean(),
    ...                              optimizer="adamw", device="cpu")
    >>> est.weights == est.gradients == 4 * 18696, est.optimizer_state == 2 * est.weights
    (True, True)
    >>> est.total > 4 * est.weights
    True
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from dmscale.core.errors import ConfigError
from dmscale.core.masks import GATES_NAME
from dmscale.engine.fsdp_plan import low_precision_params_unsupported
from dmscale.engine.memory_trace import trace_step
from dmscale.engine.rundir import fmt_count

__all__ = ["MemoryEstimate", "estimate_search_memory", "format_bytes", "OPTIMIZER_STATES"]

# float32 tensors the optimiser of the weights keeps per parameter
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1, "sgd-nomomentum": 0, "none": 0}
_AUTOCAST = {"32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def format_bytes(n: float) -> str:
    """``n`` bytes as GiB / MiB / KiB, e.g. ``format_bytes(3 * 2**30) == '3.00 GiB'``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds at the peak of a search step; :meth:`table` prints them."""

    params: int  # the model's parameters (all ranks together), gates left out
    world_size: int
    shard: str
    precision: str
    optimizer: str
    weights: int
    gradients: int
    optimizer_state: int
    teacher: int
    gates: int
    buffers: int
    communication: int  # DDP gradient buckets, or FSDP's gathered weights and gradients
    forward_backward: int | None  # traced peak of the forward + backward pass (grads included)
    optimizer_step: int  # the gradients plus the optimiser step's temporaries
    notes: tuple[str, ...] = field(default=())

    @property
    def fixed(self) -> int:
        return (self.weights + self.optimizer_state + self.teacher + self.gates + self.buffers
                + self.communication)

    @property
    def activations(self) -> int | None:
        """The forward/backward peak beyond this rank's gradients (None: not estimated)."""
        return None if self.forward_backward is None else max(0, self.forward_backward - self.gradients)

    @property
    def total(self) -> int:
        """Peak bytes per rank: fixed + max(forward/backward pass, optimiser step)."""
        return self.fixed + max(self.forward_backward or self.gradients, self.optimizer_step)

    def fits(self, device_bytes: float, reserve: float = 0.9) -> bool:
        """Whether :attr:`total` fits in ``reserve`` x ``device_bytes`` (the rest for the CUDA
        context and fragmentation)."""
        return self.total <= reserve * device_bytes

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "activations": self.activations, "total": self.total}

    def table(self) -> str:
        """The breakdown as aligned text lines."""
        comm = {"fsdp": "FSDP gathered weights and gradients", "none": "DDP gradient buckets"}[self.shard]
        act = "not estimated: add them" if self.activations is None else format_bytes(self.activations)
        rows = [("weights (float32)", format_bytes(self.weights)),
                ("gradients", format_bytes(self.gradients)),
                (f"optimizer state ({self.optimizer})", format_bytes(self.optimizer_state)),
                ("distillation teacher", format_bytes(self.teacher)),
                ("DMS gates and importance", format_bytes(self.gates)),
                ("buffers", format_bytes(self.buffers)),
                (comm, format_bytes(self.communication)),
                ("activations (forward/backward peak)", act),
                ("optimizer step temporaries", format_bytes(self.optimizer_step - self.gradients))]
        head = (f"memory per rank: {fmt_count(self.params)} parameters, {self.world_size} rank(s), "
                f"--shard {self.shard}, --precision {self.precision}")
        out = [head] + [f"  {name:<38} {value:>14}" for name, value in rows]
        out.append(f"  {'total (peak)':<38} {format_bytes(self.total):>14}")
        out += [f"  note: {n}" for n in self.notes]
        return "\n".join(out)


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _fsdp_groups(model: nn.Module) -> tuple[int, int]:
    """(bytes of the largest block, bytes of the root group) of FSDP's plan for ``model``."""
    from dmscale.engine.fsdp_plan import plan_shards

    try:
        plan = plan_shards(model)
    except Exception:  # noqa: BLE001 - no plan: treat the whole model as the root group
        return 0, _bytes(p for n, p in model.named_parameters() if not n.startswith(GATES_NAME))
    modules = dict(model.named_modules())
    blocks = [_bytes(p for n, p in modules[name].named_parameters() if not n.startswith(GATES_NAME))
              for name in plan.blocks]
    in_blocks = {id(p) for name in plan.blocks for p in modules[name].parameters()}
    root = _bytes(p for n, p in model.named_parameters() if id(p) not in in_blocks and not n.startswith(GATES_NAME))
    return max(blocks, default=0), root


def _teacher(teacher: nn.Module | None, split: int, low: bool) -> tuple[int, int]:
    """(bytes a rank keeps, bytes FSDP gathers while it runs: root + two blocks) of a frozen
    teacher sharded over ``split`` ranks (1: whole, nothing gathered), its parameters in
    bfloat16 when ``low`` (and it has no BatchNorm layer); buffers are never sharded. Its
    gates are left out (a supernet teacher is copied before ``dms.prepare``)."""
    if teacher is None:
        return 0, 0
    low = low and low_precision_params_unsupported(teacher) is None
    params = [p for n, p in teacher.named_parameters() if not n.startswith(GATES_NAME)]
    scale = 0.5 if low else 1.0  # float32 -> bfloat16
    buffers = _bytes(b for n, b in teacher.named_buffers() if not n.startswith(GATES_NAME))
    kept = -(-int(scale * _bytes(params)) // split) + buffers
    if split == 1:
        return kept, 0
    block, root = _fsdp_groups(teacher)
    return kept, int(scale * (root + 2 * block))


def estimate_search_memory(
    model: nn.Module,
    forward_loss: Callable[[nn.Module], torch.Tensor] | None = None,
    *,
    world_size: int = 1,
    shard: str = "none",
    precision: str = "32",
    optimizer: str = "adamw",
    train_weights: bool = True,
    teacher: nn.Module | None = None,
    activations: int | None = None,
    device: str = "cuda",
) -> MemoryEstimate:
    """The peak memory of one rank of a search of ``model`` (see the module docstring).

    Args:
        model: the model, prepared (``dms.prepare``: its gates are counted) or not; real or on
            the ``meta`` device (``with torch.device("meta"): build()``: no memory used).
        forward_loss: called with a fake copy of ``model`` (see
            :func:`~dmscale.engine.memory_trace.trace_step`); makes inputs of the *per-rank*
            batch, runs the teacher if there is one, returns the loss. None: give
            ``activations`` or leave them out of the total (the table says so).
        world_size: ranks (GPUs) of the run. shard: ``"none"`` (DDP) or ``"fsdp"``.
        precision: ``"32"``, ``"bf16"`` or ``"fp16"`` (autocast of the traced step).
        optimizer: the weights' optimiser, a key of :data:`OPTIMIZER_STATES`.
        train_weights: False for pipeline ``p-`` (frozen weights: no gradients, no state).
        teacher: the distillation teacher (a whole copy on every rank; sharded under FSDP,
            as :func:`dmscale.engine.fsdp.shard_frozen` does). Its gates, if any, are left out.
        activations: bytes of the forward/backward peak beyond the gradients, instead of a trace.
        device: ``"cuda"`` (foreach optimisers: a parameter-sized temporary) or ``"cpu"``.
    """
    if shard not in ("none", "fsdp"):
        raise ConfigError(f"shard must be 'none' or 'fsdp', got {shard!r}")
    if precision not in _AUTOCAST:
        raise ConfigError(f"precision must be one of {sorted(_AUTOCAST)}, got {precision!r}")
    if optimizer not in OPTIMIZER_STATES:
        raise ConfigError(f"optimizer must be one of {sorted(OPTIMIZER_STATES)}, got {optimizer!r}")
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    named = list(model.named_parameters())
    weights = [p for n, p in named if not n.startswith(GATES_NAME)]
    gate_params = [p for n, p in named if n.startswith(GATES_NAME)]
    gate_buffers = [b for n, b in model.named_buffers() if n.startswith(GATES_NAME)]
    other_buffers = [b for n, b in model.named_buffers() if not n.startswith(GATES_NAME)]
    full = _bytes(weights)
    split = world_size if shard == "fsdp" else 1
    w = -(-full // split)
    g = w if train_weights else 0
    states = OPTIMIZER_STATES[optimizer] * g
    largest = max((p.numel() * p.element_size() for p in weights), default=0)
    temp = (w if device != "cpu" else -(-largest // split)) if train_weights and states else 0
    comm, notes = 0, []
    sharded = world_size > 1 and shard == "fsdp"
    low = sharded and precision == "bf16"  # FSDP's MixedPrecisionPolicy(param_dtype=bfloat16)
    why = low_precision_params_unsupported(model) if low else None
    gathered = low and why is None
    if world_size > 1 and shard == "none" and train_weights:
        comm = g
    elif sharded:
        block, root = _fsdp_groups(model)
        half = 0.5 if gathered else 1.0
        comm = int(half * (root + 2 * block) + (block * (half + 1) if train_weights and gathered else
                                                 block if train_weights else 0))
    if gathered:
        notes.append("FSDP gathers the weights in bfloat16 (the shards, gradients and optimizer state stay "
                     "float32); a teacher is stored in bfloat16")
    elif why:
        notes.append(f"FSDP gathers float32 weights: {why}")
    t_kept, t_gathered = _teacher(teacher, split, low)
    comm += t_gathered
    fb = None
    if forward_loss is not None:
        trace = trace_step(model, forward_loss, _AUTOCAST[precision],
                           param_dtype=torch.bfloat16 if gathered else None)
        fb = trace.peak if split == 1 else trace.peak_without_grads + g
        if not train_weights:
            fb = trace.peak_without_grads
    elif activations is not None:
        fb = g + int(activations)
    else:
        notes.append("activations not estimated: pass forward_loss or activations")
    return MemoryEstimate(
        params=sum(p.numel() for p in weights), world_size=world_size, shard=shard, precision=precision,
        optimizer=optimizer if train_weights else "none (frozen weights)", weights=w, gradients=g,
        optimizer_state=states, teacher=t_kept,
        gates=4 * _bytes(gate_params) + _bytes(gate_buffers), buffers=_bytes(other_buffers),
        communication=comm, forward_backward=fb, optimizer_step=g + temp, notes=tuple(notes))
