"""The weights a run starts from: ``--weights PATH`` and ``--pretrained``.

:func:`load_start_weights` loads them into the model :func:`~dmscale.tasks.registry.build_model`
built, once, when a run starts the phase that begins from the supernet's initial weights
(pretraining; the search of pipeline ``np``; in pipelines ``p`` / ``p-`` with
``--pretrain-epochs 0`` they are the pretrained supernet). A resumed run continues from its
checkpoint and a rebuilt one (export, eval, retrain) from its own files, so neither reads the
file or the network again; ``config.yaml`` records both options.

* ``--weights PATH`` alone: a ``.safetensors`` file, a ``torch.save``'d state dict, or a
  checkpoint dict holding one under ``"state_dict"``, ``"model"`` or ``"model_state_dict"``
  (:func:`dmscale.export.files.read_state_dict`); every key and shape must fit the model
  (a prefix like DDP's ``module.`` on every key is dropped), else a :class:`ConfigError`
  names the first key missing, unexpected or of another shape (with both shapes).
* ``--pretrained`` (``tv:``, ``timm:``): the library's own weights
  (:mod:`dmscale.tasks.pretrained`), the head for another class count left random and the
  first convolution adapted to the task's channels.
* both: ``PATH`` is a local copy of the library's weights, adapted the same way (the way to
  use ``--pretrained`` offline).

Example:
    >>> import tempfile, torch
    >>> from dataclasses import replace
    >>> from dmscale.config.run_config import RunConfig
    >>> from dmscale.tasks.registry import build_model
    >>> info = {"kind": "classification", "num_classes": 10, "in_channels": 1, "image_size": [8, 8]}
    >>> cfg = RunConfig(task="digits", model="smallcnn", model_args={"width": 4, "blocks": 1}).resolved()
    >>> path = tempfile.mkdtemp() + "/start.pt"
    >>> torch.save(build_model(cfg, info)[0].state_dict(), path)
    >>> model, _ = build_model(cfg, info)
    >>> load_start_weights(model, replace(cfg, weights=path), info).startswith("starting from the weights in")
    True
"""

from __future__ import annotations

from typing import Any

from torch import nn

from dmscale.config.run_config import ConfigError, RunConfig
from dmscale.core.errors import DMScaleError
from dmscale.export.files import load_state_checked, read_state_dict
from dmscale.tasks.pretrained import fit_library_state, library_state

__all__ = ["load_start_weights", "load_weights_file", "starts_from_weights"]


def starts_from_weights(cfg: RunConfig) -> bool:
    """Whether the run starts from given weights (``--weights`` or ``--pretrained``)."""
    return cfg.weights is not None or bool(cfg.pretrained)


def load_weights_file(model: nn.Module, path: str, flag: str = "--weights",
                      model_name: str = "the model", hint: str = "") -> nn.Module:
    """Load the weights file at ``path`` into ``model``, every key and shape checked.

    Raises:
        ConfigError: the file is missing or unreadable, holds no state dict, or does not fit
            (the message names the first offending key, with both shapes for a shape).
    """
    try:
        return load_state_checked(model, read_state_dict(path), str(path), model_name)
    except DMScaleError as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"{flag}: {err}; give weights saved from this architecture (the same "
                          f"--model and --model-args){hint}") from None


def load_start_weights(model: nn.Module, cfg: RunConfig, info: dict[str, Any]) -> str | None:
    """Load the weights ``cfg`` starts from into ``model`` (built by ``build_model(cfg, info)``);
    returns a line saying what was loaded, or None when the run starts from random weights.

    Raises:
        ConfigError: the file does not fit, or the pretrained weights could not be fetched.
    """
    if not starts_from_weights(cfg):
        return None
    name = str(cfg.model)
    if not cfg.pretrained:
        library = name.startswith(("tv:", "timm:"))
        load_weights_file(model, str(cfg.weights), model_name=f"--model {name}",
                          hint=" or, for the library's own pretrained weights of another class or channel "
                               "count, add --pretrained (it adapts the head and the first convolution)"
                          if library else "")
        return f"starting from the weights in {cfg.weights}"
    if cfg.weights is not None:
        try:
            state = read_state_dict(cfg.weights)
        except DMScaleError as err:
            raise ConfigError(f"--weights (with --pretrained): {err}") from None
        origin = f"the pretrained weights of {name} in {cfg.weights}"
    else:
        state = library_state(name, dict(cfg.model_args or {}))
        origin = f"{name.split(':')[0].replace('tv', 'torchvision')}'s pretrained weights of {name.split(':', 1)[1]}"
    fitted, notes = fit_library_state(model, state, info)
    try:
        load_state_checked(model, fitted, origin, f"--model {name}")
    except DMScaleError as err:
        raise ConfigError(f"--pretrained: {err}; the library's weights are for {name} with its default "
                          "--model-args (drop the ones that change its shapes)") from None
    return f"starting from {origin}" + (f" ({'; '.join(notes)})" if notes else "")
