"""The checks of a run configuration that span several options (one option's own check is
its converter in :mod:`dmscale.core.values`): the weights a run starts from, the export of
the best checkpoint, timm's auto-augmentation, hidden-state distillation, the retraining's start. Each raises a
:class:`~dmscale.core.errors.ConfigError` that names the options and the fix. Each is a
function of the configuration (any :class:`~dmscale.config.options.RunOptions`, so a
:class:`~dmscale.config.run_config.RunConfig`), called once by ``RunConfig.__post_init__``
(:func:`check_start_weights`) or ``RunConfig.resolved`` (the others, on resolved values).

Example:
    >>> from dmscale.config.run_config import RunConfig
    >>> RunConfig(command="search", task="digits", export_best=True).resolved()  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    dmscale.core.errors.ConfigError: --export-best picks the best of the evaluations --eval-every makes, ...
"""

from __future__ import annotations

from typing import Any

from dmscale.config.options import RunOptions
from dmscale.core.errors import ConfigError

__all__ = ["DEFAULT_MODELS", "check_auto_augment", "check_distill_hidden", "check_export_best",
           "check_retrain_init", "check_start_weights"]

DEFAULT_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "mnist": ("resnet", {"depth": 20, "width": 8}),
    "digits": ("resnet", {"depth": 20, "width": 8}),
    "imagefolder": ("resnet", {"depth": 20, "width": 16}),
    "shakespeare": ("charcnn", {}),
    "detect": ("yolo:yolov8n.yaml", {}),
}  # --task text has no default: it needs --model hf:PATH (the tokenizer comes with it)


def check_start_weights(cfg: RunOptions) -> None:
    """``--weights`` / ``--pretrained`` fit the model and do not compete with ``--init``."""
    if cfg.weights is None and not cfg.pretrained:
        return
    given = "--pretrained" if cfg.weights is None else "--weights"
    if cfg.init is not None:
        raise ConfigError(f"{given} sets the weights a run starts from and --init gives the "
                          "pretrained supernet: give one of them (--weights FILE with "
                          "--pretrain-epochs 0 is the pretrained supernet of pipeline p / p-)")
    default = DEFAULT_MODELS.get(cfg.task, ("",))[0]
    model = cfg.model or f"{default} (the default of --task {cfg.task})"
    if model.startswith(("hf:", "yolo:")):
        raise ConfigError(f"{given} loads weights into a model dmscale builds; --model {model} "
                          "brings its own (hf:PATH its directory, yolo:FILE.pt its checkpoint)")
    if cfg.pretrained and not model.startswith(("tv:", "timm:")):
        raise ConfigError(f"--pretrained loads the pretrained weights torchvision or timm ship, for "
                          f"--model tv:NAME or timm:NAME; --model {model} has none: give a weights "
                          "file with --weights PATH")


def check_export_best(cfg: RunOptions) -> None:
    """``--export-best`` has evaluations to pick from (``--eval-every``) and a retraining."""
    if not cfg.export_best:
        return
    if cfg.eval_every is None:
        raise ConfigError("--export-best picks the best of the evaluations --eval-every makes, "
                          "and this run has none: add --eval-every N (steps) or Xe (epochs), "
                          "or leave --export-best out")
    if cfg.command == "search" and (cfg.pipeline == "p-" or not cfg.retrain_epochs):
        raise ConfigError("--export-best picks the best weights of the retraining, and this "
                          "search has none (pipeline p-, or --retrain-epochs 0): a search keeps "
                          "no best, its structure changes until its end. Retrain it "
                          "(--retrain-epochs E, or `dmscale retrain RUN --eval-every N "
                          "--export-best`), or leave --export-best out")


def check_auto_augment(cfg: RunOptions) -> None:
    """``--auto-augment`` is timm's, for image folders, on top of an augmentation."""
    if cfg.auto_augment is None:
        return
    if cfg.task != "imagefolder" or not str(cfg.model).startswith("timm:"):
        raise ConfigError(f"--auto-augment {cfg.auto_augment} is timm's augmentation of image "
                          f"folders; it needs --task imagefolder and --model timm:NAME (this run: "
                          f"--task {cfg.task} --model {cfg.model}): leave it out")
    if cfg.image_augment == "none":
        raise ConfigError(f"--auto-augment {cfg.auto_augment} adds to the training augmentation, "
                          "which --image-augment none turns off: give one of the two")


def check_distill_hidden(cfg: RunOptions) -> None:
    """``--distill-hidden`` needs a language model and a teacher."""
    if not cfg.distill_hidden or cfg.command not in ("search", "retrain"):
        return
    if cfg.task not in ("text", "shakespeare"):
        raise ConfigError(f"--distill-hidden compares transformer hidden states, which the "
                          f"models of --task {cfg.task} do not return: use it with a "
                          "language model (--task text --model hf:PATH), or --distill-hidden 0")
    if not cfg.teacher:
        raise ConfigError("--distill-hidden compares the model's hidden states with a "
                          "teacher's, and this run has no teacher: give --teacher "
                          "RUN|FILE|supernet (hf: models distil from the original by "
                          "default), or --distill-hidden 0")


def check_retrain_init(cfg: RunOptions) -> None:
    """``--retrain-init pretrained`` needs pretrained weights: a pipeline p search (or the
    retraining of one)."""
    if cfg.retrain_init == "pretrained" and cfg.command in ("search", "retrain") and cfg.pipeline != "p":
        if cfg.pipeline == "p-":
            raise ConfigError("--retrain-init pretrained: a pipeline p- search trains no weights, so the weights "
                              "it exports are the pretrained ones already; retrain it with --retrain-init inherit")
        raise ConfigError(f"--retrain-init pretrained starts the retraining from the pretrained supernet's "
                          f"weights, and a pipeline {cfg.pipeline} search has none: search with --pipeline p, "
                          "or retrain with --retrain-init inherit or scratch")
