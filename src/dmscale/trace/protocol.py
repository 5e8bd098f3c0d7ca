"""What layer handlers and function rules may ask of a trace in progress.

:class:`TraceRecorder` is the part of :class:`~dmscale.trace.tracer.Tracer` that the rule
table (:mod:`dmscale.trace.rules`) and the layer handlers (:mod:`dmscale.trace.handlers`)
call. They type against this protocol, so they never import the tracer that imports them:
the dependency points one way, tracer -> rules/handlers -> protocol -> graph.

Example:
    >>> from dmscale.trace.tracer import Tracer
    >>> from torch import nn
    >>> isinstance(Tracer(nn.Linear(2, 2)), TraceRecorder)
    True
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from dmscale.trace.graph import Label, UnionFind

__all__ = ["TraceRecorder"]


@runtime_checkable
class TraceRecorder(Protocol):
    """The recording surface of a trace. Ids are channel ids of :mod:`dmscale.trace.graph`."""

    uf: UnionFind
    # handled module -> the torch functions that received one of its parameters
    opaque_param_uses: dict[str, set[str]]

    def label_of(self, t: Any) -> Label | None:
        """The channel label a tensor carries, if any."""

    def set_label(self, t: torch.Tensor, dim: int, ids: np.ndarray) -> None:
        """Label ``t``'s ``dim`` with ``ids`` (len(ids) == t.shape[dim])."""

    def pin_ids(self, ids: np.ndarray, reason: str) -> None:
        """Never search these channels, for ``reason``."""

    def pin_label(self, lab: Label | None, reason: str) -> None:
        """:meth:`pin_ids` of a label's ids (no-op for None)."""

    def take_channel_label(self, lab: Label | None, dim: int, what: str) -> np.ndarray | None:
        """The ids of ``lab`` if it sits on ``dim``; otherwise pin it and return None."""

    def produce(self, name: str, n: int, kind: str = "width") -> np.ndarray:
        """``n`` fresh channel ids a layer ``name`` produces."""

    def product(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Ids of the grid a x b (a-major) whose mask is mask(a_i) * mask(b_j)."""

    def record_layer(self, name: str, handler: str, in_ids: np.ndarray | None, out_ids: np.ndarray | None,
                     macs_sides: tuple[str, ...] | None = None, virtual: bool = False,
                     masked_norm: bool = False, macs_override: int | None = None,
                     mask_output: bool = False) -> None:
        """Record a handled layer and the channel ids it reads and writes."""

    def label_param(self, t: torch.Tensor, dim: int, ids: np.ndarray) -> bool:
        """Record that parameter ``t`` carries ``ids`` along ``dim``; False if ``t`` is no parameter."""

    def pin_size_reads(self, reason: str) -> None:
        """Pin the channels whose count the running module's code read."""

    def tie_size_reads(self, ids: np.ndarray) -> None:
        """Tie ``ids`` to every width of the same size the running module's code read."""
