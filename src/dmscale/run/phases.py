"""The phases of a ``dmscale`` run, one object each: pretrain, search (+ its finish), retrain.

Each phase has a ``name`` and ``run(ctx) -> PhaseResult``: it reads and writes only the run's
:class:`~dmscale.run.context.RunContext` (configuration, task, device, run directory, state,
checkpoint, :class:`~dmscale.run.watching.Watch`), builds its models, optimisers and teacher,
trains through :func:`dmscale.run.training.train` and writes its outputs.
:class:`dmscale.run.pipeline.Pipeline` builds the context once and runs the phases of
:func:`~dmscale.run.phase_list.phases_of` in order.

============  ==============================================================
pretrain      :class:`~dmscale.run.phase_pretrain.PretrainPhase`
search        :class:`~dmscale.run.phase_search.SearchPhase` (the finish, the budget solver, the export)
retrain       :class:`~dmscale.run.phase_retrain.RetrainPhase`
============  ==============================================================

Example:
    >>> sorted(build_phases())
    ['pretrain', 'retrain', 'search']
    >>> build_phases(search_overrides={"importance": "taylor"})["search"].overrides
    {'importance': 'taylor'}
"""

from __future__ import annotations

from typing import Any

from dmscale.run.context import Phase, PhaseResult
from dmscale.run.phase_pretrain import PretrainPhase
from dmscale.run.phase_retrain import RetrainPhase
from dmscale.run.phase_search import FINISH_STEPS, SearchHooks, SearchPhase
from dmscale.run.supernets import load_init
from dmscale.run.training import BN_CALIBRATION_BATCHES, calibrate_on_task

__all__ = ["BN_CALIBRATION_BATCHES", "FINISH_STEPS", "Phase", "PhaseResult", "PretrainPhase", "RetrainPhase",
           "SearchHooks", "SearchPhase", "build_phases", "calibrate_on_task", "load_init"]


def build_phases(search_overrides: dict[str, Any] | None = None,
                 search_hooks: SearchHooks | None = None) -> dict[str, Phase]:
    """The phase objects of a run by name; the search with ``search_overrides`` (fields of
    its :class:`~dmscale.SearchConfig`) and ``search_hooks``."""
    return {"pretrain": PretrainPhase(), "search": SearchPhase(search_overrides, search_hooks),
            "retrain": RetrainPhase()}
