"""The pretrained weights torchvision and timm ship (``--pretrained``), online or offline.

:func:`library_state` fetches the library's own state dict of ``tv:NAME``
(``torchvision.models.get_model(NAME, weights="DEFAULT")``) or ``timm:NAME``
(``timm.create_model(NAME, pretrained=True)``) -- from the cache when it is there, else
downloaded. :func:`fit_library_state` adapts it to the model the task built: a classifier
head for another number of classes keeps its random initialisation, a first convolution
for another number of channels gets the RGB kernels summed (one channel) or repeated and
scaled (as timm's ``adapt_input_conv`` does); every other tensor must fit exactly.

Offline (``HF_HUB_OFFLINE``, ``TRANSFORMERS_OFFLINE`` or ``DMSCALE_OFFLINE`` set, or the
download host not reachable within :data:`PROBE_TIMEOUT` seconds) weights that are not
cached fail at once with a :class:`ConfigError` that suggests ``--weights PATH``, instead of
the libraries' own retries (timm's Hub download retries for about a minute).

Example:
    >>> import torch
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten(), nn.Linear(4, 10))
    >>> lib = {"0.weight": torch.ones(4, 3, 3, 3), "0.bias": torch.zeros(4),
    ...        "2.weight": torch.zeros(1000, 4), "2.bias": torch.zeros(1000)}
    >>> state, notes = fit_library_state(net, lib, {"num_classes": 10, "in_channels": 1})
    >>> float(state["0.weight"][0, 0, 0, 0]), notes
    (3.0, ['2.weight, 2.bias kept random (10 classes, not 1000)', '0.weight adapted to 1 channel'])
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import threading
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.parse import urlparse

import torch
from torch import nn

from dmscale.config.run_config import ConfigError

__all__ = ["library_state", "fit_library_state", "network_reachable", "offline_reason",
           "OFFLINE_ENV", "PROBE_TIMEOUT"]

OFFLINE_ENV = ("DMSCALE_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
PROBE_TIMEOUT = 3.0  # seconds a connection to the download host may take before it counts as offline


def network_reachable(url: str, timeout: float = PROBE_TIMEOUT) -> bool:
    """Whether a TCP connection to ``url``'s host (or the HTTPS proxy, when one is set) opens
    within ``timeout`` seconds; name resolution included (it runs in a daemon thread)."""
    proxy = urllib.request.getproxies().get("https")
    target = urlparse(proxy if proxy else url)
    host, port = target.hostname, target.port or (443 if target.scheme in ("https", "") else 80)
    if not host:
        return False
    ok: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            ok.append(True)
        except OSError:
            pass

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(ok)


def offline_reason(url: str) -> str | None:
    """Why this machine counts as offline for ``url`` (an environment variable, or its host
    not answering), or None when it is online."""
    for var in OFFLINE_ENV:
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"{var}={os.environ[var]} is set"
    if not network_reachable(url):
        return f"{urlparse(url).hostname} cannot be reached"
    return None


@contextlib.contextmanager
def _hub_offline(on: bool) -> Iterator[None]:
    """Hugging Face Hub offline mode for the block: cached files load without a request."""
    if not on:
        yield
        return
    from huggingface_hub import constants

    was = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = was


def _torch_hub_cached(url: str) -> bool:
    return (Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(urlparse(url).path)).is_file()


def _hub_cached(repo: str, filename: str | None) -> bool:
    from huggingface_hub import try_to_load_from_cache

    names = [filename] if filename else ["model.safetensors", "pytorch_model.bin"]
    return any(isinstance(try_to_load_from_cache(repo, n), str) for n in names)


def _fetch(name: str, source: str, url: str, cached: bool, load: Callable[[bool], dict[str, torch.Tensor]]
           ) -> dict[str, torch.Tensor]:
    """``load(offline)`` unless the weights are not cached and this machine is offline."""
    reason = None if cached else offline_reason(url)
    local = ("run once where there is network (the download is cached for later runs), or give a "
             "local copy with --weights PATH (with --pretrained it is used like the download; "
             "alone it must fit the model exactly)")
    if reason is not None:
        raise ConfigError(f"--pretrained: the pretrained weights of --model {name} could not be fetched "
                          f"({source}): this machine seems offline ({reason}) and they are not in the "
                          f"cache; {local}")
    try:
        return load(cached)
    except (OSError, RuntimeError, ValueError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise ConfigError(f"--pretrained: the pretrained weights of --model {name} could not be fetched "
                          f"({source}: {type(err).__name__}: {first}); if this machine is offline, "
                          f"{local}") from None


def _tv_state(name: str, args: dict[str, Any]) -> dict[str, torch.Tensor]:
    from dmscale.core._compat import ensure_torchvision

    if not ensure_torchvision():
        raise ConfigError("--model tv:... needs torchvision: pip install 'dmscale[vision]'")
    import torchvision

    arch = name[3:]
    try:
        weights = torchvision.models.get_model_weights(arch).DEFAULT
    except (ValueError, KeyError, AttributeError):
        raise ConfigError(f"--pretrained: torchvision ships no pretrained weights for {arch!r}: "
                          "leave --pretrained out, or give a file with --weights PATH") from None

    def load(_cached: bool) -> dict[str, torch.Tensor]:
        return torchvision.models.get_model(arch, weights=weights, **args).state_dict()

    return _fetch(name, f"torchvision's {weights} from {weights.url}", weights.url,
                  _torch_hub_cached(weights.url), load)


def _timm_state(name: str, args: dict[str, Any]) -> dict[str, torch.Tensor]:
    import timm

    arch = name[5:]
    cfg = timm.models.get_pretrained_cfg(arch)  # a tag-less name: its default tag's
    hub, url = getattr(cfg, "hf_hub_id", None), getattr(cfg, "url", None)
    if not hub and not url:
        raise ConfigError(f"--pretrained: timm ships no pretrained weights for {arch!r}: leave "
                          "--pretrained out, or give a file with --weights PATH")
    if hub:
        endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
        where, probe = f"timm's weights from the Hugging Face Hub, {hub}", endpoint
        cached = _hub_cached(hub, getattr(cfg, "hf_hub_filename", None))
    else:
        where, probe, cached = f"timm's weights from {url}", str(url), _torch_hub_cached(str(url))

    def load(offline: bool) -> dict[str, torch.Tensor]:
        with _hub_offline(offline):
            return timm.create_model(arch, pretrained=True, **args).state_dict()

    return _fetch(name, where, probe, cached, load)


def library_state(name: str, args: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The state dict torchvision or timm ship for ``tv:NAME`` / ``timm:NAME`` built with
    ``args`` (their ImageNet head and RGB input), from the cache or downloaded.

    Raises:
        ConfigError: not a tv:/timm: model, the library has no weights for it, or they could
            not be fetched (offline: at once, naming ``--weights PATH`` as the way out).
    """
    if name.startswith("tv:"):
        return _tv_state(name, args)
    if name.startswith("timm:"):
        return _timm_state(name, args)
    raise ConfigError(f"--pretrained loads the weights torchvision or timm ship, not of --model {name}")


def fit_library_state(model: nn.Module, state: dict[str, torch.Tensor], info: dict[str, Any]
                      ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """``state`` (a library's pretrained weights) fitted to ``model``: tensors of the
    classifier head for another class count replaced by the model's own (random) ones, the
    first convolution's kernels adapted to ``info['in_channels']``; other tensors unchanged
    (a mismatch among them is left for the caller's strict check). Returns the state and
    notes of what was changed."""
    own = model.state_dict()
    n_cls, c_in = int(info.get("num_classes", -1)), int(info.get("in_channels", 3))
    out, head, conv = dict(state), [], []
    for key, lib in state.items():
        mine = own.get(key)
        if mine is None or mine.shape == lib.shape or mine.dim() != lib.dim():
            continue
        if mine.shape[1:] == lib.shape[1:] and mine.shape[0] == n_cls:
            out[key] = mine.detach().clone()
            head.append((key, lib.shape[0]))
        elif lib.dim() == 4 and mine.shape[0] == lib.shape[0] and mine.shape[2:] == lib.shape[2:] \
                and mine.shape[1] == c_in and lib.shape[1] == 3:
            w = lib.float()
            w = w.sum(1, keepdim=True) if c_in == 1 else \
                w.repeat(1, math.ceil(c_in / 3), 1, 1)[:, :c_in] * (3 / c_in)
            out[key] = w.to(lib.dtype)
            conv.append(key)
    notes = []
    if head:
        notes.append(f"{', '.join(k for k, _ in head)} kept random ({n_cls} classes, not {head[0][1]})")
    if conv:
        notes.append(f"{', '.join(conv)} adapted to {c_in} channel{'s' if c_in != 1 else ''}")
    return out, notes
