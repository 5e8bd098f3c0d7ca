"""Which phases a run goes through, and the seed each phase's random draws start from.

============  ==========================================================
``np``        search (randomly initialised supernet) -> retrain
``p``         pretrain (or ``--init``) -> search -> retrain
``p-``        pretrain (or ``--init``) -> search of the structure only
``pretrain``  pretrain (the ``dmscale pretrain`` command)
``retrain``   retrain a found structure (the ``dmscale retrain`` command)
============  ==========================================================

Example:
    >>> from dmscale.config.run_config import RunConfig
    >>> phases_of(RunConfig(command="search", task="digits", pipeline="p").resolved())
    ['pretrain', 'search', 'retrain']
"""

from __future__ import annotations

from dmscale.config.run_config import ConfigError, RunConfig
from dmscale.tasks.hf_model import is_hf_model
from dmscale.tasks.start_weights import starts_from_weights

__all__ = ["PHASE_SEED", "phases_of"]

# a phase that starts afresh seeds torch with cfg.seed * 10 + this; its batches use the same seed
PHASE_SEED = {"pretrain": 1, "search": 2, "finish": 3, "retrain": 4}


def phases_of(cfg: RunConfig) -> list[str]:
    """The phases a run of ``cfg`` goes through."""
    if cfg.command == "pretrain":
        return ["pretrain"]
    if cfg.command == "retrain":
        return ["retrain"]
    phases: list[str] = []
    pretrained = is_hf_model(cfg.model) or starts_from_weights(cfg)  # hf:, --weights, --pretrained
    if cfg.pipeline in ("p", "p-") and cfg.init is None and not (pretrained and not cfg.pretrain_epochs):
        if not cfg.pretrain_epochs:
            raise ConfigError(f"pipeline {cfg.pipeline} needs a pretrained supernet: "
                              "--pretrain-epochs > 0, --init RUN, or --weights PATH / --pretrained "
                              "with --pretrain-epochs 0")
        phases.append("pretrain")
    phases.append("search")
    if cfg.pipeline in ("np", "p") and cfg.retrain_epochs:
        phases.append("retrain")
    return phases
