"""The checks of a run configuration that span several options (one option's own check is
its converter in :mod:`dmscale.core.values`): the weights a run starts from, the export of
the best checkpoint, timm's auto-augmentation, hidden-state distillation, the retraining's start. Each raises a
:class:`~dmscale.core.errors.ConfigError` that names the options and the fix.
:class:`~dmscale.config.run_config.RunConfig` inherits them.

Example:
    >>> from dmscale.config.run_config import RunConfig
    >>> RunConfig(command="search", task="digits", export_best=True).resolved()  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    dmscale.core.errors.ConfigError: --export-best picks the best of the evaluations --eval-every makes, ...
"""

from __future__ import annotations

from typing import Any

from dmscale.core.errors import ConfigError

__all__ = ["DEFAULT_MODELS", "RunConfigChecks"]

DEFAULT_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "mnist": ("resnet", {"depth": 20, "width": 8}),
    "digits": ("resnet", {"depth": 20, "width": 8}),
    "imagefolder": ("resnet", {"depth": 20, "width": 16}),
    "shakespeare": ("charcnn", {}),
    "detect": ("yolo:yolov8n.yaml", {}),
}  # --task text has no default: it needs --model hf:PATH (the tokenizer comes with it)


class RunConfigChecks:
    """The cross-option checks, mixed into ``RunConfig`` (which holds every attribute used here)."""

    weights: Any
    pretrained: Any
    init: Any
    task: Any
    model: Any
    export_best: Any
    eval_every: Any
    command: Any
    pipeline: Any
    retrain_epochs: Any
    auto_augment: Any
    image_augment: Any
    distill_hidden: Any
    teacher: Any
    retrain_init: Any

    def _check_start_weights(self) -> None:
        """``--weights`` / ``--pretrained`` fit the model and do not compete with ``--init``."""
        if self.weights is None and not self.pretrained:
            return
        given = "--pretrained" if self.weights is None else "--weights"
        if self.init is not None:
            raise ConfigError(f"{given} sets the weights a run starts from and --init gives the "
                              "pretrained supernet: give one of them (--weights FILE with "
                              "--pretrain-epochs 0 is the pretrained supernet of pipeline p / p-)")
        default = DEFAULT_MODELS.get(self.task, ("",))[0]
        model = self.model or f"{default} (the default of --task {self.task})"
        if model.startswith(("hf:", "yolo:")):
            raise ConfigError(f"{given} loads weights into a model dmscale builds; --model {model} "
                              "brings its own (hf:PATH its directory, yolo:FILE.pt its checkpoint)")
        if self.pretrained and not model.startswith(("tv:", "timm:")):
            raise ConfigError(f"--pretrained loads the pretrained weights torchvision or timm ship, for "
                              f"--model tv:NAME or timm:NAME; --model {model} has none: give a weights "
                              "file with --weights PATH")

    def _check_export_best(self) -> None:
        if not self.export_best:
            return
        if self.eval_every is None:
            raise ConfigError("--export-best picks the best of the evaluations --eval-every makes, "
                              "and this run has none: add --eval-every N (steps) or Xe (epochs), "
                              "or leave --export-best out")
        if self.command == "search" and (self.pipeline == "p-" or not self.retrain_epochs):
            raise ConfigError("--export-best picks the best weights of the retraining, and this "
                              "search has none (pipeline p-, or --retrain-epochs 0): a search keeps "
                              "no best, its structure changes until its end. Retrain it "
                              "(--retrain-epochs E, or `dmscale retrain RUN --eval-every N "
                              "--export-best`), or leave --export-best out")
    def _check_auto_augment(self) -> None:
        if self.auto_augment is None:
            return
        if self.task != "imagefolder" or not str(self.model).startswith("timm:"):
            raise ConfigError(f"--auto-augment {self.auto_augment} is timm's augmentation of image "
                              f"folders; it needs --task imagefolder and --model timm:NAME (this run: "
                              f"--task {self.task} --model {self.model}): leave it out")
        if self.image_augment == "none":
            raise ConfigError(f"--auto-augment {self.auto_augment} adds to the training augmentation, "
                              "which --image-augment none turns off: give one of the two")

    def _check_distill_hidden(self) -> None:
        if not self.distill_hidden or self.command not in ("search", "retrain"):
            return
        if self.task not in ("text", "shakespeare"):
            raise ConfigError(f"--distill-hidden compares transformer hidden states, which the "
                              f"models of --task {self.task} do not return: use it with a "
                              "language model (--task text --model hf:PATH), or --distill-hidden 0")
        if not self.teacher:
            raise ConfigError("--distill-hidden compares the model's hidden states with a "
                              "teacher's, and this run has no teacher: give --teacher "
                              "RUN|FILE|supernet (hf: models distil from the original by "
                              "default), or --distill-hidden 0")

    def _check_retrain_init(self) -> None:
        """``--retrain-init pretrained`` needs pretrained weights: a pipeline p search (or the
        retraining of one)."""
        if self.retrain_init == "pretrained" and self.command in ("search", "retrain") and self.pipeline != "p":
            if self.pipeline == "p-":
                raise ConfigError("--retrain-init pretrained: a pipeline p- search trains no weights, so the weights "
                                  "it exports are the pretrained ones already; retrain it with --retrain-init inherit")
            raise ConfigError(f"--retrain-init pretrained starts the retraining from the pretrained supernet's "
                              f"weights, and a pipeline {self.pipeline} search has none: search with --pipeline p, "
                              "or retrain with --retrain-init inherit or scratch")
