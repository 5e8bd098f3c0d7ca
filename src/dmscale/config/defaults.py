"""Per-task defaults: the values of the options a run leaves at ``auto``.

The weights' optimizer, learning rate, weight decay and warm-up, the detection
augmentation, the resource weight and the structure learning rate default to ``auto``: the
run's kind of task chooses them (as Ultralytics' ``optimizer=auto`` does), and an explicit
flag or config key always wins. What was chosen is recorded in the run configuration's
``chosen`` (option -> why) and named by the summary, the report and ``--print-config``.

=======================  ==========================================================
run                      auto values
=======================  ==========================================================
``--task detect``        AdamW, lr 1e-3, weight decay 0.01, augmentation
                         ``fliplr=0,mosaic=0`` (SGD at the classifiers' lr leaves a YOLO
                         with no detections), resource weight 3
``--model hf:PATH``      AdamW, lr 1e-4, no weight decay (finetuning a pretrained LM);
                         resource weight 50 for searches of pipeline p / p- (a pretrained
                         LM's task loss pulls hard against a short search's resource loss)
anything else            SGD (momentum 0.9, Nesterov), lr 0.05, weight decay 5e-4
every search             structure lr ``max(0.01, 0.5 / search steps)``: Adam moves a
                         ratio about its lr per step, so each ratio can move 0.5 in the
                         search however short it is
=======================  ==========================================================

Example:
    >>> d = defaults_for("detect", "yolo:yolov8n.yaml", "np")
    >>> d.optimizer, d.lr_for("adamw"), d.augment, d.why
    ('adamw', 0.001, {'fliplr': 0.0, 'mosaic': 0.0}, 'auto for detect')
    >>> structure_lr_for(20), structure_lr_for(469)
    (0.025, 0.01)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "AUTO_OPTIONS",
    "BEFORE_AUTO",
    "MIN_STRUCTURE_LR",
    "STRUCTURE_REACH",
    "PRETRAINED_LM_RESOURCE_WEIGHT",
    "DETECT_RESOURCE_WEIGHT",
    "TaskDefaults",
    "defaults_for",
    "structure_lr_for",
    "resolve_structure_lr",
    "apply_defaults",
    "chosen_lines",
    "auto_brief",
]

# the options whose default is ``auto`` (resolved by the task, below)
AUTO_OPTIONS = ("optimizer", "lr", "weight_decay", "warmup", "augment", "resource_weight", "structure_lr")
# what the auto options meant in a run saved before they existed (its config has no
# ``chosen``): the fixed defaults of then, and Ultralytics' own augmentation ({}: no overrides)
BEFORE_AUTO: dict[str, Any] = {"optimizer": "sgd", "warmup": 0.02, "resource_weight": 1.0,
                               "structure_lr": 0.01, "augment": {}}
# structure lr = max(MIN_STRUCTURE_LR, STRUCTURE_REACH / search steps): the fixed 0.01 of long
# searches, and for short ones enough that each ratio can move STRUCTURE_REACH (docs/search.md)
MIN_STRUCTURE_LR = 0.01
STRUCTURE_REACH = 0.5
# the resource weight of a search that starts from a pretrained LM
PRETRAINED_LM_RESOURCE_WEIGHT = 50.0
# of a YOLO search: its loss (a sum of box, class and DFL terms) pulls harder on the ratios
# than a classifier's
DETECT_RESOURCE_WEIGHT = 3.0

_SGD_ADAMW_LR = {"sgd": 0.05, "adamw": 0.002}
_SGD_ADAMW_WD = {"sgd": 5e-4, "adamw": 0.01}


@dataclass(frozen=True)
class TaskDefaults:
    """What one kind of run trains with when its options are left at ``auto``.

    Attributes:
        why: how the summary names the choice, e.g. ``auto for detect``.
        optimizer: the weights' optimizer, ``sgd`` or ``adamw``.
        lrs / weight_decays: per optimizer (the user may pick the other one).
        warmup: fraction of each phase with a linear learning-rate warm-up.
        augment: Ultralytics augmentation overrides (detect), None for other tasks.
        resource_weight: lambda_resource of the search.
    """

    why: str
    optimizer: str = "sgd"
    lrs: dict[str, float] = field(default_factory=lambda: dict(_SGD_ADAMW_LR))
    weight_decays: dict[str, float] = field(default_factory=lambda: dict(_SGD_ADAMW_WD))
    warmup: float = 0.02
    augment: dict[str, float] | None = None
    resource_weight: float = 1.0

    def lr_for(self, optimizer: str) -> float:
        return self.lrs[optimizer]

    def weight_decay_for(self, optimizer: str) -> float:
        return self.weight_decays[optimizer]


def defaults_for(task: str, model: str | None, pipeline: str) -> TaskDefaults:
    """The defaults of a run of ``--task task --model model --pipeline pipeline``.

    Example:
        >>> defaults_for("text", "hf:lm", "p-").resource_weight, defaults_for("mnist", None, "np").optimizer
        (50.0, 'sgd')
    """
    if str(model or "").startswith("hf:"):  # finetuning a pretrained LM: small steps, no decay
        return TaskDefaults(why="auto for a pretrained hf: model", optimizer="adamw",
                            lrs={"sgd": 1e-3, "adamw": 1e-4}, weight_decays={"sgd": 0.0, "adamw": 0.0},
                            resource_weight=PRETRAINED_LM_RESOURCE_WEIGHT if pipeline in ("p", "p-") else 1.0)
    if task == "detect":  # close to Ultralytics' optimizer=auto on short runs (AdamW)
        return TaskDefaults(why="auto for detect", optimizer="adamw",
                            lrs={"sgd": 0.01, "adamw": 1e-3},  # sgd: Ultralytics' lr0
                            augment={"fliplr": 0.0, "mosaic": 0.0}, resource_weight=DETECT_RESOURCE_WEIGHT)
    return TaskDefaults(why=f"auto for {task}")


def structure_lr_for(steps: int) -> float:
    """The structure learning rate of a search of ``steps`` steps: Adam moves each ratio about
    its lr per step, so ``STRUCTURE_REACH / steps`` lets the search move a ratio that far,
    and never less than :data:`MIN_STRUCTURE_LR` (the fixed default of long searches)."""
    return max(MIN_STRUCTURE_LR, STRUCTURE_REACH / max(1, int(steps)))


def resolve_structure_lr(cfg: Any, steps: int) -> None:
    """Set ``cfg.structure_lr`` (left at auto) for a search of ``steps`` steps, recorded in
    ``cfg.chosen``."""
    cfg.structure_lr = structure_lr_for(steps)
    cfg.chosen = {**cfg.chosen, "structure_lr": f"auto: max({MIN_STRUCTURE_LR:g}, "
                                                f"{STRUCTURE_REACH:g} / {steps} search steps)"}


def apply_defaults(cfg: Any) -> None:
    """Fill the options of ``cfg`` (a :class:`~dmscale.config.run_config.RunConfig`) left at
    ``auto`` (None), except the structure lr (it needs the search's steps: the pipeline sets it
    with :func:`structure_lr_for`), and record each choice in ``cfg.chosen``."""
    d = defaults_for(cfg.task, cfg.model, cfg.pipeline)
    chosen = dict(cfg.chosen)
    if cfg.optimizer is None:
        cfg.optimizer, chosen["optimizer"] = d.optimizer, d.why
    if cfg.lr is None:
        cfg.lr, chosen["lr"] = d.lr_for(cfg.optimizer), d.why
    if cfg.weight_decay is None:
        cfg.weight_decay, chosen["weight_decay"] = d.weight_decay_for(cfg.optimizer), d.why
    if cfg.warmup is None:
        cfg.warmup, chosen["warmup"] = d.warmup, d.why
    if cfg.augment is None and d.augment is not None:
        cfg.augment, chosen["augment"] = dict(d.augment), d.why
    if cfg.resource_weight is None:
        cfg.resource_weight, chosen["resource_weight"] = d.resource_weight, d.why
    cfg.chosen = chosen


def auto_brief(cfg: Any) -> dict[str, dict[str, Any]]:
    """The options ``cfg`` left at auto, each as ``{"value": chosen value, "why": reason}``
    (a run's summary holds it; :func:`chosen_lines` prints it)."""
    return {name: {"value": getattr(cfg, name), "why": why} for name, why in cfg.chosen.items()}


def _value_text(value: Any) -> str:
    if isinstance(value, dict):
        return ",".join(f"{k}={_value_text(v)}" for k, v in value.items())
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def chosen_lines(auto: dict[str, dict[str, Any]]) -> list[str]:
    """The options chosen automatically, one line per reason, e.g. ``optimizer adamw, lr 0.001
    (auto for detect)``; ``auto`` maps an option to ``{"value": ..., "why": ...}``.

    Example:
        >>> chosen_lines({"optimizer": {"value": "adamw", "why": "auto for detect"},
        ...               "lr": {"value": 0.001, "why": "auto for detect"}})
        ['optimizer adamw, lr 0.001 (auto for detect)']
    """
    by_why: dict[str, list[str]] = {}
    for name, item in auto.items():
        label = name.replace("_", " ").replace("warmup", "warm-up")
        by_why.setdefault(str(item["why"]), []).append(f"{label} {_value_text(item['value'])}")
    return [f"{', '.join(items)} ({why})" for why, items in by_why.items()]
