"""Built-in tasks and models of the ``dmscale`` command, by name.

A :class:`Task` owns its data (in memory), draws training batches deterministically from
``(seed, step)`` -- so an interrupted run resumes on exactly the batches it would have seen --
computes the task loss and evaluates a model. :func:`build_model` makes the supernet from a
name (``resnet``, ``smallcnn``, ``tv:NAME``, ``timm:NAME``, ``charcnn``, ``llama``, or the
user's ``package.module:factory``) and the task's ``info`` alone (classes, channels, vocabulary), so a run directory can rebuild its
model without loading any data.

Example:
    >>> from dmscale.config.run_config import RunConfig
    >>> cfg = RunConfig(task="digits").resolved()
    >>> task = build_task(cfg)
    >>> model, exclude = build_model(cfg, task.info)
    >>> x, y = task.train_batch(step=0, batch_size=4, seed=0)
    >>> tuple(task.forward(model, x).shape), exclude
    ((4, 10), [])
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from dmscale.config.run_config import ConfigError, RunConfig
from dmscale.data.order import epoch_permutation as _epoch_permutation  # the order of every task's batches
from dmscale.tasks.distill import DistillTerm, Distillation, distill_loss, hidden_distill_loss, kept_hidden_channels

# the distillation helpers live in .distill; re-exported here, where they were first
__all__ = ["Task", "build_task", "build_model", "register_task", "register_models", "MODEL_NAMES",
           "is_import_path", "classification_metrics",
           "distill_loss", "hidden_distill_loss", "kept_hidden_channels", "Distillation", "DistillTerm"]

MODEL_NAMES = ("resnet", "smallcnn", "tv:NAME", "timm:NAME", "charcnn", "llama", "yolo:YAML", "hf:PATH",
               "MODULE:FACTORY")
# the families build_model dispatches to, each registered by the module that builds it
MODEL_FAMILIES = ("image", "language", "detection", "hf", "user")
# the NAME: prefixes of built-in families; any other `module.path:attribute` is the user's factory
FAMILY_PREFIXES = ("tv", "timm", "yolo", "hf")
_IMPORT_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def is_import_path(name: str | None) -> bool:
    """Whether ``--model name`` is the user's own factory, ``package.module:attribute``
    (an entry-point style import path whose module is not a built-in family prefix).

    Example:
        >>> is_import_path("my_pkg.nets:build"), is_import_path("timm:resnet18"), is_import_path("resnet")
        (True, False, False)
    """
    return bool(name) and bool(_IMPORT_PATH.fullmatch(str(name))) \
        and str(name).partition(":")[0] not in FAMILY_PREFIXES

_TASKS: dict[str, Callable[[RunConfig], "Task"]] = {}
_MODELS: dict[str, Callable[..., Any]] = {}


def register_task(*names: str) -> Callable[[Callable[[RunConfig], "Task"]], Callable[[RunConfig], "Task"]]:
    """Decorator: ``build(cfg) -> Task`` is the task of ``--task NAME`` for each name.

    The built-in tasks register themselves when :mod:`dmscale.tasks` is imported; this
    module imports none of them.
    """
    def add(build: Callable[[RunConfig], "Task"]) -> Callable[[RunConfig], "Task"]:
        for name in names:
            if name in _TASKS and _TASKS[name] is not build:
                raise ConfigError(f"task {name!r} is registered twice: {_TASKS[name]} and {build}")
            _TASKS[name] = build
        return build
    return add


def register_models(family: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: the builder of one model family of :func:`build_model` (one of
    :data:`MODEL_FAMILIES`; the builder's arguments are the family's, see build_model)."""
    if family not in MODEL_FAMILIES:
        raise ConfigError(f"unknown model family {family!r}: expected one of {MODEL_FAMILIES}")

    def add(build: Callable[..., Any]) -> Callable[..., Any]:
        _MODELS[family] = build
        return build
    return add


def _models(family: str) -> Callable[..., Any]:
    try:
        return _MODELS[family]
    except KeyError:
        raise ConfigError(f"no builder for {family} models is registered: import dmscale.tasks "
                          "(it registers the built-in ones)") from None


class Task:
    """Base class of the built-in tasks.

    Attributes:
        name: the task's name (``--task``).
        kind: ``"classification"`` or ``"language"``.
        metric: the headline metric of :meth:`evaluate` (``"acc"`` or ``"bpc"``).
        info: what :func:`build_model` needs (saved in the run's config).
        shards_by_rank: under torchrun, :meth:`train_batch` returns (and loads) only this
            rank's share of the global batch, so the step loop does not cut it again
            (:func:`dmscale.engine.ddp.shard_of_this_rank`). False: every rank gets the whole
            global batch and keeps its share.
    """

    name: str = ""
    kind: str = "classification"
    metric: str = "acc"
    higher_is_better: bool = True
    shards_by_rank: bool = False
    info: dict[str, Any]

    def example_inputs(self) -> torch.Tensor:
        """One input example (batch of 1): the unit of MACs and the tracing input."""
        raise NotImplementedError

    def steps_per_epoch(self, batch_size: int) -> int:
        raise NotImplementedError

    def train_batch(self, step: int, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch of global ``step``: a pure function of ``(step, batch_size, seed)``."""
        raise NotImplementedError

    def forward(self, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        """Logits of ``model`` on ``inputs`` (the last dim holds classes or characters)."""
        out = model(inputs)
        return out.logits if hasattr(out, "logits") else out

    def forward_hidden(self, model: nn.Module, inputs: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """``(logits, hidden_states)`` of ``model`` on ``inputs``, for ``--distill-hidden``.

        Raises:
            ConfigError: the model's forward cannot return hidden states.
        """
        inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        if not getattr(inner, "returns_hidden_states", False):
            raise ConfigError(
                f"--distill-hidden compares transformer hidden states, and the model of task "
                f"{self.name!r} ({type(model).__name__}) returns logits only: use a Hugging Face "
                "causal LM (--task text --model hf:PATH, or --task shakespeare --model llama), "
                "or --distill-hidden 0")
        logits, hidden = model(inputs, output_hidden_states=True)
        return logits, tuple(hidden)

    def task_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def batch_metric(self, logits: torch.Tensor, targets: torch.Tensor) -> float:
        """Accuracy of one batch (next-character accuracy for language)."""
        return float((logits.argmax(-1) == targets).float().mean())

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batch_size: int = 256, device: torch.device | str = "cpu",
                 limit: int | None = None) -> dict[str, float]:
        """Metrics on the test split (the first ``limit`` examples when given)."""
        raise NotImplementedError

    def describe(self) -> str:
        """One line about the data."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what loading holds (loader worker processes); the task stays usable."""

    def format_metrics(self, metrics: dict[str, float]) -> str:
        if self.kind == "language":
            return (f"bits/char {metrics['bpc']:.3f}, perplexity {metrics['ppl']:.2f}, "
                    f"next-char accuracy {100 * metrics['acc']:.1f}%")
        return f"accuracy {100 * metrics['acc']:.2f}% (loss {metrics['loss']:.3f})"


def classification_metrics(forward: Callable[[nn.Module, torch.Tensor], torch.Tensor], model: nn.Module,
                           batches: Iterable[tuple[torch.Tensor, torch.Tensor]], n: int) -> dict[str, float]:
    """Accuracy and mean cross-entropy of ``model`` over ``batches`` of ``(x, y)`` (``n``
    examples in all), in eval mode, the model's own mode restored afterwards."""
    was = model.training
    model.eval()
    correct, loss = 0, 0.0
    try:
        with torch.no_grad():
            for x, y in batches:
                logits = forward(model, x).float()
                loss += float(F.cross_entropy(logits, y, reduction="sum"))
                correct += int((logits.argmax(-1) == y).sum())
    finally:
        model.train(was)
    return {"acc": correct / n, "loss": loss / n, "examples": n}


def build_task(cfg: RunConfig) -> Task:
    """The task of ``cfg`` with its data loaded.

    Raises:
        ConfigError: the data cannot be found or read, or a limit is too large.
    """
    build = _TASKS.get(cfg.task)
    if build is None:
        raise ConfigError(f"unknown task {cfg.task!r}: expected one of {', '.join(sorted(_TASKS))}")
    try:
        return build(cfg)
    except (FileNotFoundError, NotADirectoryError, ImportError, ValueError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"task {cfg.task}: {err}") from None


def build_model(cfg: RunConfig, info: dict[str, Any]) -> tuple[nn.Module, list[str]]:
    """The supernet named by ``cfg.model`` for a task with ``info``.

    Returns:
        ``(model, exclude)``: ``exclude`` lists module names whose widths the search must
        keep fixed for this model (added to ``--exclude``).

    Raises:
        ConfigError: unknown model name, bad ``--model-args``, or ``--expand`` on a model
            that cannot be enlarged.
    """
    name = cfg.model or ("charcnn" if info.get("kind") == "language" else "resnet")
    args = dict(cfg.model_args or {})
    expand = cfg.expand or {"width": 1.0, "depth": 1.0}
    kind = info.get("kind", "classification")
    if is_import_path(name):  # the user's classifier or character LM (tasks/user_models.py)
        if kind not in ("classification", "language") or "tokenizer" in info:
            raise ConfigError(f"--model {name} (your own model) goes with an image task (mnist, digits, "
                              f"imagefolder) or --task shakespeare, not with task {cfg.task!r}, whose "
                              "models are " + ("yolo:YAML" if kind == "detection" else "hf:PATH"))
        return _models("user")(name, args, expand, info), []
    if name.startswith("yolo:") != (kind == "detection"):
        want = "yolo:YAML or yolo:FILE.pt" if kind == "detection" else "a model of this task, not yolo:"
        raise ConfigError(f"--model {name} does not fit task {cfg.task!r}: use {want}")
    if kind == "detection":
        return _models("detection")(name, expand, info), []
    hf = name.startswith("hf:")
    language = name in ("charcnn", "llama") or hf
    if language != (kind == "language"):
        want = ("charcnn, llama or MODULE:FACTORY" if kind == "language"
                else "an image model (resnet, smallcnn, tv:, timm:, MODULE:FACTORY)")
        raise ConfigError(f"--model {name} does not fit task {cfg.task!r}: use {want}")
    if hf != ("tokenizer" in info):
        raise ConfigError(f"--model {name} does not fit task {cfg.task!r}: a pretrained "
                          "--model hf:PATH goes with --task text (its own tokenizer), the "
                          "char-level models charcnn and llama with --task shakespeare")
    if hf:
        if cfg.expand:
            raise ConfigError(f"--expand enlarges the built-in models only, not the pretrained "
                              f"--model {name}")
        return _models("hf")(name[3:], args), []
    try:
        if name in ("resnet", "smallcnn") or name.startswith(("tv:", "timm:")):
            return _models("image")(name, args, expand, info), []
        if name in ("charcnn", "llama"):
            return _models("language")(name, args, expand, info)
    except TypeError as err:  # a constructor rejected --model-args
        raise ConfigError(f"--model-args for {name}: {err}") from None
    raise ConfigError(f"unknown --model {name!r}: expected one of {', '.join(MODEL_NAMES)}")


def scaled(value: int, factor: float, minimum: int = 1) -> int:
    """``round(value * factor)``, at least ``minimum``."""
    return max(minimum, int(math.floor(value * factor + 0.5)))
