"""Distillation from a frozen teacher: logits KL and hidden states (``--distill-weight``,
``--distill-hidden``).

The hidden states of a student whose search pruned the hidden size are narrower than the
teacher's. The export keeps a subset of the supernet's hidden channels -- recorded in the
structure as the ``"out"`` of the input embedding (:func:`kept_hidden_channels`) -- and
computes exactly what the hardened supernet computes on those channels (every block output
``h[l]`` and the final normalised state ``h[L]``: the search's norms take their statistics
over the kept channels only, :class:`dmscale.core.mask_hooks.MaskedNorm`). So the student's hidden
states are compared with the teacher's at those channels, ``h_t[..., kept]``
(:func:`hidden_distill_loss` with ``teacher_channels``).

Example:
    >>> h_t = tuple(torch.randn(2, 3, 6) for _ in range(3))  # teacher: hidden size 6
    >>> kept = [0, 2, 5]                                     # the export kept 3 channels
    >>> h_s = tuple(h[..., kept] for h in h_t)               # a student that matches them
    >>> float(hidden_distill_loss(h_s, h_t, teacher_channels=kept))
    0.0
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dmscale.core.errors import StructureError

if TYPE_CHECKING:
    from dmscale.config.run_config import RunConfig

__all__ = ["distill_loss", "hidden_distill_loss", "kept_hidden_channels", "Distillation", "DistillTerm"]

DistillTerm = tuple[str, float, torch.Tensor]  # (metrics name, weight, unweighted loss)


class _RunsModels(Protocol):
    """What distillation needs of a task (:class:`dmscale.tasks.registry.Task` has both)."""

    def forward(self, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor: ...

    def forward_hidden(self, model: nn.Module, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


def distill_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(teacher || student) of the softened distributions over the last dim, times T^2.

    Example:
        >>> z = torch.randn(3, 5)
        >>> float(distill_loss(z, z, 2.0)) == 0.0
        True
    """
    t = float(temperature)
    s = F.log_softmax(student.reshape(-1, student.shape[-1]) / t, dim=-1)
    q = F.log_softmax(teacher.reshape(-1, teacher.shape[-1]).detach() / t, dim=-1)
    return F.kl_div(s, q, log_target=True, reduction="batchmean") * (t * t)


def hidden_distill_loss(student: Sequence[torch.Tensor], teacher: Sequence[torch.Tensor],
                        teacher_channels: Sequence[int] | torch.Tensor | None = None) -> torch.Tensor:
    """Mean over layers of the MSE between the student's and the teacher's hidden states.

    ``student`` / ``teacher`` are Hugging Face ``hidden_states`` tuples: ``h[0]`` the
    embeddings' output, ``h[l]`` the output of block ``l``, ``h[L]`` the final (normalised)
    state; the student's are ``(B, T, d_s)``, the teacher's ``(B, T, d_t)``. With ``L_s`` and
    ``L_t`` blocks and ``K = teacher_channels`` (``d_s`` indices into ``range(d_t)``, all of
    them when None)::

        L_hidden = 1/|P| * sum_{(i, j) in P} mean((h_s[i] - h_t[j][..., K])^2)
        P = {(l, l) : l = 1 .. L}     if L_s == L_t = L
            {(L_s, L_t)}              otherwise

    Same depth -- every search, since the supernet keeps all blocks and a block that depth
    search removes has its residual branch masked to zero, so its output *is* its input, the
    identity the exported model has in its place: block ``l`` is compared with the teacher's
    block ``l`` (the embeddings, identical at the start, are left out). Different depth -- the
    finetuning of an export whose depth search removed blocks: only the final hidden state,
    since the export does not record which teacher block each kept block was.

    Width: during a search the supernet keeps its full hidden size, and every channel is
    compared (a pruned channel is still computed -- masks act on the inputs of the layers
    that read the hidden state, not on the residual stream -- but nothing reads it). An
    export whose search pruned the hidden size is compared at the channels it kept
    (``teacher_channels``, :func:`kept_hidden_channels`): there its hidden states are those of
    the hardened supernet, so the finetune continues the kept channels' part of the search's
    loss (the mean is over ``d_s`` channels instead of ``d_t``).

    Raises:
        ValueError: fewer than two hidden states, or the widths differ after indexing.

    Example:
        >>> h = tuple(torch.randn(2, 3, 4) for _ in range(3))
        >>> float(hidden_distill_loss(h, h))
        0.0
        >>> round(float(hidden_distill_loss(h, tuple(x + 1 for x in h))), 6)
        1.0
        >>> wide = tuple(torch.cat([x, torch.randn(2, 3, 2)], -1) for x in h)  # d_t = 6
        >>> float(hidden_distill_loss(h, wide, teacher_channels=[0, 1, 2, 3]))
        0.0
    """
    if len(student) < 2 or len(teacher) < 2:
        raise StructureError(f"hidden_distill_loss: expected the embeddings and at least one block's "
                             f"hidden state, got {len(student)} (student) and {len(teacher)} (teacher)")
    if len(student) == len(teacher):
        pairs = list(zip(student[1:], teacher[1:]))
    else:
        pairs = [(student[-1], teacher[-1])]
    idx = None if teacher_channels is None else \
        torch.as_tensor(teacher_channels, dtype=torch.long, device=teacher[-1].device)  # (d_s,)
    terms = []
    for s, t in pairs:
        t = t.detach()
        if idx is not None:
            t = t.index_select(-1, idx)  # (B, T, d_t) -> (B, T, d_s)
        if s.shape != t.shape:
            raise StructureError(f"hidden_distill_loss: the student's hidden states have shape "
                                 f"{tuple(s.shape)}, the teacher's {tuple(t.shape)}"
                                 + (" after indexing by teacher_channels" if teacher_channels is not None
                                    else "; pass teacher_channels (the teacher's channels the student "
                                         "kept) when the hidden size was pruned"))
        terms.append(F.mse_loss(s.float(), t.float()))
    return torch.stack(terms).mean()


def _input_embedding_name(model: nn.Module) -> str | None:
    """The qualified name of the input embedding of the (wrapped) Hugging Face model in
    ``model``: the first module with ``get_input_embeddings()``, in module order."""
    for prefix, module in model.named_modules():
        get = getattr(module, "get_input_embeddings", None)
        if not callable(get):
            continue
        try:
            emb = get()
        except (NotImplementedError, AttributeError):
            continue
        for name, sub in module.named_modules():
            if sub is emb and name:
                return f"{prefix}.{name}" if prefix else name
    return None


def kept_hidden_channels(model: nn.Module, structure: dict[str, Any] | None) -> tuple[list[int], int] | None:
    """``(kept, d)``: the supernet's hidden size ``d`` and the indices in ``range(d)`` of the
    hidden channels that ``model`` -- the supernet, an export or ``apply_structure`` of
    ``structure`` -- keeps; None when the structure does not prune them (or says nothing).

    The hidden stream's channels are those of the input embedding's output, so they are its
    entry's ``"out"`` in the structure (the final norm's ``"out"`` and the LM head's ``"in"``
    are the same list, one coupled group). ``model`` is only used to find the embedding's name
    (``get_input_embeddings()``); it may be the supernet or the export.

    Example:
        >>> class LM(nn.Module):
        ...     def __init__(self):
        ...         super().__init__(); self.embed = nn.Embedding(10, 4)
        ...     def get_input_embeddings(self):
        ...         return self.embed
        >>> s = {"layers": {"embed": {"handler": "embedding", "in": None, "out": [0, 2],
        ...                           "shapes": {"weight": [10, 4]}}}}
        >>> kept_hidden_channels(LM(), s)
        ([0, 2], 4)
        >>> kept_hidden_channels(LM(), {"layers": {}}) is None
        True
    """
    name = _input_embedding_name(model)
    spec = ((structure or {}).get("layers") or {}).get(name) if name else None
    if not spec or spec.get("out") is None or spec.get("handler") != "embedding":
        return None
    shape = (spec.get("shapes") or {}).get("weight")
    if not shape:
        return None
    return [int(i) for i in spec["out"]], int(shape[-1])


@dataclass
class Distillation:
    """Distillation from a frozen ``teacher``: the student's logits for the task loss and the
    distillation terms to add to it, ``weight * KL`` (:func:`distill_loss`, recorded as
    ``distill_loss``) and ``hidden_weight * L_hidden`` (:func:`hidden_distill_loss` with
    ``teacher_channels``, recorded as ``distill_hidden_loss``); a term of weight 0 is not
    computed.

    Example:
        >>> from dmscale.tasks.registry import Task
        >>> student, teacher = nn.Linear(4, 3), nn.Linear(4, 3)
        >>> logits, terms = Distillation(teacher, weight=0.5)(Task(), student, torch.randn(2, 4))
        >>> [(name, w) for name, w, _ in terms]
        [('distill_loss', 0.5)]
    """

    teacher: nn.Module
    weight: float = 1.0
    temperature: float = 1.0
    hidden_weight: float = 0.0
    teacher_channels: Sequence[int] | None = None  # the teacher's hidden channels the student kept

    @classmethod
    def from_config(cls, teacher: nn.Module, cfg: "RunConfig",
                    teacher_channels: Sequence[int] | None = None) -> "Distillation":
        return cls(teacher, float(cfg.distill_weight), float(cfg.distill_temperature),
                   float(getattr(cfg, "distill_hidden", 0.0) or 0.0), teacher_channels)

    def __call__(self, task: _RunsModels, model: nn.Module, inputs: torch.Tensor) -> tuple[torch.Tensor, list[DistillTerm]]:
        """``(student logits, terms)`` on ``inputs``; the teacher runs without gradients."""
        hidden = self.hidden_weight > 0
        if hidden:
            logits, h_s = task.forward_hidden(model, inputs)
        else:
            logits = task.forward(model, inputs)
        with torch.no_grad():
            if hidden:
                t_logits, h_t = task.forward_hidden(self.teacher, inputs)
            else:
                t_logits = task.forward(self.teacher, inputs)
        terms: list[DistillTerm] = []
        if self.weight > 0:
            terms.append(("distill_loss", self.weight, distill_loss(logits, t_logits, self.temperature)))
        if hidden:
            terms.append(("distill_hidden_loss", self.hidden_weight,
                          hidden_distill_loss(h_s, h_t, self.teacher_channels)))
        return logits, terms
